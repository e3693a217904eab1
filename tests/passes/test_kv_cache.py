"""kv-cache: GroupQueryAttention gets past/present per layer; prefill + cached decode equal a full forward."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from graphs import HD, decoder_attention_graph, op_types

from kiln.passes import run_passes
from kiln.passes.fuse_gqa import FuseGroupQueryAttention
from kiln.passes.kv_cache import AddKVCache


def cached_graph(q_heads=2, kv_heads=1, **kw):
    model = decoder_attention_graph(q_heads, kv_heads, **kw)
    return run_passes(model, [FuseGroupQueryAttention(max_length=32), AddKVCache(kv_heads, kw.get("head_size", HD))])


def session(model):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def test_adds_past_and_present_per_layer():
    model, record = cached_graph()
    assert record[1]["stats"]["layers"] == 1
    names = [i.name for i in model.graph.input]
    assert "past_key_values.0.key" in names and "past_key_values.0.value" in names
    assert {"present.0.key", "present.0.value"} <= {o.name for o in model.graph.output}
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert list(node.input[3:5]) == ["past_key_values.0.key", "past_key_values.0.value"]


@pytest.mark.parametrize("rotary_dim,head_size", [(None, HD), (8, 32)], ids=["rotary in the kernel", "rotary in the graph"])
def test_prefill_then_decode_matches_full_forward(rotary_dim, head_size):
    """Left-padded batch: prefill 4 tokens, then 2 single-token steps through the cache. A rotary the kernel does
    not take stays in the graph: its positions are then cut to the new tokens' (``sliced_positions``)."""
    model, record = cached_graph(rotary_dim=rotary_dim, head_size=head_size)
    assert record[1]["stats"]["sliced_positions"] == (1 if rotary_dim else 0)
    s = session(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 2 * head_size)).astype(np.float32)
    mask = np.ones((2, 6), np.int64)
    mask[1, :2] = 0
    empty = np.zeros((2, 1, 0, head_size), np.float32)
    ids = np.zeros((2, 6), np.int64)

    def run(lo, hi, past):
        feeds = {"x": x[:, lo:hi], "attention_mask": mask[:, :hi], "input_ids": ids[:, lo:hi],
                 "past_key_values.0.key": past[0], "past_key_values.0.value": past[1]}
        y, _, k, v = s.run(["y", "ids_shape", "present.0.key", "present.0.value"], feeds)
        return y, (k, v)

    full, _ = run(0, 6, (empty, empty))
    y0, past = run(0, 4, (empty, empty))
    y1, past = run(4, 5, past)
    y2, past = run(5, 6, past)
    assert past[0].shape == (2, 1, 6, head_size)
    stepped = np.concatenate([y0, y1, y2], 1)
    real = mask.astype(bool)
    np.testing.assert_allclose(stepped[real], full[real], atol=1e-5)


def test_second_run_changes_nothing_and_says_why():
    once, _ = cached_graph()
    twice, record = run_passes(once, [AddKVCache(1, HD)])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()
    assert "already reads a past cache" in record[0]["skipped"][0]["why"]


def test_unfused_attention_gets_no_cache():
    model = decoder_attention_graph(2, 1, head_size=12, rotary=False)  # GroupQueryAttention refuses head size 12
    out, record = run_passes(model, [FuseGroupQueryAttention(max_length=32), AddKVCache(1, 12)])
    assert record[1]["stats"]["layers"] == 0
    assert "not fused" in record[1]["skipped"][0]["why"]
    assert "GroupQueryAttention" not in op_types(out) and not any(i.name.startswith("past") for i in out.graph.input)
