"""masks.classify: what a traced mask computes, found by running its subgraph on probe paddings."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import attention_graph, decoder_attention_graph
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import attention_node as an
from kiln.passes.base import NoMatch
from kiln.passes.graph import Graph
from kiln.passes.masks import MaskKind, classify


def kind_of(model, window_hint=0):
    g = Graph(model)
    c = next(an.read(n) for n in model.graph.node if an.is_captured(n))
    return classify(g, c.mask, c.causal, window_hint)


@pytest.mark.parametrize("model,want", [
    (decoder_attention_graph(), MaskKind(True, None, True)),
    (decoder_attention_graph(window=3), MaskKind(True, 3, True)),
    (decoder_attention_graph(window=15), MaskKind(True, 15, True)),  # longer than the short probes: seen at 18
    (decoder_attention_graph(causal=False), MaskKind(False, None, True)),
    (attention_graph(), MaskKind(False, None, True)),
    (attention_graph(mask="additive"), MaskKind(False, None, True)),
    (attention_graph(causal=True), MaskKind(True, None, True)),
], ids=["causal", "window 3", "window 15", "decoder bidirectional", "encoder", "encoder additive", "encoder causal"])
def test_kinds(model, want):
    assert kind_of(model, window_hint=want.window or 0) == want


def test_a_window_is_found_without_a_hint_when_short():
    assert kind_of(decoder_attention_graph(window=5)) == MaskKind(True, 5, True)


def test_no_mask_means_the_causal_flag_without_padding():
    g = Graph(attention_graph())
    assert classify(g, None, True) == MaskKind(True, None, False)
    assert classify(g, None, False) == MaskKind(False, None, False)


def test_a_prefix_mask_is_custom():
    with pytest.raises(NoMatch, match="custom mask"):
        kind_of(decoder_attention_graph(prefix=3))


def test_a_mask_reading_the_token_ids_is_refused():
    """A mask built from the ids' values (ids == pad id) is not a function of attention_mask alone."""
    model = decoder_attention_graph()
    pad = next(n for n in model.graph.node if n.output[0] == "pad_b")
    model.graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "pad_id"))
    model.graph.node.insert(0, helper.make_node("Equal", ["input_ids", "pad_id"], ["is_pad"]))
    model.graph.node.insert(1, helper.make_node("Not", ["is_pad"], ["ids_real"]))
    pad.input[0], pad.attribute[0].i = "ids_real", TensorProto.BOOL
    with pytest.raises(NoMatch, match="values of input_ids"):
        kind_of(model)


def test_an_additive_bias_is_not_a_mask():
    """Values other than 0 and -inf (an ALiBi-like bias folded into the mask) are refused, not rounded to a mask."""
    model = attention_graph(mask="additive")
    where = next(n for n in model.graph.node if n.op_type == "Where")
    zero = next(t for t in model.graph.initializer if t.name == where.input[1])
    zero.CopyFrom(numpy_helper.from_array(np.array(-0.5, np.float32), zero.name))
    with pytest.raises(NoMatch, match="other than 0 and -inf"):
        kind_of(model)
