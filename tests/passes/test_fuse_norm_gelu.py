"""fuse-skip-layernorm and fuse-bias-gelu on graphs of a few nodes."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import feeds, op_types, residual_graph, run_unoptimised
from onnx import TensorProto, helper

from kiln.passes import run_passes
from kiln.passes.fuse_norm_gelu import FuseBiasGelu, FuseSkipLayerNorm


def check_same(a, b, *inputs):
    f = feeds(*inputs)
    f.pop("attention_mask")
    for x, y in zip(run_unoptimised(a, f), run_unoptimised(b, f)):
        np.testing.assert_allclose(y, x, atol=1e-4)


@pytest.mark.parametrize("bias", [True, False])
def test_skip_layernorm_fires(bias):
    model = residual_graph(bias=bias)
    fused, record = run_passes(model, [FuseSkipLayerNorm()])
    assert record[0]["stats"] == {"fused": 1, "with_bias": int(bias)}
    assert op_types(fused) == ["MatMul", "SkipLayerNormalization"]
    check_same(model, fused, "x", "r")


def test_skip_layernorm_keeps_a_reused_sum():
    model = residual_graph(extra_use=True)
    fused, record = run_passes(model, [FuseSkipLayerNorm()])
    node = next(n for n in fused.graph.node if n.op_type == "SkipLayerNormalization")
    assert node.output[3] == "sum"  # the residual sum still feeds the Relu
    check_same(model, fused, "x", "r")


def test_skip_layernorm_refuses_constant_operand():
    model = residual_graph(bias=False)
    model.graph.node[1].input[1] = "b"  # LayerNorm(MatMul + constant): a bias, not a residual
    _, record = run_passes(model, [FuseSkipLayerNorm()])
    assert record[0]["stats"]["fused"] == 0
    assert "constant operand" in record[0]["skipped"][0]["why"]


def test_skip_layernorm_idempotent():
    once, _ = run_passes(residual_graph(), [FuseSkipLayerNorm()])
    twice, record = run_passes(once, [FuseSkipLayerNorm()])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()


@pytest.mark.parametrize("approximate,op", [("none", "BiasGelu"), ("tanh", "FastGelu")])
def test_bias_gelu_fires(approximate, op):
    model = residual_graph(gelu=approximate)
    fused, record = run_passes(model, [FuseBiasGelu()])
    assert op in op_types(fused) and "Gelu" not in op_types(fused)
    check_same(model, fused, "x", "r")
    again, record = run_passes(fused, [FuseBiasGelu()])
    assert record[0]["modified"] is False


def test_bias_gelu_refuses_shared_add():
    model = residual_graph(gelu="none")
    model.graph.output.append(helper.make_tensor_value_info("g_in", TensorProto.FLOAT, ["batch", "sequence", 8]))  # also a graph output
    _, record = run_passes(model, [FuseBiasGelu()])
    assert record[0]["stats"] == {"bias_gelu": 0, "fast_gelu": 0}
    assert "used only by this Gelu" in record[0]["skipped"][0]["why"]
