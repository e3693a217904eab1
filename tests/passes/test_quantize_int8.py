"""quantize-int8: per-channel weight quantization and DynamicQuantizeMatMul against numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import op_types, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import run_passes
from kiln.passes.quantize_int8 import (
    QuantizeDynamicInt8,
    dequantize_per_column,
    fake_quantize_activation,
    quantize_per_column,
    unsigned_codes,
)

K, N = 64, 48


def test_per_column_quantization_is_symmetric_and_bounded():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32) * np.linspace(0.01, 10, N, dtype=np.float32)  # columns 1000x apart
    w[:, 3] = 0.0
    q, scale = quantize_per_column(w)
    assert q.dtype == np.int8 and q.min() >= -127 and scale.shape == (N,)
    assert (np.abs(q).max(0)[np.arange(N) != 3] == 127).all()  # every non-zero column uses its full range
    err = np.abs(dequantize_per_column(q, scale) - w)
    assert (err <= scale / 2 + 1e-7).all()  # round to nearest, per column
    assert (dequantize_per_column(q, scale)[:, 3] == 0).all()


def test_unsigned_codes_hold_the_same_values():
    q = np.array([[-127, 0, 127], [5, -1, 64]], np.int8)
    codes, zero = unsigned_codes(q)
    assert codes.dtype == zero.dtype == np.uint8 and (zero == 128).all()
    np.testing.assert_array_equal(codes.astype(np.int32) - zero.astype(np.int32), q)


def test_exact_where_uint8_x_int8_pair_sums_saturate():
    """The worst case of ONNX Runtime's uint8 x int8 kernel without VNNI: neighbouring weights at +-127 and
    inputs far above the zero point, so pairs of products pass int16 (VPMADDUBSW). The stored uint8 codes
    keep the product exact on every CPU; with the int8 codes an AVX2 machine was off by up to 41.6."""
    rng = np.random.default_rng(3)
    w = np.sign(rng.standard_normal((K, 1))).repeat(N, 1).astype(np.float32) * rng.uniform(0.5, 1, (1, N)).astype(np.float32)
    model, _ = graph(bias=False, weight=w)
    out, _ = run_passes(model, [QuantizeDynamicInt8()])
    x = np.abs(rng.standard_normal((2, 5, K))).astype(np.float32) * np.sign(w[:, :1].T)[None]  # every product positive
    x[..., 0] = -x[..., 0]  # a negative input: zero point above 0, the others well above it
    f = {"x": x, "x2": np.eye(N, dtype=np.float32)[None].repeat(2, 0)}
    q, scale = quantize_per_column(w)
    expected = fake_quantize_activation(x) @ dequantize_per_column(q, scale)
    np.testing.assert_allclose(run_unoptimised(out, f)[0], expected, rtol=1e-5, atol=1e-4)


def graph(bias: bool = True, weight: np.ndarray | None = None, extra_use: bool = False):
    rng = np.random.default_rng(1)
    w = weight if weight is not None else rng.standard_normal((K, N)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name="proj")]
    out = "mm"
    if bias:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"], name="bias"))
        out = "y"
    nodes.append(helper.make_node("MatMul", [out, "x2"], ["scores"], name="scores"))  # activations x activations
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", "S", "T"])]
    if extra_use:  # the MatMul result itself is also read: its bias Add cannot be folded away
        outputs.append(helper.make_tensor_value_info("mm", TensorProto.FLOAT, ["B", "S", N]))
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K]),
                                       helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["B", N, "T"])], outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m, w


@pytest.mark.parametrize("bias", [True, False])
def test_fires_and_matches_numpy_reference(bias):
    model, w = graph(bias)
    out, record = run_passes(model, [QuantizeDynamicInt8()])
    assert record[0]["stats"] == {"quantized": 1, "with_bias": int(bias), "kept_fp32": 0}
    assert op_types(out) == ["DynamicQuantizeMatMul", "MatMul"]  # the scores MatMul stays FP32
    rng = np.random.default_rng(2)
    f = {"x": rng.standard_normal((2, 5, K)).astype(np.float32), "x2": np.eye(N, dtype=np.float32)[None].repeat(2, 0)}
    got = run_unoptimised(out, f)[0]
    q, scale = quantize_per_column(w)
    b = numpy_helper.to_array(model.graph.initializer[1])
    expected = fake_quantize_activation(f["x"]) @ dequantize_per_column(q, scale) + (b if bias else 0)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    exact = run_unoptimised(model, f)[0]
    assert np.abs(got - exact).max() > 1e-4  # it really is quantized...
    assert np.abs(got - exact).max() < 0.05 * np.abs(exact).max()  # ...and close


def test_second_run_changes_nothing():
    once, _ = run_passes(graph()[0], [QuantizeDynamicInt8()])
    twice, record = run_passes(once, [QuantizeDynamicInt8()])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()


def test_kept_and_small_weights_stay_fp32_with_reasons():
    model, _ = graph()
    out, record = run_passes(model, [QuantizeDynamicInt8(keep_fp32=("W",))])
    assert record[0]["stats"]["kept_fp32"] == 1 and "DynamicQuantizeMatMul" not in op_types(out)
    assert "kept in FP32" in record[0]["skipped"][0]["why"]
    _, record = run_passes(model, [QuantizeDynamicInt8(min_elements=10_000)])
    assert record[0]["stats"]["quantized"] == 0 and "below 10000" in record[0]["skipped"][0]["why"]


def test_bias_add_is_not_folded_when_the_product_is_read_elsewhere():
    model, _ = graph(extra_use=True)
    out, record = run_passes(model, [QuantizeDynamicInt8()])
    assert record[0]["stats"] == {"quantized": 1, "with_bias": 0, "kept_fp32": 0}
    assert op_types(out) == ["DynamicQuantizeMatMul", "Add", "MatMul"]


def test_fused_attention_becomes_qattention_matching_its_reference():
    from graphs import attention_graph, feeds

    from kiln.passes.fuse_attention import FuseAttention

    fused, _ = run_passes(attention_graph(), [FuseAttention()])
    out, record = run_passes(fused, [QuantizeDynamicInt8()])
    assert record[0]["stats"]["attention"] == 1 and op_types(out) .count("QAttention") == 1
    assert "DynamicQuantizeLinear" in op_types(out) and "Attention" not in op_types(out)
    # reference: the FP32 Attention op fed the input as the kernel quantizes it, with the dequantized weight
    att = next(n for n in fused.graph.node if n.op_type == "Attention")
    ref = fused.__class__()
    ref.CopyFrom(fused)
    w = next(t for t in ref.graph.initializer if t.name == att.input[1])
    q, scale = quantize_per_column(numpy_helper.to_array(w))
    w.CopyFrom(numpy_helper.from_array(dequantize_per_column(q, scale), w.name))
    f = feeds("x")
    expected = run_unoptimised(ref, {**f, "x": fake_quantize_activation(f["x"])})[0]
    np.testing.assert_allclose(run_unoptimised(out, f)[0], expected, atol=1e-4)
    kept, record = run_passes(fused, [QuantizeDynamicInt8(keep_fp32=(att.input[1],))])
    assert "QAttention" not in op_types(kept) and record[0]["stats"]["kept_fp32"] == 1
