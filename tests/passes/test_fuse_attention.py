"""fuse-attention: fires on both attention cores, refuses what it cannot fuse (and says why), idempotent."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import attention_graph, feeds, op_types, run_unoptimised

from kiln.passes import run_passes
from kiln.passes.fuse_attention import FuseAttention


@pytest.mark.parametrize("core", ["explicit", "onnx"])
def test_fuses_and_matches_unfused(core):
    model = attention_graph(core)
    fused, record = run_passes(model, [FuseAttention(head_size=4)])
    assert record[0]["stats"] == {"fused": 1}
    assert op_types(fused).count("Attention") == 1
    assert next(n for n in fused.graph.node if n.op_type == "Attention").domain == "com.microsoft"
    assert "Softmax" not in op_types(fused) and "MatMul" not in op_types(fused)
    f = feeds("x")
    expected = run_unoptimised(model, f)[0]
    got = run_unoptimised(fused, f)[0]
    keep = f["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[keep], expected[keep], atol=1e-4)


@pytest.mark.parametrize("core", ["explicit", "onnx"])
def test_second_run_changes_nothing(core):
    once, _ = run_passes(attention_graph(core), [FuseAttention(head_size=4)])
    twice, record = run_passes(once, [FuseAttention(head_size=4)])
    assert record[0]["modified"] is False and record[0]["stats"] == {"fused": 0}
    assert twice.SerializeToString() == once.SerializeToString()


def test_cross_attention_is_refused_with_reason():
    model = attention_graph("explicit", kv_input="memory")
    out, record = run_passes(model, [FuseAttention(head_size=4)])
    assert record[0]["stats"] == {"fused": 0}
    assert "different inputs (cross-attention)" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_causal_attention_is_left_to_decoder_rules():
    _, record = run_passes(attention_graph("onnx", causal=True), [FuseAttention(head_size=4)])
    assert record[0]["stats"] == {"fused": 0}
    assert "causal" in record[0]["skipped"][0]["why"]


def test_indivisible_heads_refused():
    _, record = run_passes(attention_graph("onnx"), [FuseAttention(head_size=3)])
    assert "not a whole number of heads of size 3" in record[0]["skipped"][0]["why"]
