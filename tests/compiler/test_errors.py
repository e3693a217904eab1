"""Every user-facing failure: one clear line naming the input and the fix, a non-zero exit, no output."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import save_checkpoint
from kiln.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def assert_fails(capsys, tmp_path, args: list[str], code: int, *phrases: str) -> str:
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "compile", *args, "-o", str(out), "-q", "--threads", "2")
    assert rc == code, err
    lines = [line for line in err.strip().splitlines() if line.startswith("kiln compile: error:")]
    assert len(lines) == 1, err
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".kiln-tmp-" in p.name]
    return lines[0]


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("good") / "bert", "bert", "base")


def copy_ckpt(good_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(good_ckpt, dst)
    return dst


def test_missing_path(capsys, tmp_path):
    assert_fails(capsys, tmp_path, [str(tmp_path / "nope")], 1, "does not exist", "checkpoint directory")


def test_directory_without_config(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_fails(capsys, tmp_path, [str(tmp_path / "empty")], 1, "has no config.json")


def test_config_not_json(capsys, tmp_path, good_ckpt):
    ckpt = copy_ckpt(good_ckpt, tmp_path)
    (ckpt / "config.json").write_text("{not json")
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "config.json is not valid JSON")


def test_corrupt_safetensors(capsys, tmp_path, good_ckpt):
    ckpt = copy_ckpt(good_ckpt, tmp_path)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated download
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "model.safetensors is corrupt", "truncated")


def test_garbage_safetensors(capsys, tmp_path, good_ckpt):
    ckpt = copy_ckpt(good_ckpt, tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "is corrupt")


def test_missing_weights(capsys, tmp_path, good_ckpt):
    ckpt = copy_ckpt(good_ckpt, tmp_path)
    (ckpt / "model.safetensors").unlink()
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "has no weights")


def test_model_type_transformers_cannot_load(capsys, tmp_path, good_ckpt):
    ckpt = copy_ckpt(good_ckpt, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "notatransformer"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "'notatransformer'", "cannot load", "upgrade transformers")


def test_architecture_whose_graph_fixes_the_length_names_it(capsys, tmp_path):
    """Not refused by name: a Mamba checkpoint loads and traces (an architecture without attention may compile, as
    FNet's does), and fails because its graph serves one sequence length only."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)).save_pretrained(
        tmp_path / "mamba")
    assert_fails(capsys, tmp_path, [str(tmp_path / "mamba")], 1, "MambaForCausalLM", "fixes input_ids axis 1 (sequence)",
                 "cannot be compiled")


def test_unsupported_head_suggests_task(capsys, tmp_path, good_ckpt):
    ckpt = copy_ckpt(good_ckpt, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "BertForMaskedLM", "--task", "feature-extraction")


def test_task_not_for_kind(capsys, tmp_path, good_ckpt):
    assert_fails(capsys, tmp_path, [str(good_ckpt), "--task", "causal-lm"], 1, "causal-lm", "not supported for encoder")


def test_head_weights_missing_is_not_random_init(capsys, tmp_path, good_ckpt):
    assert_fails(capsys, tmp_path, [str(good_ckpt), "--task", "sequence-classification"], 1, "random weights", "--task")


def test_existing_output_needs_force(capsys, tmp_path, good_ckpt):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "compile", str(good_ckpt), "-o", str(out), "-q")
    assert rc == 2
    assert "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_unknown_disabled_pass(capsys, tmp_path, good_ckpt):
    assert_fails(capsys, tmp_path, [str(good_ckpt), "--disable-pass", "fuse-everything"], 2, "fuse-everything", "no such pass")


def test_bad_usage_exits_2(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "compile", str(tmp_path))
    assert rc == 2 and "-o" in err
    rc, _, err = run_cli(capsys, "compile", str(tmp_path), "-o", str(tmp_path / "x"), "--precision", "fp8")
    assert rc == 2


def test_parity_failure_fails_compile_without_artifact(capsys, tmp_path, good_ckpt, monkeypatch):
    from kiln.compiler import trace

    real_run = trace.EagerRunner.run

    def drifted(self, feeds):  # plant a mismatch between eager and artifact
        out = real_run(self, feeds)
        return {k: v + 1e-2 for k, v in out.items()}

    monkeypatch.setattr(trace.EagerRunner, "run", drifted)
    line = assert_fails(capsys, tmp_path, [str(good_ckpt)], 1, "parity check failed", "max abs error", "report in")
    report = line.rsplit("report in ", 1)[1].strip()
    assert json.loads(open(report).read())["passed"] is False


ORT_BROADCAST = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. "
                 "Name:'node_add_3447' Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/math/"
                 "element_wise_ops.h:563 void onnxruntime::BroadcastIterator::Init(ptrdiff_t, ptrdiff_t) axis == 1 || "
                 "axis == largest was false. Attempting to broadcast an axis by a dimension other than 1. 8 by 32")
"""ONNX Runtime's words when a graph holds a size of its traced example (a tiny DeepSeek-V4, traced at 8 tokens)."""


def test_a_graph_that_fails_on_a_verification_shape_names_the_case(capsys, tmp_path, good_ckpt, monkeypatch):
    """ONNX Runtime failing inside the compiled graph on one of verification's shapes is a failed compile (exit 1, no
    artifact) that names the case, its shape and ONNX Runtime's own words without its C++ source line, and says what
    to do; not "the artifact is broken: recompile it", which is a loaded artifact's advice."""
    import onnxruntime as ort

    real = ort.InferenceSession.run

    def held(self, names, feeds, *args, **kwargs):
        ids = feeds.get("input_ids")
        if ids is not None and ids.shape[0] == 2:
            raise RuntimeError(ORT_BROADCAST)
        return real(self, names, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", held)
    line = assert_fails(capsys, tmp_path, [str(good_ckpt)], 1, str(good_ckpt), "fails on verification case random 2x",
                        "(input_ids 2x", "Status Message: Attempting to broadcast an axis by a dimension other than "
                        "1. 8 by 32", "--disable-pass", "config.json")
    assert "onnxruntime_src" not in line and "recompile" not in line


def test_success_prints_parity_table(capsys, tmp_path, good_ckpt):
    out = tmp_path / "out"
    rc, stdout, err = run_cli(capsys, "compile", str(good_ckpt), "-o", str(out), "--threads", "2")
    assert rc == 0, err
    assert "verification passed" in stdout and "last_hidden_state" in stdout and "latency" in stdout
    lines = [line for line in err.splitlines() if line.startswith("[kiln")]
    assert any("export" in line for line in lines)  # progress lines, each with time and memory (now, peak so far)
    memory = [re.match(r"\[kiln +[\d.]+s ([\d.]+) GiB, peak ([\d.]+)\] ", line) for line in lines]
    assert all(memory), lines
    now, peak = zip(*((float(m[1]), float(m[2])) for m in memory))
    assert 0.05 < now[0] <= peak[0] and list(peak) == sorted(peak) and all(n <= p for n, p in zip(now, peak))
    rc, stdout, _ = run_cli(capsys, "compile", str(good_ckpt), "-o", str(tmp_path / "j"), "--json", "--no-verify")
    assert rc == 0 and json.loads(stdout)["verification"]["status"] == "skipped"


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/kiln-pwned",))


def test_bin_weights_load_as_plain_tensors_only(capsys, tmp_path, good_ckpt):
    import os

    import torch
    from safetensors.torch import load_file

    ckpt = copy_ckpt(good_ckpt, tmp_path)
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    rc, _, err = run_cli(capsys, "compile", str(ckpt), "-o", str(tmp_path / "ok"), "-q", "--threads", "2")
    assert rc == 0, err

    torch.save({"weights": state, "evil": _Payload()}, ckpt / "pytorch_model.bin")
    assert_fails(capsys, tmp_path, [str(ckpt)], 1, "pytorch_model.bin cannot be loaded as plain tensors", "safetensors")
    assert not os.path.exists("/tmp/kiln-pwned")


def test_unfused_layers_ship_verified_and_refused_only_when_required(capsys, tmp_path, good_ckpt, monkeypatch):
    """A layer no fused kernel takes runs on the standard-op fallback, verified, and the manifest says which and
    why; --require-fusion makes it a failure naming the same reason."""
    from kiln.passes import fuse_attention

    real = fuse_attention.FuseAttention.match
    calls = {"n": 0}

    def every_other(self, g, c, kinds, types):  # plant a layer the kernels cannot take
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            raise fuse_attention.NoMatch("planted: layer shape not supported")
        return real(self, g, c, kinds, types)

    monkeypatch.setattr(fuse_attention.FuseAttention, "match", every_other)
    assert_fails(capsys, tmp_path, [str(good_ckpt), "--require-fusion"], 1, "incomplete fusion",
                 "1 of 2 attention blocks run unfused", "planted", "--require-fusion")
    out = tmp_path / "partial"
    rc, _, err = run_cli(capsys, "compile", str(good_ckpt), "-o", str(out), "-q")
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    attention = manifest["attention"]
    assert (attention["layers"], attention["fused"], attention["unfused"]) == (2, 1, 1)
    assert attention["lowered"] == {"fuse-attention": 1, "lower-attention": 1}
    assert any("planted: layer shape not supported" in w for w in attention["why"])
    entry = next(p for p in manifest["passes"] if p["name"] == "fuse-attention")
    assert entry["coverage"] == {"expected": 2, "fused": 1}


def test_disabled_pass_is_recorded(capsys, tmp_path, good_ckpt):
    out = tmp_path / "nofuse"
    rc, _, err = run_cli(capsys, "compile", str(good_ckpt), "-o", str(out), "-q", "--disable-pass", "fuse-attention")
    assert rc == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"name": "fuse-attention", "disabled": True, "stats": {}} in manifest["passes"]


def test_a_head_size_the_kernel_cannot_take_compiles_on_the_fallback(capsys, tmp_path):
    """A real Llama with head size 12: GroupQueryAttention cannot take it, so every layer runs as standard ops with
    a Concat cache, verified through 16 greedy steps; --require-fusion fails naming why."""
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=128, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    ckpt = tmp_path / "llama-hd12"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    assert_fails(capsys, tmp_path, [str(ckpt), "--require-fusion"], 1, "2 of 2 attention blocks run unfused",
                 "head size 12 is not a multiple of 8", "--require-fusion")
    rc, _, err = run_cli(capsys, "compile", str(ckpt), "-o", str(tmp_path / "ok"), "-q", "--threads", "2",
                         "--verify-max-length", "32")
    assert rc == 0, err
    manifest = json.loads((tmp_path / "ok" / "manifest.json").read_text())
    assert manifest["attention"]["unfused"] == 2 and manifest["attention"]["cache"] == "kv-cache-concat"
    assert manifest["kv_cache"]["shared_buffer"] is False and manifest["kv_cache"]["head_size"] == 12
    gen = manifest["verification"]["generation"]
    assert gen["steps"] == 16 and gen["through"] == "kv cache" and gen["max_abs_over_atol"] <= 1
    entry = next(p for p in manifest["passes"] if p["name"] == "fuse-gqa")
    assert entry["coverage"] == {"expected": 2, "fused": 0}


def test_broken_cache_path_fails_generation_check(capsys, tmp_path, monkeypatch):
    """Prefill parity cannot see a cache bug; the greedy-generation check must. Planted: GPT-2's learned
    positions are not cut to the new tokens, so every decode step embeds the wrong position."""
    from kiln.passes import kv_cache

    monkeypatch.setattr(kv_cache, "new_positions", lambda g, reads, ids: [])
    ckpt = save_checkpoint(tmp_path / "gpt2", "gpt2", "causal-lm")
    assert_fails(capsys, tmp_path, [str(ckpt), "--verify-max-length", "32"], 1, "parity check failed",
                 "greedy generation", "no artifact written")


def test_a_quantized_graph_that_rounds_too_much_names_the_higher_tier():
    """INT4 that computes its codes exactly but misses the bound against FP32: the line names the budget (sensitive
    weights a tier up) and the other methods; a graph that misses its own codes, a failed generation check (run
    only after parity held) or an FP32 graph is kiln's problem, and gets no such advice."""
    from kiln.compiler.options import CompileOptions
    from kiln.compiler.verify.staged import remedy

    int4, int8 = CompileOptions(precision="int4", quant_method="rtn"), CompileOptions(precision="int8")
    exact = {"passed": False, "codes": {"passed": True}}
    assert "keep its most sensitive weights at INT8 with --max-drop top1=0.95" in remedy(exact, int4)
    assert "--quant-method gptq, or --precision int8" in remedy(exact, int4)
    assert "at FP32 with --max-drop top1=0.95" in remedy({"passed": False}, int8)
    assert "tighten --max-drop" in remedy(exact, CompileOptions(precision="int4", max_drop="top1=0.9"))
    assert "at FP32 with --max-drop cosine=0.99" in remedy({"passed": False}, int8, "encoder")  # what encoders measure
    assert remedy({"passed": False, "codes": {"passed": False}}, int4) == ""
    assert remedy({"passed": False, "codes": {"passed": True}, "generation": {"passed": False}}, int4) == ""
    assert remedy({"passed": False}, CompileOptions()) == ""
