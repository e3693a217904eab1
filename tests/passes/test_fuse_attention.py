"""fuse-attention: captured encoder attention -> com.microsoft.Attention (packed) or MultiHeadAttention (the mask as
a bias); refuses what neither takes (and says why, graph untouched); idempotent; matches the standard-op lowering."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import attention_graph, feeds, lowered, op_types, run_unoptimised

from kiln.passes import run_passes
from kiln.passes.fuse_attention import FuseAttention


def assert_matches_lowered(model, fused, f=None):
    f = f or feeds("x")
    expected, got = run_unoptimised(lowered(model), f)[0], run_unoptimised(fused, f)[0]
    keep = f["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[keep], expected[keep], atol=1e-5)
    return expected, got


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_padding_only_attention_is_packed_and_matches(mask):
    model = attention_graph(mask=mask)
    fused, record = run_passes(model, [FuseAttention()])
    assert record[0]["stats"] == {"fused": 1, "packed": 1, "heads": 0}
    node = next(n for n in fused.graph.node if n.op_type == "Attention")
    assert node.domain == "com.microsoft" and len(node.input) == 4  # X, packed weight, packed bias, 2-D mask
    assert {"MatMul", "CapturedAttention", "Transpose"}.isdisjoint(op_types(fused))
    assert_matches_lowered(model, fused)


@pytest.mark.parametrize("kind", ["cross", "causal"])
def test_other_self_attention_runs_as_multi_head_attention_with_its_mask(kind):
    """Keys from another input, or a mask that is not padding only: MultiHeadAttention with the model's own mask
    as its additive bias (no rule about how the mask was built)."""
    model = attention_graph(kv_input="memory") if kind == "cross" else attention_graph(causal=True)
    fused, record = run_passes(model, [FuseAttention()])
    assert record[0]["stats"] == {"fused": 1, "packed": 0, "heads": 1}
    node = next(n for n in fused.graph.node if n.op_type == "MultiHeadAttention")
    assert node.domain == "com.microsoft" and node.input[5]  # attention_bias
    assert_matches_lowered(model, fused, feeds("x", "memory") if kind == "cross" else feeds("x"))


def test_a_planted_wrong_scale_fails_the_comparison():
    """The comparison is tight enough to see a fused kernel computing something else."""
    model = attention_graph()
    fused, _ = run_passes(model, [FuseAttention()])
    node = next(n for n in fused.graph.node if n.op_type == "Attention")
    next(a for a in node.attribute if a.name == "scale").f *= 1.05
    with pytest.raises(AssertionError):
        assert_matches_lowered(model, fused)


def test_softcap_is_refused_unchanged():
    model = attention_graph(softcap=5.0)
    out, record = run_passes(model, [FuseAttention()])
    assert record[0]["modified"] is False and "soft-cap" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_causal_without_a_mask_is_left_to_the_standard_op():
    out, record = run_passes(attention_graph(mask="none", causal=True), [FuseAttention()])
    assert record[0]["stats"]["fused"] == 0 and "causal attention without a mask" in record[0]["skipped"][0]["why"]


def test_second_run_changes_nothing():
    once, _ = run_passes(attention_graph(), [FuseAttention()])
    twice, record = run_passes(once, [FuseAttention()])
    assert record[0]["modified"] is False and record[0]["stats"]["fused"] == 0
    assert twice.SerializeToString() == once.SerializeToString()
