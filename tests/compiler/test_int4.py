"""--precision int4 end to end: GPTQ on the trained reference Llama (MatMulNBits, act-order gathers, INT8 head and
embedding table), the TensorRT flavour (blocked INT4 DequantizeLinear, symmetric, positive scales), an encoder,
the INT4 tolerance against planted bugs, and every bad option as a one-line error with nothing written."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest
from conftest import fast_options, planted
from onnx import numpy_helper

import kiln.runtimes as kr
from kiln.runtimes import kernels
from kiln.cli import main
from kiln.compiler import compile, trace
from kiln.compiler.facts import model_facts
from kiln.compiler.verify.parity import EXACT_SESSION
from kiln.compiler.verify.staged import exact_copy
from kiln.compiler.load import load_checkpoint
from kiln.compiler.manifest import write as write_manifest
from kiln.compiler.options import int4_defaults
from kiln.compiler.quantize.driver import QuantDriver
from kiln.compiler.verify import cases
from kiln.compiler.verify.parity import TOLERANCES, verify
from kiln.passes.check_tensorrt import problems

pytestmark = pytest.mark.slow


def manifest(out):
    return json.loads((out / "manifest.json").read_text())


def entry(m, name):
    return next(p for p in m["passes"] if p["name"] == name)


@pytest.fixture(scope="module")
def tiny_llama():
    import reference_models

    return reference_models.checkpoint("llama-tiny")


@pytest.fixture(scope="module")
def int4_artifact(tiny_llama, tmp_path_factory):
    out = compile(tiny_llama, tmp_path_factory.mktemp("int4") / "llama", fast_options(precision="int4", group_size=32,
                                                                                         verify_max_length=128))
    return tiny_llama, out


def test_gptq_int4_artifact_records_what_it_ran(int4_artifact):
    _, out = int4_artifact
    m = manifest(out)
    assert m["verification"]["status"] == "passed" and m["precision"] == "int4"
    q = entry(m, "quantize-nbits")
    s = q["stats"]
    # 2 layers x (packed QKV, O, gate, up, down): every body weight carries the solver's codes; head from RTN;
    # the mixed recipe solved layer 1's (llama.cpp's more-bits layer of 2: the last eighth) QKV and down at 8 bits
    assert s["bits"] == 4 and s["block_size"] == 32 and s["given"] == 10 and s["quantized"] == 11
    assert s["more_bits"] == 2 and q["int4"]["mixed_bits"]
    # act-order with static groups: codes in the input order, no activation Gather in front of any kernel
    assert s["head"] == "int8" and s["embedding"] == "int8" and s["act_order_gathers"] == 0
    i4 = q["int4"]
    assert i4["method"] == "gptq" and i4["act_order"] and i4["symmetric"] and i4["group_size"] == 32
    assert i4["gptq"]["windows"] >= 16 and i4["gptq"]["linears"] == 14
    model = onnx.load(str(out / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 11 and "GatherBlockQuantized" in ops and "MatMul" not in ops
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert bits == [4] * 5 + [8, 4, 4, 4, 8] + [8]  # layer 0, layer 1 (QKV, O, gate, up, down), the head
    # scales are FP16, each cast once at load: 4 + 0.5 bits per weight at 4 bits, 8 + 0.5 at 8
    assert {t.data_type for t in int4_scales(model)} == {onnx.TensorProto.FLOAT16}
    # nothing left in FP32 but norms and rotary tables
    fp32 = sum(numpy_helper.to_array(t).size for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
    assert fp32 < 0.1 * sum(p.numel() for p in load_checkpoint(int4_artifact[0]).model.parameters())


def test_gptq_solves_an_int4_lm_head(tiny_llama, tmp_path):
    """--lm-head int4 with GPTQ: the (tied) head is solved on the final hidden states of the quantized blocks, its
    codes packed as solved; the embedding table keeps its own round-to-nearest codes; the codes check passes (the
    fake-quantized reference holds the solved head: a re-rounded one would differ)."""
    out = compile(tiny_llama, tmp_path / "head4", fast_options(precision="int4", group_size=32, lm_head="int4",
                                                              verify_max_length=128))
    m = manifest(out)
    q = entry(m, "quantize-nbits")
    assert q["stats"]["given"] == 11 and q["stats"]["head"] == "int4" and q["int4"]["gptq"]["linears"] == 15
    assert m["verification"]["status"] == "passed" and json.loads((out / "report.json").read_text())["codes"]["passed"]


def test_int4_runs_through_the_runtime_alone(int4_artifact):
    _, out = int4_artifact
    with kr.load(out, threads=1) as model:
        ids = np.array([[5, 6, 7, 8]], np.int64)
        got = model.generate(ids, np.ones_like(ids), max_new_tokens=4, stop_token_ids=[], pad_token_id=0)
    assert got.shape == (1, 8)


@pytest.fixture(scope="module")
def rtn_artifact(tiny_llama, tmp_path_factory):
    """Round-to-nearest, so the test can rebuild the fake-quantized reference the compile verified against."""
    out = compile(tiny_llama, tmp_path_factory.mktemp("int4rtn") / "llama",
                  fast_options(precision="int4", quant_method="rtn", group_size=32, verify_max_length=128))
    return tiny_llama, out


def reverify(ckpt_path, artifact, tmp_path, mutate, planted_bug=True) -> tuple[dict, dict]:
    """The planted artifact checked as the compile checks INT4: against eager FP32 and the fake-quantized model."""
    out = planted(artifact, tmp_path, mutate)
    data = json.loads((out / "manifest.json").read_text())
    data.pop("files")
    ckpt = load_checkpoint(ckpt_path)
    options = int4_defaults(ckpt.kind, fast_options(precision="int4", quant_method="rtn", group_size=32))
    fake = QuantDriver(ckpt, model_facts(ckpt), options, lambda m: None).fake_quantized()
    inputs = [s.name for s in trace.io_specs(ckpt)[0]]
    feeds = cases.text_cases(ckpt, inputs) + cases.random_cases(ckpt, inputs, 128, 0)
    exact = exact_copy(out)
    try:
        (exact / "manifest.json").unlink()
        write_manifest(exact, data)
        if planted_bug:  # what the compile would refuse, the artifact's canary refuses at load
            with pytest.raises(kr.CanaryError):
                kr.load(out, threads=2)
        else:
            kr.load(out, threads=2).close()
        with kr.load(out, threads=2, check=False) as model, \
                kr.load(exact, threads=2, session_config=EXACT_SESSION, check=False) as exact_model:
            return (verify(trace.EagerRunner(ckpt), model, feeds, "int4"),
                    verify(trace.EagerRunner(dataclasses.replace(ckpt, model=fake)), exact_model, feeds, "int4-codes"))
    finally:
        shutil.rmtree(exact)


def int4_scales(model):
    """The 4-bit kernels' scale initializers (FP16 ones through their Cast)."""
    by_name = {t.name: t for t in model.graph.initializer}
    by_name.update({n.output[0]: by_name[n.input[0]] for n in model.graph.node if n.op_type == "Cast"
                    and n.input[0] in by_name})
    return [by_name[n.input[2]] for n in model.graph.node if n.op_type == "MatMulNBits"
            and next(a.i for a in n.attribute if a.name == "bits") == 4]


def double_one_scale(model) -> None:
    t = int4_scales(model)[3]  # inside the stack, neither the first layer nor the head
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, t.name))


def two_bit(model) -> None:
    """Every 4-bit code pair moved onto 2 levels of each nibble's range (codes 4 and 12, a 2-bit grid)."""
    packed = {n.input[1] for n in model.graph.node if n.op_type == "MatMulNBits"
              and next(a.i for a in n.attribute if a.name == "bits") == 4}
    for t in model.graph.initializer:
        if t.name in packed:
            b = numpy_helper.to_array(t)
            lo, hi = b & 0x0F, b >> 4
            lo, hi = np.where(lo < 8, 4, 12).astype(np.uint8), np.where(hi < 8, 4, 12).astype(np.uint8)
            t.CopyFrom(numpy_helper.from_array((lo | (hi << 4)).astype(np.uint8), t.name))


def test_default_int4_passes_with_margin(int4_artifact):
    _, out = int4_artifact
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["tolerance"]["min_cosine"] == TOLERANCES["int4"].min_cosine
    assert report["codes"]["passed"] and report["codes"]["tolerance"]["min_cosine"] == TOLERANCES["int4-codes"].min_cosine
    # GPTQ's own weights, to float rounding: every case, and the greedy tokens through the cache
    assert all(c["passed"] for c in report["codes"]["cases"])
    assert report["generation"]["passed"] and report["generation"]["tokens_identical"]


def test_unchanged_artifact_passes_both_checks(rtn_artifact, tmp_path):
    ckpt, out = rtn_artifact
    fp32, codes = reverify(ckpt, out, tmp_path, lambda m: None, planted_bug=False)
    assert fp32["passed"] and codes["passed"]


@pytest.mark.parametrize("mutate", [double_one_scale, two_bit], ids=["one-layer-scale-2x", "2-bit-codes"])
def test_planted_int4_bug_fails(rtn_artifact, tmp_path, mutate):
    """INT4's floor against FP32 is loose (what 4 bits cost); the check against the codes' own weights is not."""
    ckpt, out = rtn_artifact
    _, codes = reverify(ckpt, out, tmp_path, mutate)
    assert not codes["passed"]


def test_tensorrt_int4_is_blocked_symmetric_dequantize_that_matches(checkpoints, tmp_path):
    out = compile(checkpoints["llama"], tmp_path / "trt4", fast_options(precision="int4", target="tensorrt",
                                                                        quant_method="rtn", group_size=16))
    m = manifest(out)
    assert m["verification"]["status"] == "passed" and m["target"] == "tensorrt"
    model = onnx.load(str(out / "model.onnx"))
    assert problems(model) == []
    inits = {t.name: t for t in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(len(n.input) == 2 for n in dq)  # no zero point: symmetric
    kinds = [inits[n.input[0]].data_type for n in dq]  # the body INT4, the lm_head INT8 (the default --lm-head)
    assert kinds.count(onnx.TensorProto.INT4) == len(dq) - 1 and kinds.count(onnx.TensorProto.INT8) == 1
    blocks = [next(a.i for a in n.attribute if a.name == "block_size") for n in dq]
    assert blocks == [32 if k == onnx.TensorProto.INT8 else 16 for k in kinds]  # the INT8 head in blocks of 32
    assert all((numpy_helper.to_array(inits[n.input[1]]) > 0).all() for n in dq)
    assert not [n for n in model.graph.node if n.domain == "com.microsoft"]


def test_encoder_int4_rtn(checkpoints, tmp_path):
    out = compile(checkpoints["bert"], tmp_path / "bert4", fast_options(precision="int4", quant_method="rtn",
                                                                       group_size=16))
    m = manifest(out)
    q = entry(m, "quantize-nbits")
    s = q["stats"]
    assert m["verification"]["status"] == "passed" and s["quantized"] >= 2 * 6 and s["embedding"] is None
    # encoders' defaults: asymmetric groups with zero points, FP32 activations (accuracy level 0)
    assert s["grid"] == "asym" and not q["int4"]["symmetric"] and q["int4"]["accuracy_level"] == 0
    nodes = [n for n in onnx.load(str(out / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert all(len(n.input) == 4 and next(a.i for a in n.attribute if a.name == "accuracy_level") == 0 for n in nodes)
    sym = compile(checkpoints["bert"], tmp_path / "bert4sym", fast_options(precision="int4", quant_method="rtn",
                                                                          group_size=16, asym=False, accuracy_level=4))
    q = entry(manifest(sym), "quantize-nbits")
    assert q["stats"]["grid"] == "signed" and q["int4"]["accuracy_level"] == 4


@pytest.mark.parametrize("flags,message", [
    (["--group-size", "48"], "power of two"),
    (["--group-size", "8"], "power of two"),
    (["--group-size", "256"], "larger than the smallest layer input"),
    (["--quant-method", "hqq"], "invalid choice"),
    (["--lm-head", "fp16"], "invalid choice"),
    (["--asym", "--target", "tensorrt"], "symmetric INT4 only"),
    (["--mixed-bits", "--quant-method", "rtn"], "needs a solver"),
    (["--mixed-bits", "--target", "tensorrt"], "needs a solver"),
])
def test_int4_flag_errors(checkpoints, tmp_path, capsys, flags, message):
    out = tmp_path / "bad"
    code = main(["compile", str(checkpoints["llama"]), "-o", str(out), "--precision", "int4", *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and err.strip().splitlines()[-1] == errors[0]
    assert not out.exists()


def test_int4_flags_need_int4(checkpoints, tmp_path, capsys):
    code = main(["compile", str(checkpoints["llama"]), "-o", str(tmp_path / "x"), "--asym"])
    assert code == 2 and "add --precision int4" in capsys.readouterr().err


@pytest.mark.parametrize("kl", [0.0005, 0.00003])
def test_int4_budget_promotes_the_most_sensitive_weights(tiny_llama, tmp_path, kl):
    """A budget the all-INT4 graph misses (held-out KL 0.0013 measured): the layers whose INT8 gains most go to INT8
    until the calibration split meets it; a budget even all-INT8 misses (calibration KL 7.6e-5) keeps some FP32 too. The
    fake-quantized reference gives every weight the same tier (the codes check passes)."""
    out = compile(tiny_llama, tmp_path / "budget", fast_options(precision="int4", max_drop=f"kl={kl}",
                                                               verify_max_length=128))
    m = manifest(out)
    q = entry(m, "quantize-nbits")
    b = q["budget"]
    assert b["heldout_kl"] <= kl and b["promoted_int8"] and q["stats"]["promoted_int8"] == len(b["promoted_int8"])
    ranked = list(b["sensitivity"])
    if kl == 0.0005:  # INT8 is enough: a prefix of the ranking promoted, nothing FP32
        assert b["kept_fp32"] == [] and b["promoted_int8"] == ranked[:len(b["promoted_int8"])]
    else:  # ranked again by what FP32 gains: a prefix of that FP32, then a prefix of the rest of the INT8 ranking
        j, by_fp32 = len(b["kept_fp32"]), list(b["sensitivity_fp32"])
        rest = [x for x in ranked if x not in b["kept_fp32"]]
        assert j and b["kept_fp32"] == by_fp32[:j] and b["promoted_int8"] == rest[:len(b["promoted_int8"])]
    assert b["units"] == 3  # two layers of 5 weights, the lm_head
    assert b["measured_candidates"] <= 3 + 3 * len(ranked).bit_length()  # bisection, not one run per weight
    assert m["verification"]["status"] == "passed"
    report = json.loads((out / "report.json").read_text())
    assert report["codes"]["passed"]


def test_the_reference_rounds_each_table_the_pass_quantized():
    """``rounded_tables``: a table named by the pass is found by its parameter name (the traced wrapper's ``model.``
    dropped), a renamed one (the exporter renames a tied table) by its shape, a table the pass left FP32 is not
    rounded, and before the pass it is the token embedding."""
    import types

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(40, 32)
            self.per_layer = torch.nn.Embedding(40, 48)
            self.positions = torch.nn.Embedding(16, 32)

        def get_input_embeddings(self):
            return self.embed_tokens

    model = Tiny()

    def tables(recorded):
        return QuantDriver.rounded_tables(types.SimpleNamespace(embedding_tables=recorded), model)

    assert tables(None) == [model.embed_tokens]
    assert tables([]) == []
    assert tables([["model.per_layer.weight", 40, 48]]) == [model.per_layer]
    assert tables([["val_2417", 40, 32], ["model.per_layer.weight", 40, 48]]) == [model.embed_tokens, model.per_layer]
    assert tables([["val_7", 40, 64]]) == []  # nothing of that shape: nothing rounded, never a guess


@pytest.mark.skipif(not kernels.available(), reason="kiln's kernel library is not built here")
def test_kiln_kernels_compute_and_the_fallback_runs_without_them(int4_artifact, monkeypatch):
    """The CPU artifact computes its low-bit MatMuls with kiln's library (the compile verified them there), and
    ships the same graph on ONNX Runtime's MatMulNBits: with the library hidden, that one loads, is reported, and the
    canary passes it."""
    _, out = int4_artifact
    m = manifest(out)
    assert m["kernels"]["op"] == "ai.kiln.MatMulNBits" and m["kernels"]["nodes"] == entry(m, "quantize-nbits")["stats"]["quantized"]
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    twin = onnx.load(str(out / m["kernels"]["fallback"]["model"]), load_external_data=False)
    ours = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert ours and all(n.domain == "ai.kiln" for n in ours)
    assert [n.domain for n in twin.graph.node if n.op_type == "MatMulNBits"] == ["com.microsoft"] * len(ours)
    assert [n.input for n in twin.graph.node] == [n.input for n in graph.graph.node]  # the same codes
    ids = np.array([[5, 6, 7, 8, 9, 10]], np.int64)
    with kr.load(out, threads=1) as model:
        assert model.backend["kernels"]["ran"].startswith("kiln ")
        assert model.canary.passed and model.canary.rows_agree  # one row alone = beside others: no min_rows=2
        ours_tokens = model.generate(ids, np.ones_like(ids), max_new_tokens=6, stop_token_ids=[], pad_token_id=0)
    monkeypatch.setenv(kernels.HIDE, "0")
    with kr.load(out, threads=1) as model:
        assert model.backend["kernels"] == {"op": "com.microsoft.MatMulNBits", "ran": "onnxruntime MatMulNBits",
                                            "reason": "KILN_KERNELS=0"}
        assert model.canary.passed and "onnxruntime MatMulNBits" in model.canary.machine
        theirs = model.generate(ids, np.ones_like(ids), max_new_tokens=6, stop_token_ids=[], pad_token_id=0)
    assert theirs.shape == ours_tokens.shape


def test_kernels_onnxruntime_keeps_matmulnbits(tiny_llama, tmp_path):
    out = compile(tiny_llama, tmp_path / "llama", fast_options(precision="int4", quant_method="rtn", kernels="onnxruntime",
                                                               verify_max_length=64))
    m = manifest(out)
    assert "kernels" not in m and not (out / "model.fallback.onnx").exists()
    assert all(n.domain == "com.microsoft" for n in onnx.load(str(out / "model.onnx")).graph.node
               if n.op_type == "MatMulNBits")


@pytest.mark.skipif(not kernels.available(), reason="kiln's kernel library is not built here")
def test_kiln_kernels_without_graph_optimisation_take_the_fallback(int4_artifact):
    _, out = int4_artifact
    # (check=False: an INT4 artifact unoptimised computes another answer, kiln's kernel or not; the canary says so)
    with kr.load(out, threads=1, optimization="disabled", check=False) as model:
        assert model.backend["kernels"]["ran"] == "onnxruntime MatMulNBits"
        assert "optimisation disabled" in model.backend["kernels"]["reason"]


def test_triton_export_of_a_kiln_kernel_artifact_is_portable(int4_artifact, tmp_path):
    """Triton's ONNX Runtime backend cannot load kiln's library: the exported model.onnx is the fallback graph,
    beside the same weights, and the clients' directory gets no graph."""
    from kiln.serve.triton import export

    _, out = int4_artifact
    target = export(out, tmp_path / "repo", name="llama", graph_only=True)  # the ONNX Runtime backend, not Python
    model = onnx.load(str(target / "1" / "model.onnx"), load_external_data=False)
    assert (target / "1" / "model.onnx.data").is_file()  # the weights it names, beside it
    assert {n.domain for n in model.graph.node if n.op_type == "MatMulNBits"} == {"com.microsoft"}
    assert not any(p.name.endswith(".onnx") for p in (target / "kiln").iterdir())
