"""fuse-gqa: captured decoder attention -> GroupQueryAttention; fires (folding the rotary and packing Q/K/V where it
can, taking the general route where it cannot), refuses with reasons and leaves the graph as it was, idempotent, and
matches the standard-op lowering of the same node."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import HD, decoder_attention_graph, decoder_feeds, lowered, op_types, run_unoptimised

from kiln.passes import run_passes
from kiln.passes.fuse_gqa import FuseGroupQueryAttention


def gqa():
    return FuseGroupQueryAttention(max_length=32)


def attrs(model, op="GroupQueryAttention"):
    node = next(n for n in model.graph.node if n.op_type == op)
    return node, {a.name: a for a in node.attribute}


def assert_matches_lowered(model, fused, d):
    f = decoder_feeds(d)
    expected, got = run_unoptimised(lowered(model), f)[0], run_unoptimised(fused, f)[0]
    real = f["attention_mask"].astype(bool)
    assert np.isfinite(got[real]).all()
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4)


@pytest.mark.parametrize("q_heads,kv_heads,bias", [(2, 1, True), (2, 2, False), (4, 1, True)])
def test_fuses_rotary_gqa_and_matches(q_heads, kv_heads, bias):
    model = decoder_attention_graph(q_heads, kv_heads, bias=bias)
    fused, record = run_passes(model, [gqa()])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 1, "layers": 1}
    ops = op_types(fused)
    assert ops.count("GroupQueryAttention") == 1
    assert {"CapturedAttention", "RotaryEmbedding", "Cos", "Sin", "Transpose", "Split"}.isdisjoint(ops)
    assert ops.count("MatMul") == 1  # Q, K and V packed into one projection
    node, a = attrs(fused)
    assert node.domain == "com.microsoft" and a["do_rotary"].i == 1 and a["kv_num_heads"].i == kv_heads
    assert [n.name for n in fused.graph.node if n.op_type == "Reshape"][-1] == "merge_reshape"  # reads the kernel
    assert_matches_lowered(model, fused, q_heads * HD)


@pytest.mark.parametrize("where", ["before", "after"])
def test_head_norms_run_in_front_of_the_kernel_and_match(where):
    """Per-head RMSNorms on Q and K, before or after the head split's Transpose: they run on the projections' outputs
    viewed as (B, S, heads, head size); rotary stays in the kernel; Q, K and V are three inputs."""
    model = decoder_attention_graph(4, 2, head_norm=where)
    fused, record = run_passes(model, [gqa()])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 0, "layers": 1}
    ops = op_types(fused)
    assert ops.count("RMSNormalization") == 2 and ops.count("MatMul") == 3
    assert {"CapturedAttention", "RotaryEmbedding", "Transpose"}.isdisjoint(ops)
    node, _ = attrs(fused)
    assert len([i for i in node.input[:3] if i]) == 3
    assert_matches_lowered(model, fused, 4 * HD)


@pytest.mark.parametrize("packed", [True, "slices"])
def test_a_packed_projection_goes_in_as_it_is(packed):
    """One projection cut in three (a Split, or three Slices) is already the kernel's packed input."""
    model = decoder_attention_graph(4, 2, packed=packed)
    fused, record = run_passes(model, [gqa()])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 1, "layers": 1}
    ops = op_types(fused)
    assert ops.count("MatMul") == 1 and {"Slice", "Split", "Transpose"}.isdisjoint(ops)
    assert_matches_lowered(model, fused, 4 * HD)


def test_slices_out_of_order_go_in_apart_with_a_note():
    """Slices that cut Q, V, K are not the kernel's packed layout: Q, K and V go in as three inputs (a note says
    why), still one fused kernel."""
    model = decoder_attention_graph(4, 2, packed="slices", slice_order="qvk")
    fused, record = run_passes(model, [gqa()])
    assert record[0]["stats"]["fused"] == 1 and record[0]["stats"]["packed_qkv"] == 0
    assert any("not Q, K, V back to back" in r["why"] for r in record[0]["skipped"])
    assert_matches_lowered(model, fused, 4 * HD)


@pytest.mark.parametrize("q_heads,kv_heads,packed", [(4, 2, False), (2, 2, "heads")])
def test_partial_rotary_goes_into_the_kernel_and_matches(q_heads, kv_heads, packed):
    """16 of 32 features rotated (separate projections, and each head's Q, K, V side by side split after the
    Transpose): the Slices, RotaryEmbedding and Concat go; the kernel's cos/sin caches are 8 wide."""
    from onnx import numpy_helper

    model = decoder_attention_graph(q_heads, kv_heads, head_size=32, rotary_dim=16, packed=packed, bias=False)
    fused, record = run_passes(model, [gqa()])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 1, "layers": 1}
    assert {"CapturedAttention", "RotaryEmbedding", "Slice", "Split"}.isdisjoint(op_types(fused))
    assert op_types(fused).count("Transpose") == (1 if packed else 0)  # side-by-side heads: one regroup
    node, _ = attrs(fused)
    caches = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer if t.name in node.input[7:9]}
    assert [c.shape for c in caches.values()] == [(32, 8), (32, 8)]
    assert_matches_lowered(model, fused, q_heads * 32)


def test_a_rotary_the_kernel_cannot_take_stays_in_the_graph():
    """Rotary over 8 features (the kernel rotates multiples of 16): the RotaryEmbedding stays and the kernel gets
    Q and K rotated; the layer is still fused, with a note saying why the rotary was not folded."""
    model = decoder_attention_graph(4, 2, head_size=32, rotary_dim=8)
    fused, record = run_passes(model, [gqa()])
    assert record[0]["stats"]["fused"] == 1 and record[0]["stats"]["rotary"] == 0
    assert "RotaryEmbedding" in op_types(fused)
    assert any("rotary stays in the graph" in r["why"] and "8 of 32" in r["why"] for r in record[0]["skipped"])
    _, a = attrs(fused)
    assert a["do_rotary"].i == 0
    assert_matches_lowered(model, fused, 4 * 32)


def test_sliding_window_comes_from_the_mask():
    """The window is what the mask computes (found by running it), not what a config says."""
    model = decoder_attention_graph(window=3)
    fused, _ = run_passes(model, [gqa()])
    _, a = attrs(fused)
    assert a["local_window_size"].i == 3
    assert_matches_lowered(model, fused, 2 * HD)
    plain, _ = run_passes(decoder_attention_graph(), [gqa()])
    assert "local_window_size" not in attrs(plain)[1]


def test_a_planted_wrong_window_fails_the_comparison():
    model = decoder_attention_graph(window=3)
    fused, _ = run_passes(model, [gqa()])
    attrs(fused)[1]["local_window_size"].i = 4
    with pytest.raises(AssertionError):
        assert_matches_lowered(model, fused, 2 * HD)


def test_second_run_changes_nothing():
    once, _ = run_passes(decoder_attention_graph(), [gqa()])
    twice, record = run_passes(once, [gqa()])
    assert record[0]["modified"] is False and record[0]["stats"]["fused"] == 0
    assert twice.SerializeToString() == once.SerializeToString()


@pytest.mark.parametrize("kwargs,why", [
    (dict(head_size=12, rotary=False), "head size 12 is not a multiple of 8"),
    (dict(causal=False), "bidirectional, padding, not causal"),
    (dict(prefix=2), "a custom mask"),
])
def test_refuses_with_reason_and_leaves_the_graph_as_it_was(kwargs, why):
    model = decoder_attention_graph(**kwargs)
    out, record = run_passes(model, [gqa()])
    assert record[0]["modified"] is False and record[0]["stats"]["fused"] == 0
    assert why in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_one_refused_layer_keeps_every_layer_unfused():
    """A decoder's layers share one cache form: a second layer the kernel cannot take leaves the first unfused too."""
    import onnx

    from kiln.passes import attention_node as an

    model = decoder_attention_graph()
    node = next(n for n in model.graph.node if an.is_captured(n))
    twin = onnx.NodeProto()
    twin.CopyFrom(node)
    twin.name, twin.output[0] = "sdpa_2", "ctx_2"
    next(a for a in twin.attribute if a.name == "softcap").f = 0.0
    twin.input.extend([""] * (6 - len(twin.input)))
    twin.input[5] = "mask_bias_2"  # a position bias: not the kernel's
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((1, 1, 1, 1), np.float32), "mask_bias_2"))
    model.graph.node.append(twin)
    model.graph.output.append(onnx.helper.make_tensor_value_info("ctx_2", onnx.TensorProto.FLOAT, ["b", "s", 2, HD]))
    out, record = run_passes(model, [gqa()])
    assert record[0]["modified"] is False
    whys = [r["why"] for r in record[0]["skipped"]]
    assert any("position bias" in w for w in whys) and any("stay unfused too" in w for w in whys)
    assert out.SerializeToString() == model.SerializeToString()
