"""fuse-mha: captured encoder-decoder attention -> MultiHeadAttention (self, cached self, cross); matches the
standard-op lowering, idempotent, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import lowered, op_types, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import attention_node as an
from kiln.passes import run_passes
from kiln.passes.fuse_mha import FuseMultiHeadAttention

N, HD = 2, 4
D = N * HD


def _init(name, a):
    return numpy_helper.from_array(np.asarray(a), name)


def mha_graph(kind: str, core: str = "mask", causal_only: bool = False):
    """kind: self | cached | cross. Q (and K/V for self kinds) are projections of x with head splits. ``core``:
    "mask" (the mask as the node's mask) or "position" (T5: unscaled scores, a position bias and a mask)."""
    rng = np.random.default_rng(0)
    inits = [_init("split", np.array([0, 0, N, HD], np.int64)), _init("merge", np.array([0, 0, D], np.int64))]
    nodes = []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", D]),
              helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["B", N, "S", "T"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", D])]
    for t in ("q", "k", "v") if kind != "cross" else ("q",):
        inits.append(_init(f"W{t}", rng.standard_normal((D, D)).astype(np.float32) * 0.5))
        nodes += [helper.make_node("MatMul", ["x", f"W{t}"], [f"{t}3"]),
                  helper.make_node("Reshape", [f"{t}3", "split"], [f"{t}4"]),
                  helper.make_node("Transpose", [f"{t}4"], [f"{t}h"], perm=[0, 2, 1, 3])]
    k, v = "kh", "vh"
    if kind == "cached":
        for t in ("k", "v"):
            inputs.append(helper.make_tensor_value_info(f"past_{t}", TensorProto.FLOAT, ["B", N, "P", HD]))
            outputs.append(helper.make_tensor_value_info(f"present_{t}", TensorProto.FLOAT, ["B", N, "T", HD]))
            nodes.append(helper.make_node("Concat", [f"past_{t}", f"{t}h"], [f"present_{t}"], axis=-2))
        k, v = "present_k", "present_v"
    elif kind == "cross":
        inputs += [helper.make_tensor_value_info(f"cross_{t}", TensorProto.FLOAT, ["B", N, "T", HD]) for t in ("k", "v")]
        k, v = "cross_k", "cross_v"
    if core == "mask":
        inputs_ = ["qh", k, v, "" if causal_only else "bias"]
        scale = 0.5
    else:  # T5: unscaled scores + position bias + a padding mask
        inits.append(_init("pad", np.zeros((1, 1, 1, 1), np.float32)))
        inputs_, scale = ["qh", k, v, "pad", "", "bias"], 1.0
    nodes += [an.make(inputs_, "ctx", "captured", scale=scale, q_heads=N, kv_heads=N, head_size=HD, v_head_size=HD,
                      causal=causal_only),
              helper.make_node("Reshape", ["ctx", "merge"], ["y"])]
    m = helper.make_model(helper.make_graph(nodes, kind, inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 23),
                                                                                            helper.make_opsetid(an.DOMAIN, 1)])
    m.ir_version = 10
    return m


def feeds(kind: str, s: int = 3, past: int = 4, t_cross: int = 5):
    rng = np.random.default_rng(1)
    total = {"self": s, "cached": past + s, "cross": t_cross}[kind]
    f = {"x": rng.standard_normal((2, s, D)).astype(np.float32),
         "bias": rng.standard_normal((2, N, s, total)).astype(np.float32)}
    f["bias"][1, :, :, 0] = -1e9  # a padded key in row 1
    if kind == "cached":
        f.update({f"past_{t}": rng.standard_normal((2, N, past, HD)).astype(np.float32) for t in ("k", "v")})
    if kind == "cross":
        f.update({f"cross_{t}": rng.standard_normal((2, N, t_cross, HD)).astype(np.float32) for t in ("k", "v")})
    return f


@pytest.mark.parametrize("core", ["mask", "position"])
@pytest.mark.parametrize("kind", ["self", "cached", "cross"])
def test_fuses_and_matches_lowered(kind, core):
    model = mha_graph(kind, core)
    fused, record = run_passes(model, [FuseMultiHeadAttention()])
    stats = record[0]["stats"]
    assert stats["fused"] == 1 and stats[{"self": "self", "cached": "cached_self", "cross": "cross"}[kind]] == 1
    ops = op_types(fused)
    assert ops.count("MultiHeadAttention") == 1 and {"Softmax", "CapturedAttention", "Transpose"}.isdisjoint(ops)
    assert "Concat" not in ops  # the cache append happens inside the kernel
    f = feeds(kind)
    for got, want in zip(run_unoptimised(fused, f), run_unoptimised(lowered(model), f)):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_second_run_changes_nothing():
    once, _ = run_passes(mha_graph("cached", "position"), [FuseMultiHeadAttention()])
    twice, record = run_passes(once, [FuseMultiHeadAttention()])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()


def test_is_causal_without_mask_is_refused():
    model = mha_graph("self", causal_only=True)
    out, record = run_passes(model, [FuseMultiHeadAttention()])
    assert record[0]["stats"]["fused"] == 0
    assert "causal attention without an explicit mask" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()
