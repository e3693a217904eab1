"""lower-attention: every captured attention node -> standard ONNX ops (the Attention op, or plain MatMul/Softmax),
checked against the node's contract computed in numpy, for every option the node carries."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graphs import op_types, reference_attention, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import attention_node as an
from kiln.passes import run_passes
from kiln.passes.lower_attention import LowerAttention

B, S, D = 2, 5, 8


def node_graph(hq=4, hkv=2, dv=D, mask=None, sinks=False, bias=False, softcap=0.0, causal=False, opset=23):
    """Q, K, V (and a mask, sinks, a bias) as graph inputs into one captured node."""
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, hq, S, D]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, hkv, S, D]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, hkv, S, dv])]
    names, inits = ["q", "k", "v", "", "", ""], []
    if mask is not None:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL if mask == "bool" else TensorProto.FLOAT,
                                                    [B, 1, S, S]))
        names[3] = "mask"
    if sinks:
        inits.append(numpy_helper.from_array(np.linspace(-1, 2, hq).astype(np.float32), "sinks"))
        names[4] = "sinks"
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, hq, S, S]))
        names[5] = "bias"
    node = an.make(names, "y", "captured", scale=0.3, q_heads=hq, kv_heads=hkv, head_size=D, v_head_size=dv,
                   causal=causal, softcap=softcap)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                  [B, S, hq, dv])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(an.DOMAIN, 1)])
    model.ir_version = 10
    return model


def feeds(hq=4, hkv=2, dv=D, mask=None, bias=False):
    rng = np.random.default_rng(0)
    out = {"q": rng.standard_normal((B, hq, S, D)).astype(np.float32),
           "k": rng.standard_normal((B, hkv, S, D)).astype(np.float32),
           "v": rng.standard_normal((B, hkv, S, dv)).astype(np.float32)}
    allowed = np.tril(np.ones((S, S), bool))[None, None].repeat(B, 0)
    allowed[1, :, :, :2] = False  # two padded keys in row 1 ...
    allowed[1, :, :2, 0] = True  # ... whose own rows see one key (no fully masked row)
    if mask == "bool":
        out["mask"] = allowed
    elif mask == "additive":
        out["mask"] = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
    if bias:
        out["bias"] = rng.standard_normal((1, hq, S, S)).astype(np.float32)
    return out


CASES = {
    "gqa bool mask": dict(mask="bool"),
    "additive mask": dict(mask="additive"),
    "causal, no mask": dict(causal=True),
    "no mask": dict(),
    "soft-cap": dict(mask="bool", softcap=1.5),
    "sinks": dict(mask="bool", sinks=True),
    "position bias": dict(mask="bool", bias=True, hkv=4),
    "wider values": dict(mask="bool", dv=12),
    "opset 21": dict(mask="bool", opset=21),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_lowering_computes_the_node(case):
    kw = CASES[case]
    model = node_graph(**kw)
    out, record = run_passes(model, [LowerAttention()])
    standard = not kw.get("sinks") and kw.get("opset", 23) >= 23
    assert record[0]["stats"] == {"lowered": 1, "onnx_attention": int(standard), "plain": int(not standard)}
    assert "CapturedAttention" not in op_types(out)
    f = feeds(**{k: kw[k] for k in ("hq", "hkv", "dv", "mask", "bias") if k in kw})
    sinks = np.linspace(-1, 2, kw.get("hq", 4)) if kw.get("sinks") else None
    want = reference_attention(f["q"], f["k"], f["v"], f.get("mask"), 0.3, kw.get("softcap", 0.0),
                               kw.get("causal", False), sinks, f.get("bias"))
    got = run_unoptimised(out, f)[0]
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_the_comparison_sees_a_missing_sink():
    """Sinks move every probability: a lowering that dropped them would fail the check above."""
    f = feeds(mask="bool")
    with_sinks = reference_attention(f["q"], f["k"], f["v"], f["mask"], 0.3, sinks=np.linspace(-1, 2, 4))
    without = reference_attention(f["q"], f["k"], f["v"], f["mask"], 0.3)
    assert np.abs(with_sinks - without).max() > 1e-2


def test_nothing_to_lower_changes_nothing():
    model = node_graph(mask="bool")
    once, _ = run_passes(model, [LowerAttention()])
    twice, record = run_passes(once, [LowerAttention()])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()
    onnx.checker.check_model(once)
