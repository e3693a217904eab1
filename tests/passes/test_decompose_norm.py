"""decompose-norm: LayerNormalization / RMSNormalization -> elementwise ops, same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import feeds, op_types, residual_graph, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import run_passes
from kiln.passes.decompose_norm import DecomposeNorm


def rms_graph(opset: int = 23) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    shape = ["batch", "sequence", 8]
    graph = helper.make_graph(
        [helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="rms", epsilon=1e-6, axis=-1)], "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "g")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("ops,via_rms", [(("LayerNormalization",), True),
                                         (("LayerNormalization", "RMSNormalization"), False)])
def test_layernorm_decomposes_with_same_numbers(ops, via_rms):
    """Default: centre, then ORT's fast RMSNorm kernel; fully elementwise when RMSNorm is expanded too."""
    model = residual_graph()
    out, record = run_passes(model, [DecomposeNorm(ops)])
    assert record[0]["stats"] == {"layernorm": 1, "rmsnorm": 0}
    assert "LayerNormalization" not in op_types(out) and "Pow" not in op_types(out)
    assert ("RMSNormalization" in op_types(out)) == via_rms
    f = feeds("x", "r")
    f.pop("attention_mask")
    np.testing.assert_allclose(run_unoptimised(out, f)[0], run_unoptimised(model, f)[0], atol=1e-4)


def test_rmsnorm_decomposes_with_same_numbers():
    model = rms_graph()
    out, record = run_passes(model, [DecomposeNorm(("RMSNormalization",))])
    assert record[0]["stats"] == {"layernorm": 0, "rmsnorm": 1}
    x = {"x": np.random.default_rng(2).standard_normal((2, 5, 8)).astype(np.float32)}
    g = numpy_helper.to_array(model.graph.initializer[0])
    expected = x["x"] / np.sqrt((x["x"] ** 2).mean(-1, keepdims=True) + 1e-6) * g
    np.testing.assert_allclose(run_unoptimised(out, x)[0], expected, atol=1e-5)


def test_not_last_axis_is_left_alone():
    model = residual_graph()
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    next(a for a in ln.attribute if a.name == "axis").i = 1
    out, record = run_passes(model, [DecomposeNorm()])
    assert record[0]["stats"] == {"layernorm": 0, "rmsnorm": 0}
    assert "only the last axis" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("make,ops", [(residual_graph, ("LayerNormalization",)), (rms_graph, ("RMSNormalization",)),
                                     (residual_graph, ("LayerNormalization", "RMSNormalization"))])
def test_second_run_changes_nothing(make, ops):
    once, _ = run_passes(make(), [DecomposeNorm(ops)])
    twice, record = run_passes(once, [DecomposeNorm(ops)])
    assert record[0]["modified"] is False
    assert twice.SerializeToString() == once.SerializeToString()
