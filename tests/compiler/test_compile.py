"""End-to-end: every supported family compiles, verifies, and the artifact matches eager PyTorch."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

import kiln.runtimes as kr
from conftest import FAMILY_HEADS, fast_options, make_model
from kiln.compiler import compile
from kiln.compiler.load import checkpoint_sha256
from kiln.runtimes.artifact import sha256_file

KINDS = {"bert": "encoder", "roberta": "encoder", "distilbert": "encoder"}
TASKS = {"base": "feature-extraction", "sequence-classification": "sequence-classification",
         "token-classification": "token-classification", "causal-lm": "causal-lm"}


def eager_outputs(family: str, head: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Independent reference: the HF model called directly, not through kiln's wrapper."""
    model = make_model(family, head)
    kwargs = {}
    if KINDS.get(family) is None:  # decoders: positions from the mask, as HF generate does
        kwargs["position_ids"] = torch.from_numpy((np.cumsum(mask, -1) - 1).clip(min=0))
    with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **kwargs)
    return (out.last_hidden_state if head == "base" else out.logits).numpy()


@pytest.mark.parametrize("family,head", FAMILY_HEADS)
def test_family_compiles_verifies_and_matches_eager(artifacts, checkpoints, family, head):
    out = artifacts[family]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema_version"] == 1
    assert manifest["model"]["kind"] == KINDS.get(family, "decoder")
    assert manifest["model"]["task"] == TASKS[head]
    assert manifest["model"]["source"]["sha256"] == checkpoint_sha256(checkpoints[family])
    assert manifest["precision"] == "fp32"
    passes = {p["name"]: p for p in manifest["passes"]}
    if KINDS.get(family):  # encoders: one fused attention per layer, and the norms/gelus fused
        assert passes["fuse-attention"]["coverage"] == {"expected": 2, "fused": 2}
        assert passes["decompose-norm"]["stats"]["layernorm"] >= 5  # embeddings + 2 per layer
        assert passes["fuse-bias-gelu"]["stats"]["bias_gelu"] + passes["fuse-bias-gelu"]["stats"]["fast_gelu"] == 2
    else:  # decoders: one GroupQueryAttention per layer, rotary fused where the model uses RoPE
        gqa = passes["fuse-gqa"]
        assert gqa["coverage"] == {"expected": 2, "fused": 2}
        assert gqa["stats"] == {"fused": 2, "rotary": 0 if family == "gpt2" else 2, "packed_qkv": 2, "layers": 2}
        graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
        ops = [n.op_type for n in graph.graph.node]
        assert ops.count("GroupQueryAttention") == 2 and "Attention" not in ops and "RotaryEmbedding" not in ops
        assert passes["kv-cache"]["coverage"] == {"expected": 2, "fused": 2}
        kv = manifest["kv_cache"]
        assert kv["past"][:2] == ["past_key_values.0.key", "past_key_values.0.value"] and kv["capacity"] == 128
        assert kv["layout"] == ["batch", "kv_heads", "sequence", "head_size"] and kv["num_layers"] == 2
        assert [o["name"] for o in manifest["outputs"]][1:3] == ["present.0.key", "present.0.value"]
        gen = manifest["verification"]["generation"]
        assert gen["tokens_identical"] and gen["steps"] == 16 and gen["batch"] == 3 and gen["max_abs_over_atol"] <= 1
        if family == "gpt2":  # LayerNorm: decomposed (ORT's CPU kernel is slow); gelu_new written out -> FastGelu
            assert passes["decompose-norm"]["stats"]["layernorm"] == 5
            assert passes["fuse-bias-gelu"]["stats"]["tanh_chain"] == 2 and ops.count("FastGelu") == 2
        else:  # RMSNorm: residual ones fused with their Add; the first has no residual
            assert passes["fuse-skip-layernorm"]["stats"]["fused"] == 4
            assert ops.count("SkipSimplifiedLayerNormalization") == 4 and ops.count("RMSNormalization") == 1
    # roberta numbers positions from padding_idx + 1 (its pad id 0 here): 66 embeddings hold 65 tokens
    longest = {"bert": 64, "distilbert": 64, "roberta": 65}.get(family, 128)
    assert manifest["dynamic_axes"]["sequence"] == {"min": 1, "max": longest}
    assert manifest["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}
    assert manifest["verification"]["status"] == "passed"
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(manifest["tool_versions"])
    for rel, digest in manifest["files"].items():
        assert sha256_file(out / rel) == digest
    assert {"model.onnx", "report.json", "tokenizer.json"} <= set(manifest["files"])
    report = json.loads((out / "report.json").read_text())
    assert report["passed"]
    sources = {c["source"] for c in report["cases"]}
    assert sources == {"text", "random"}
    assert any(c["shape"][0] > 1 for c in report["cases"] if c["source"] == "random")
    assert max(c["shape"][1] for c in report["cases"]) == longest  # the longest text (or random) case
    assert report["latency"]["eager_ms"] > 0 and report["latency"]["artifact_ms"] > 0
    if head != "base":
        assert "logits" in report["summary"]
    if head == "causal-lm":
        assert report["summary"]["logits"]["top1_agreement"] == 1.0

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 128, size=(2, 11), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :4] = 0 if KINDS.get(family) is None else 1  # left padding for decoders
    if KINDS.get(family):
        mask[1, 7:] = 0
    with kr.load(out, threads=2) as model:
        got = model.run({"input_ids": ids, "attention_mask": mask})
    name = "last_hidden_state" if head == "base" else "logits"
    ref = eager_outputs(family, head, ids, mask)
    keep = mask.astype(bool) if ref.ndim == 3 else slice(None)
    np.testing.assert_allclose(got[name][keep], ref[keep], atol=1e-4 * max(1.0, np.abs(ref).max()))


def test_labels_in_manifest(artifacts):
    manifest = json.loads((artifacts["roberta"] / "manifest.json").read_text())
    assert manifest["model"]["labels"] == {"0": "neg", "1": "neutral", "2": "pos"}
    assert manifest["outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["batch", 3]}]


def test_sentence_transformers_directory_adds_pooled_embedding(sentence_checkpoint, tmp_path):
    out = compile(sentence_checkpoint, tmp_path / "st", fast_options())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["pooling"] == {"mode": "mean", "normalize": True}
    assert [o["name"] for o in manifest["outputs"]] == ["last_hidden_state", "sentence_embedding"]
    with kr.load(out) as model:
        feeds = model.encode(["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog, twice."])
        got = model.run(feeds)
    hidden, mask = got["last_hidden_state"], feeds["attention_mask"][..., None]
    mean = (hidden * mask).sum(1) / mask.sum(1)
    expected = mean / np.linalg.norm(mean, axis=1, keepdims=True)
    np.testing.assert_allclose(got["sentence_embedding"], expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got["sentence_embedding"], axis=1), 1.0, atol=1e-5)


def test_task_override_gives_hidden_states(checkpoints, tmp_path):
    out = compile(checkpoints["llama"], tmp_path / "base", fast_options(task="feature-extraction"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["task"] == "feature-extraction"
    assert manifest["outputs"][0]["name"] == "last_hidden_state"


def test_no_verify_is_recorded(checkpoints, tmp_path):
    out = compile(checkpoints["bert"], tmp_path / "nv", fast_options(verify=False))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"] == {"status": "skipped"}
    assert manifest["options"]["verify"] is False
    assert not (out / "report.json").exists()


def test_large_graph_keeps_weights_as_external_data(checkpoints, tmp_path):
    out = compile(checkpoints["gpt2"], tmp_path / "ext", fast_options(external_data_threshold=0))
    manifest = json.loads((out / "manifest.json").read_text())
    data = [f for f in manifest["files"] if f.startswith("model.onnx") and f != "model.onnx"]
    assert data, manifest["files"]
    assert (out / "model.onnx.data").stat().st_size > 100_000  # the weights live beside the graph
    assert manifest["verification"]["status"] == "passed"


def test_force_replaces_existing_artifact(checkpoints, tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    compile(checkpoints["bert"], out, fast_options(force=True, verify=False))
    assert not (out / "stale.txt").exists()
    assert (out / "manifest.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_sliding_window_attention_matches_eager(tmp_path):
    """Mistral with a 6-token window: the window reaches GroupQueryAttention, and verification (sequences
    up to 64 tokens, so the window matters) passes against eager."""
    import transformers as T

    from conftest import make_tokenizer

    torch.manual_seed(0)
    cfg = T.MistralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                          intermediate_size=128, max_position_embeddings=64, sliding_window=6)
    ckpt = tmp_path / "mistral-sw"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    make_tokenizer("decoder").save_pretrained(ckpt)
    out = compile(ckpt, tmp_path / "art", fast_options())
    graph = onnx.load(str(out / "model.onnx"))
    windows = [a.i for n in graph.graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
               if a.name == "local_window_size"]
    assert windows == [6, 6]
    assert json.loads((out / "manifest.json").read_text())["verification"]["status"] == "passed"


@pytest.mark.parametrize("family", [f for f, _ in FAMILY_HEADS])
def test_tensorrt_flavour_compiles_and_verifies_on_onnxruntime(checkpoints, tmp_path, family):
    """--target tensorrt: standard-domain ops only, one canonical Attention per layer, parity on ORT CPU."""
    out = compile(checkpoints[family], tmp_path / "trt", fast_options(target="tensorrt", latency_budget_s=0.1))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "tensorrt" and manifest["verification"]["status"] == "passed"
    passes = {p["name"]: p for p in manifest["passes"]}
    assert passes["lower-attention"]["stats"]["onnx_attention"] == 2
    assert passes["canonicalize-attention"]["stats"]["canonical"] == 2
    assert passes["check-tensorrt-ops"]["stats"]["checked"] > 0
    graph = onnx.load(str(out / "model.onnx"))
    assert {n.domain for n in graph.graph.node} <= {""}
    attn = [n for n in graph.graph.node if n.op_type == "Attention"]
    assert len(attn) == 2 and all(a.f == 1.0 for n in attn for a in n.attribute if a.name == "scale")
    rope = KINDS.get(family) is None and family != "gpt2"
    assert manifest["target_info"]["min_tensorrt"] == ("10.15" if rope else "10.14")


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_int8_compiles_and_verifies_with_the_int8_table(checkpoints, tmp_path, family):
    out = compile(checkpoints[family], tmp_path / "int8", fast_options(precision="int8", latency_budget_s=0.1))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int8" and manifest["verification"]["status"] == "passed"
    report = json.loads((out / "report.json").read_text())
    assert report["tolerance"]["min_cosine"] == 0.98
    # encoders: per-tensor dynamic activations (DynamicQuantizeMatMul, QAttention); decoders: blocked (MatMulNBits)
    quantizer = "quantize-int8" if family == "bert" else "quantize-nbits"
    quant = next(p for p in manifest["passes"] if p["name"] == quantizer)["stats"]
    # bert: per layer the packed QKV (QAttention), attention output and two FFN MatMuls; llama: QKV, O, 3 MLP (+ head)
    assert quant["quantized"] == (8 if family == "bert" else 11) and quant.get("attention", 0) == (2 if family == "bert" else 0)
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node]
    assert ops.count("DynamicQuantizeMatMul") + ops.count("QAttention") + ops.count("MatMulNBits") == quant["quantized"]
    assert next(p for p in manifest["passes"] if p["name"] == quantizer)["calibration"]["texts"] >= 90  # default text
    summary = next(iter(manifest["verification"]["summary"].values()))
    assert 0.9 <= summary["cosine_min"] < 1.0  # quantized, and still close
    if family == "llama":
        assert manifest["verification"]["generation"]["steps"] == 16
