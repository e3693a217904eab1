"""TensorRT flavour passes: canonicalize-attention (on what lower-attention gives it), pin-norms-fp32 and the
check-tensorrt-ops gate."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import HD, attention_graph, decoder_attention_graph, decoder_feeds, feeds, lowered, op_types, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import run_passes
from kiln.passes.canonicalize_attention import CanonicalizeAttention
from kiln.passes.check_tensorrt import CheckTensorRTOps, TensorRTCompatibilityError, min_tensorrt
from kiln.passes.pin_norms import PinNormsFP32


def attention_nodes(model):
    return [n for n in model.graph.node if n.op_type == "Attention"]


def test_encoder_attention_scaled_before_matmul_and_matches():
    model = lowered(attention_graph())
    out, record = run_passes(model, [CanonicalizeAttention(head_size=4)])
    assert record[0]["stats"] == {"canonical": 1, "scaled": 1, "repeat_kv_removed": 0}
    (node,) = attention_nodes(out)
    assert node.domain == "" and {a.name: a.f for a in node.attribute}["scale"] == 1.0
    assert next(n for n in out.graph.node if n.output[0] == node.input[0]).op_type == "Mul"  # Q scaled first
    assert "Softmax" not in op_types(out)
    f = feeds("x")
    keep = f["attention_mask"].astype(bool)
    np.testing.assert_allclose(run_unoptimised(out, f)[0][keep], run_unoptimised(model, f)[0][keep], atol=1e-4)


def test_decoder_kv_heads_stay_shared_and_match():
    """The lowered node shares 1 KV head across 4 query heads in the op itself: nothing to repeat, Q scaled."""
    model = lowered(decoder_attention_graph(4, 1))
    out, record = run_passes(model, [CanonicalizeAttention(head_size=HD)])
    assert record[0]["stats"] == {"canonical": 1, "scaled": 1, "repeat_kv_removed": 0}
    assert "Expand" not in op_types(out)
    f = decoder_feeds(4 * HD)
    real = f["attention_mask"].astype(bool)
    np.testing.assert_allclose(run_unoptimised(out, f)[0][real], run_unoptimised(model, f)[0][real], atol=1e-4)


def test_canonicalize_second_run_changes_nothing():
    once, _ = run_passes(lowered(attention_graph()), [CanonicalizeAttention(head_size=4)])
    twice, record = run_passes(once, [CanonicalizeAttention(head_size=4)])
    assert record[0]["modified"] is False and record[0]["stats"]["canonical"] == 1
    assert twice.SerializeToString() == once.SerializeToString()


def test_canonicalize_refuses_kv_cache_outputs_and_softcap():
    model = lowered(attention_graph())
    node = attention_nodes(model)[0]
    node.output.extend(["present_k", "present_v"])
    _, record = run_passes(model, [CanonicalizeAttention(head_size=4)])
    assert record[0]["stats"]["canonical"] == 0 and "cache" in record[0]["skipped"][0]["why"]
    capped = lowered(attention_graph(softcap=3.0))
    out, record = run_passes(capped, [CanonicalizeAttention(head_size=4)])
    assert record[0]["stats"]["canonical"] == 0 and "soft-cap" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == capped.SerializeToString()


def norm_graph(dtype: int) -> onnx.ModelProto:
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np_type), "gamma"),
             numpy_helper.from_array(np.linspace(-0.1, 0.1, 8).astype(np_type), "beta")]
    g = helper.make_graph([helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5, name="ln")],
                          "ln", [helper.make_tensor_value_info("x", dtype, [2, 8])],
                          [helper.make_tensor_value_info("y", dtype, [2, 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    m.ir_version = 10
    return m


def test_fp16_norm_pinned_to_fp32():
    model = norm_graph(TensorProto.FLOAT16)
    out, record = run_passes(model, [PinNormsFP32()])
    assert record[0]["stats"] == {"pinned": 1, "already_fp32": 0, "softmax": 0, "statistics": 0, "attention_softmax": 0}
    assert op_types(out) == ["Cast", "LayerNormalization", "Cast"]
    x = (np.random.default_rng(0).standard_normal((2, 8)) * 300).astype(np.float16)  # large activations
    got = run_unoptimised(out, {"x": x})[0]
    assert got.dtype == np.float16
    ref32 = run_unoptimised(norm_graph(TensorProto.FLOAT), {"x": x.astype(np.float32)})[0]
    np.testing.assert_allclose(got.astype(np.float32), ref32, atol=2e-3)
    again, record2 = run_passes(out, [PinNormsFP32()])
    assert record2[0]["modified"] is False and again.SerializeToString() == out.SerializeToString()


def test_fp32_norm_left_alone_with_reason():
    model = norm_graph(TensorProto.FLOAT)
    out, record = run_passes(model, [PinNormsFP32()])
    assert record[0]["stats"] == {"pinned": 0, "already_fp32": 1, "softmax": 0, "statistics": 0, "attention_softmax": 0}
    assert "already compute in float32" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_gate_passes_standard_graph_and_reports_version():
    model, _ = run_passes(lowered(attention_graph()), [CanonicalizeAttention(head_size=4)])
    _, record = run_passes(model, [CheckTensorRTOps()])
    assert record[0]["stats"]["checked"] == len(model.graph.node)
    assert min_tensorrt(model) == "10.14"
    assert min_tensorrt(norm_graph(TensorProto.FLOAT)) == "10.0"


def test_gate_rejects_contrib_ops():
    from kiln.passes.fuse_attention import FuseAttention

    fused, _ = run_passes(attention_graph(), [FuseAttention()])
    with pytest.raises(TensorRTCompatibilityError, match="com.microsoft.Attention is not a standard ONNX op"):
        run_passes(fused, [CheckTensorRTOps()])


def test_gate_rejects_asymmetric_qdq():
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.array(3, np.int8), "zp")]
    g = helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="q"),
                           helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="dq")], "qdq",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    with pytest.raises(TensorRTCompatibilityError, match="non-zero zero point"):
        run_passes(model, [CheckTensorRTOps()])
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(0, np.int8), "zp"))
    run_passes(model, [CheckTensorRTOps()])
