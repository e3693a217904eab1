"""fuse-gqa: decoder attention -> GroupQueryAttention; fires, refuses with reasons, idempotent, matches unfused."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import HD, decoder_attention_graph, decoder_feeds, op_types, run_unoptimised

from kiln.passes import run_passes
from kiln.passes.fuse_gqa import FuseGroupQueryAttention


def gqa(q_heads=2, kv_heads=1, **kw):
    return FuseGroupQueryAttention(num_heads=q_heads, num_kv_heads=kv_heads, max_length=32, **kw)


def assert_matches_unfused(model, fused, d):
    f = decoder_feeds(d)
    expected, got = run_unoptimised(model, f)[0], run_unoptimised(fused, f)[0]
    real = f["attention_mask"].astype(bool)
    assert np.isfinite(got[real]).all()
    np.testing.assert_allclose(got[real], expected[real], atol=1e-4)


@pytest.mark.parametrize("q_heads,kv_heads,bias", [(2, 1, True), (2, 2, False), (4, 1, True)])
def test_fuses_rotary_gqa_and_matches_unfused(q_heads, kv_heads, bias):
    model = decoder_attention_graph(q_heads, kv_heads, bias=bias)
    fused, record = run_passes(model, [gqa(q_heads, kv_heads)])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 1}
    ops = op_types(fused)
    assert ops.count("GroupQueryAttention") == 1
    assert {"Attention", "RotaryEmbedding", "Cos", "Sin", "Transpose", "Split"}.isdisjoint(ops)
    assert ops.count("MatMul") == 1  # Q, K and V packed into one projection
    node = next(n for n in fused.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: a for a in node.attribute}
    assert node.domain == "com.microsoft" and attrs["do_rotary"].i == 1 and attrs["kv_num_heads"].i == kv_heads
    assert_matches_unfused(model, fused, q_heads * HD)


@pytest.mark.parametrize("where", ["before", "after"])
def test_head_norms_move_in_front_of_the_kernel_and_match_unfused(where):
    """Per-head RMSNorms on Q and K (Qwen3 before the Transpose, Gemma 3 after it) run on the projections'
    outputs viewed as (B, S, heads, head size); rotary stays in the kernel; Q, K and V are three inputs."""
    model = decoder_attention_graph(4, 2, head_norm=where)
    fused, record = run_passes(model, [gqa(4, 2)])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 0}
    ops = op_types(fused)
    assert ops.count("RMSNormalization") == 2 and ops.count("MatMul") == 3
    assert {"Attention", "RotaryEmbedding", "Transpose"}.isdisjoint(ops)
    node = next(n for n in fused.graph.node if n.op_type == "GroupQueryAttention")
    assert len([i for i in node.input[:3] if i]) == 3
    assert_matches_unfused(model, fused, 4 * HD)


def test_head_norm_with_a_per_channel_scale_is_refused_unchanged():
    """A norm whose scale is not one value per head feature cannot move: refused, graph untouched."""
    from onnx import numpy_helper

    model = decoder_attention_graph(2, 1, head_norm="before")
    w = next(t for t in model.graph.initializer if t.name == "q_norm_w")
    w.CopyFrom(numpy_helper.from_array(np.ones((2, HD), np.float32), "q_norm_w"))
    out, record = run_passes(model, [gqa()])
    assert record[0]["modified"] is False and "not a constant of the head size" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_packed_split_without_rotary_matches_unfused():
    model = decoder_attention_graph(2, 2, rotary=False, packed=True)
    fused, record = run_passes(model, [gqa(2, 2)])
    assert record[0]["stats"] == {"fused": 1, "rotary": 0, "packed_qkv": 1}
    assert "Split" not in op_types(fused)
    assert_matches_unfused(model, fused, 2 * HD)


def test_packed_slices_and_a_merge_view_match_unfused():
    """Phi-3: Q, K and V cut from the packed projection by three Slices are already the kernel's packed input; the
    (B, -1, S, head size) Reshape before the merge goes with the Transpose."""
    model = decoder_attention_graph(4, 2, packed="slices", merge_view=True)
    fused, record = run_passes(model, [gqa(4, 2)])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 1}
    ops = op_types(fused)
    assert ops.count("MatMul") == 1 and {"Slice", "Attention", "Transpose"}.isdisjoint(ops)
    names = {n.name for n in fused.graph.node}
    assert "merge_view" not in names and "merge_reshape" in names  # the merge's own Reshape flattens (B, S, H * hd)
    assert_matches_unfused(model, fused, 4 * HD)


def test_packed_slices_out_of_order_are_refused_unchanged():
    """Slices that cut Q, V, K (not the kernel's Q, K, V layout) are refused with the bounds, graph untouched."""
    model = decoder_attention_graph(4, 2, packed="slices", merge_view=True, slice_order="qvk")
    out, record = run_passes(model, [gqa(4, 2)])
    assert record[0]["modified"] is False and "are not Q, K, V back to back" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("q_heads,kv_heads,packed", [(4, 2, False), (2, 2, "heads")])
def test_partial_rotary_goes_into_the_kernel_and_matches_unfused(q_heads, kv_heads, packed):
    """StableLM / Phi-2 (separate projections) and GPT-NeoX (each head's Q, K, V side by side, Split after the
    Transpose): 16 of 32 features rotated. The Slices, RotaryEmbedding and Concat go; the kernel's cos/sin caches
    are 8 wide; GPT-NeoX's projection is regrouped into the kernel's packed Q, K, V layout."""
    from onnx import numpy_helper

    model = decoder_attention_graph(q_heads, kv_heads, head_size=32, rotary_dim=16, packed=packed, bias=False)
    fused, record = run_passes(model, [gqa(q_heads, kv_heads)])
    assert record[0]["stats"] == {"fused": 1, "rotary": 1, "packed_qkv": 1}
    ops = op_types(fused)
    assert {"Attention", "RotaryEmbedding", "Slice", "Split"}.isdisjoint(ops)
    assert ops.count("Transpose") == (1 if packed else 0)  # GPT-NeoX: the regroup replaces the head split's
    assert not {f"{t}_{part}" for t in "qk" for part in ("part", "pass", "cat")} & {n.name for n in fused.graph.node}
    node = next(n for n in fused.graph.node if n.op_type == "GroupQueryAttention")
    caches = {t.name: numpy_helper.to_array(t) for t in fused.graph.initializer if t.name in node.input[7:9]}
    assert [c.shape for c in caches.values()] == [(32, 8), (32, 8)]
    assert_matches_unfused(model, fused, q_heads * 32)


def test_partial_rotary_narrower_than_the_kernel_takes_is_refused_unchanged():
    """Rotary over 8 features: GroupQueryAttention's cos/sin caches must be a multiple of 8 wide (16 features)."""
    model = decoder_attention_graph(4, 2, head_size=32, rotary_dim=8)
    out, record = run_passes(model, [gqa(4, 2)])
    assert record[0]["modified"] is False
    assert "partial rotary over 8 of 32 features" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_sliding_window_is_set_per_layer():
    fused, _ = run_passes(decoder_attention_graph(), [gqa(sliding_windows=(3,))])
    node = next(n for n in fused.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in node.attribute}["local_window_size"] == 3
    plain, _ = run_passes(decoder_attention_graph(), [gqa()])
    node = next(n for n in plain.graph.node if n.op_type == "GroupQueryAttention")
    assert "local_window_size" not in {a.name for a in node.attribute}


def test_second_run_changes_nothing():
    once, _ = run_passes(decoder_attention_graph(), [gqa()])
    twice, record = run_passes(once, [gqa()])
    assert record[0]["modified"] is False and record[0]["stats"]["fused"] == 0
    assert twice.SerializeToString() == once.SerializeToString()


@pytest.mark.parametrize("kwargs,heads,why", [
    (dict(head_size=8), (2, 1), "head size 8 is not a multiple of 16"),
    (dict(causal=False), (2, 1), "compares no positions, so it is not causal"),
])
def test_refuses_with_reason(kwargs, heads, why):
    model = decoder_attention_graph(*heads, **kwargs)
    out, record = run_passes(model, [gqa(*heads)])
    assert record[0]["stats"]["fused"] == 0
    assert why in record[0]["skipped"][0]["why"]
    assert "GroupQueryAttention" not in op_types(out)


def test_wrong_kv_head_count_is_refused():
    _, record = run_passes(decoder_attention_graph(2, 1), [gqa(2, 2)])
    assert record[0]["stats"]["fused"] == 0
    assert "do not match 2 KV heads" in record[0]["skipped"][0]["why"]


def test_refused_layer_leaves_the_graph_exactly_as_it_was():
    """The head-size check comes after Q/K/V are matched: a refusal there must not leave packed weights behind."""
    model = decoder_attention_graph(2, 1, head_size=8)
    out, record = run_passes(model, [gqa()])
    assert record[0]["modified"] is False and "multiple of 16" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_partial_rotary_is_refused_with_the_reason():
    """A head rotated in part (StableLM, Phi): the exporter concatenates a rotated slice with the rest."""
    import onnx
    from onnx import helper, numpy_helper

    model = decoder_attention_graph(2, 1, rotary=False)
    g = model.graph
    half = HD // 2
    g.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "s0"),
                          numpy_helper.from_array(np.array([half], np.int64), "s1"),
                          numpy_helper.from_array(np.array([HD], np.int64), "s2"),
                          numpy_helper.from_array(np.array([3], np.int64), "ax3")])
    attention = next(n for n in g.node if n.op_type == "Attention")
    extra = [helper.make_node("Slice", ["q_t", "s0", "s1", "ax3"], ["q_rot_part"]),
             helper.make_node("Slice", ["q_t", "s1", "s2", "ax3"], ["q_pass"]),
             helper.make_node("Neg", ["q_rot_part"], ["q_rotated"]),
             helper.make_node("Concat", ["q_rotated", "q_pass"], ["q_partial"], axis=-1)]
    attention.input[0] = "q_partial"
    nodes = list(g.node)
    at = next(i for i, n in enumerate(nodes) if n.op_type == "Attention")
    del g.node[:]
    g.node.extend(nodes[:at] + extra + nodes[at:])
    onnx.checker.check_model(model)
    out, record = run_passes(model, [gqa()])
    assert record[0]["modified"] is False
    assert "partial rotary" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()
