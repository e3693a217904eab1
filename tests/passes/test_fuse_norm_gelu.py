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


@pytest.mark.parametrize("bias", [True, False])
def test_skip_simplified_norm_fires_for_rmsnorm(bias):
    model = residual_graph(bias=bias, extra_use=True, rms=True)
    fused, record = run_passes(model, [FuseSkipLayerNorm(norms=("RMSNormalization",))])
    assert record[0]["stats"] == {"fused": 1, "with_bias": int(bias)}
    node = next(n for n in fused.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    assert node.output[3] == "sum" and len(node.input) == 3 + int(bias)
    check_same(model, fused, "x", "r")
    twice, record2 = run_passes(fused, [FuseSkipLayerNorm(norms=("RMSNormalization",))])
    assert record2[0]["modified"] is False and twice.SerializeToString() == fused.SerializeToString()


def test_rmsnorm_left_alone_when_not_selected():
    model = residual_graph(rms=True)
    _, record = run_passes(model, [FuseSkipLayerNorm(norms=("LayerNormalization",))])
    assert record[0]["stats"]["fused"] == 0


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
    assert record[0]["stats"] == {"bias_gelu": 0, "fast_gelu": 0, "tanh_chain": 0}
    assert "used only by this Gelu" in record[0]["skipped"][0]["why"]


def tanh_gelu_graph(half: float = 0.5, bias: bool = True):
    """GPT-2's gelu_new as the exporter writes it: 0.5 x (1 + tanh(0.79788 (x + 0.044715 x^3)))."""
    from onnx import numpy_helper

    consts = {"c_half": half, "c_three": 3.0, "c_k": 0.044715, "c_s": 0.7978845608, "c_one": 1.0}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    inits.append(numpy_helper.from_array(np.linspace(-1, 1, 8).astype(np.float32), "b"))
    x = "xb" if bias else "x"
    nodes = ([helper.make_node("Add", ["x", "b"], ["xb"])] if bias else []) + [
        helper.make_node("Mul", [x, "c_half"], ["h"]), helper.make_node("Pow", [x, "c_three"], ["p"]),
        helper.make_node("Mul", ["p", "c_k"], ["pk"]), helper.make_node("Add", [x, "pk"], ["inner"]),
        helper.make_node("Mul", ["inner", "c_s"], ["sc"]), helper.make_node("Tanh", ["sc"], ["t"], name="tanh"),
        helper.make_node("Add", ["t", "c_one"], ["t1"]), helper.make_node("Mul", ["h", "t1"], ["y"])]
    g = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("bias", [True, False])
def test_tanh_gelu_chain_becomes_fast_gelu(bias):
    model = tanh_gelu_graph(bias=bias)
    fused, record = run_passes(model, [FuseBiasGelu()])
    assert record[0]["stats"]["tanh_chain"] == 1
    assert op_types(fused) == ["FastGelu"]
    assert len(fused.graph.node[0].input) == 1 + int(bias)
    check_same(model, fused, "x")
    twice, record2 = run_passes(fused, [FuseBiasGelu()])
    assert record2[0]["modified"] is False and twice.SerializeToString() == fused.SerializeToString()


def test_tanh_gelu_chain_with_other_constant_is_refused():
    _, record = run_passes(tanh_gelu_graph(half=0.6), [FuseBiasGelu()])
    assert record[0]["stats"]["tanh_chain"] == 0
    assert "0.5 x (1 + tanh" in record[0]["skipped"][0]["why"]
