"""quantize-nbits: blocked weight-only INT8/INT4 -> MatMulNBits; numpy reference, ONNX Runtime agrees, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import op_types, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import run_passes
from kiln.passes.quantize_nbits import QuantizeBlockwise, dequantize_blocks, pack, quantize_blocks, unpack


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_keeps_each_blocks_extreme_weight_exact(bits):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 5)).astype(np.float32)  # K not a multiple of the block: padded
    codes, scales = quantize_blocks(w, bits, 32)
    assert codes.shape == (5, 3, 32) and scales.shape == (5, 3) and codes.max() < 2 ** bits
    back = dequantize_blocks(codes, scales, bits, 70)
    for n in range(5):
        for b in range(3):
            block = w[32 * b:32 * (b + 1), n]
            i = np.abs(block).argmax()
            assert back[32 * b + i, n] == pytest.approx(block[i], rel=1e-6)  # maps to the most negative code exactly
            step = np.abs(scales[n, b])
            err = np.abs(back[32 * b:32 * (b + 1), n] - block)
            # the grid is asymmetric by one code: weights of the other sign near the extreme clip by < 1 step
            clipped = np.sign(block) != np.sign(block[i])
            assert err[~clipped].max() <= step / 2 + 1e-6 and err.max() <= step + 1e-6
    np.testing.assert_array_equal(unpack(pack(codes, bits), bits), codes)


def test_one_large_weight_costs_only_its_block():
    w = np.full((64, 1), 0.01, np.float32)
    w[3, 0] = 10.0  # an outlier in block 0
    back = dequantize_blocks(*quantize_blocks(w, 8, 32), 8, 64)
    assert np.abs(back[32:, 0] - 0.01).max() < 1e-4  # block 1 keeps its resolution
    assert np.abs(back[:32, 0] - w[:32, 0]).max() <= 10.0 / 128 / 2 + 1e-6


def matmul_graph(k=64, n=48, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"]),
                           helper.make_node("MatMul", ["y", "y_t"], ["scores"], name="scores")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k]),
                                helper.make_tensor_value_info("y_t", TensorProto.FLOAT, ["B", n, "S"])],
                          [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", "S", "S"])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m, w


@pytest.mark.parametrize("bits", [4, 8])
def test_onnxruntime_matches_the_reference(bits):
    model, w = matmul_graph()
    out, record = run_passes(model, [QuantizeBlockwise(bits=bits, block_size=32, accuracy_level=0)])
    assert record[0]["stats"]["quantized"] == 1 and op_types(out).count("MatMulNBits") == 1
    assert "scores" in record[0]["skipped"][0]["where"]  # activations x activations: reported, not quantized
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    y_t = np.random.default_rng(2).standard_normal((2, 48, 3)).astype(np.float32)
    wq = dequantize_blocks(*quantize_blocks(w, bits, 32), bits, 64)
    h = np.maximum(x @ wq, 0)
    np.testing.assert_allclose(run_unoptimised(out, {"x": x, "y_t": y_t})[0], h @ y_t, rtol=1e-4, atol=1e-4)


def test_kept_weight_second_run_and_bad_settings():
    model, _ = matmul_graph()
    out, record = run_passes(model, [QuantizeBlockwise(keep_fp32=("w",))])
    assert record[0]["modified"] is False and any("kept in FP32" in r["why"] for r in record[0]["skipped"])
    assert out.SerializeToString() == model.SerializeToString()
    once, _ = run_passes(model, [QuantizeBlockwise()])
    twice, record = run_passes(once, [QuantizeBlockwise()])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()
    with pytest.raises(ValueError, match="power-of-two block size"):
        QuantizeBlockwise(block_size=48)


def test_tied_head_through_a_transpose_is_quantized():
    """MatMul(h, Transpose(E)) with E also read by the embedding Gather: the head is quantized, E stays."""
    rng = np.random.default_rng(0)
    e = rng.standard_normal((40, 32)).astype(np.float32)  # (vocab, hidden)
    g = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["h"]),
                           helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
                           helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head")],
                          "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", 40])],
                          [numpy_helper.from_array(e, "E")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    out, record = run_passes(model, [QuantizeBlockwise(bits=8, block_size=16, accuracy_level=0)])
    assert record[0]["stats"]["quantized"] == 1 and op_types(out) == ["Gather", "MatMulNBits"]
    ids = np.array([[0, 5, 39]], np.int64)
    wq = dequantize_blocks(*quantize_blocks(e.T, 8, 16), 8, 32)
    np.testing.assert_allclose(run_unoptimised(out, {"ids": ids})[0], e[ids] @ wq, rtol=1e-4, atol=1e-4)
