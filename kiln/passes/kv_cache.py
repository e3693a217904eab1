"""Decoder KV cache: every GroupQueryAttention reads ``past_key_values.{i}.key/value`` and writes
``present.{i}.key/value``, so one graph serves prefill (past length 0) and each decode step.

Layout (batch, kv heads, sequence, head size), float32. GroupQueryAttention appends the new keys
and values at position ``seqlens_k`` of the past: fed a buffer of ``capacity`` positions that is
also bound as the present output (ONNX Runtime IO binding), it writes in place and a decode step
copies no cache (the runtime does this; a plain ``run`` with a growing past works too).

With a cache, ``attention_mask`` covers past and new tokens (batch, past + sequence) while
``input_ids`` holds only the new ones, so the pass also:
- re-points the exporter's reads of the sequence length from ``attention_mask`` to ``input_ids``
  (reshapes of per-token activations), except those feeding the attention's own lengths and bias;
- keeps the last ``sequence`` columns of mask-derived position ids where they become rotary angles (a rotary
  the kernel does not take stays in the graph) or index an embedding table (learned positions): ``new_positions``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes import attention_node as an
from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph, attr
from kiln.passes.pin_norms import value_types

PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def mask_only_values(g: Graph, mask_input: str) -> set[str]:
    """Every value computed from ``mask_input`` alone (constants aside), in one pass over the sorted graph."""
    only = {mask_input}
    for node in g.g.node:
        ins = [i for i in node.input if i and not g.is_constant(i)]
        if ins and all(i in only for i in ins):
            only.update(o for o in node.output if o)
    return only - {mask_input}


def position_reads(g: Graph, model: onnx.ModelProto, mask_input: str, keep: set[str] = frozenset()
                   ) -> list[tuple[onnx.NodeProto, int, int]] | Reason:
    """Where per-token computation reads positions derived from ``attention_mask`` alone: a Cast of them to float
    (rotary angles) or a Gather / GatherND indexing a constant table by them (learned or sinusoidal positions). Returns (node, input index,
    the sequence axis of that input), or the Reason the axis cannot be told. ``keep``: values the attention's own
    lengths and bias are built from (they span past and new tokens and stay)."""
    types = value_types(model)
    reads = [(n, 0) for n in g.g.node if n.op_type == "Cast" and attr(n, "to") in FLOATS and n.input[0] not in keep
             and types.get(n.input[0]) not in FLOATS and g.ancestors_inputs(n.input[0]) == {mask_input}]
    reads += [(n, 1) for n in g.g.node if n.op_type in ("Gather", "GatherND") and g.is_constant(n.input[0])
              and n.input[1] not in keep and g.ancestors_inputs(n.input[1]) == {mask_input}]
    axes = sequence_axes(model, [n.input[i] for n, i in reads], mask_input)
    unknown = [n.input[i] for n, i in reads if axes.get(n.input[i]) is None]
    if unknown:
        return Reason(unknown[0], "cannot tell the sequence axis of these mask-derived positions; no layer gets a cache")
    return [(n, i, axes[n.input[i]]) for n, i in reads]


def sequence_axes(model: onnx.ModelProto, values: list[str], mask_input: str) -> dict[str, int | None]:
    """Per value, the one axis with the mask's sequence length (ONNX shape inference), None when not exactly one."""
    if not values:
        return {}
    inferred = onnx.shape_inference.infer_shapes(model)
    seq = next(i.type.tensor_type.shape.dim[1] for i in model.graph.input if i.name == mask_input)
    out: dict[str, int | None] = {v: None for v in values}
    for vi in inferred.graph.value_info:
        if vi.name in out and seq.dim_param:
            hits = [k for k, d in enumerate(vi.type.tensor_type.shape.dim) if d.dim_param == seq.dim_param]
            out[vi.name] = hits[0] if len(hits) == 1 else None
    return out


def new_positions(g: Graph, reads: list[tuple[onnx.NodeProto, int, int]], ids_input: str) -> list[onnx.NodeProto]:
    """Each read takes the last ``sequence`` positions (the new tokens') on its axis; returns the nodes to add."""
    end = g.add_initializer("pos_end", np.array([np.iinfo(np.int64).max], np.int64))
    new = []
    for node, i, axis in reads:
        t = {k: g.fresh(f"pos_{k}") for k in ("len", "start", "last")}
        new += [helper.make_node("Shape", [ids_input], [t["len"]], start=1, end=2, name=g.fresh("NewLength")),
                helper.make_node("Neg", [t["len"]], [t["start"]], name=g.fresh("NewStart")),
                helper.make_node("Slice", [node.input[i], t["start"], end,
                                           g.add_initializer("pos_axis", np.array([axis], np.int64))], [t["last"]],
                                 name=g.fresh("NewPositions"))]
        node.input[i] = t["last"]
    return new


class CachePass(Pass):
    """What a KV-cache pass is told: the cache's kv heads and head size, and the graph's mask and token inputs."""

    def __init__(self, num_kv_heads: int, head_size: int, mask_input: str = "attention_mask",
                 ids_input: str = "input_ids") -> None:
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.mask_input = mask_input
        self.ids_input = ids_input


class AddKVCache(CachePass):
    name = "kv-cache"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        layers = [g.node(h) for h in g.nodes_of("GroupQueryAttention", MS_DOMAIN)]
        skipped = [Reason(n.name, "already reads a past cache") for n in layers if len(n.input) > 3 and n.input[3]]
        # A cache must cover every layer: one unfused attention would see only the new tokens.
        skipped += [Reason(n.name or n.output[0], "attention is not fused to GroupQueryAttention; no layer gets this "
                                                  "cache") for n in g.g.node if n.op_type == "Attention" or an.is_captured(n)]
        empty = {"layers": 0, "repointed_shapes": 0, "sliced_positions": 0}
        if skipped or not layers:
            return PassResult(g.model, False, empty, skipped)
        reads = position_reads(g, model, self.mask_input, self._attention_lengths(g, layers))
        if isinstance(reads, Reason):
            return PassResult(g.model, False, empty, [reads])
        sizes = self._head_sizes(model, layers)
        for i, node in enumerate(layers):
            heads = int(attr(node, "kv_num_heads", self.num_kv_heads))  # each layer's own (they may differ)
            kv_shape = ["batch", heads, "past_sequence", sizes[i]]
            out_shape = ["batch", heads, "present_sequence", sizes[i]]
            names = {kind: (PAST.format(i, kind), PRESENT.format(i, kind)) for kind in ("key", "value")}
            node.input[3], node.input[4] = names["key"][0], names["value"][0]
            while len(node.output) < 3:
                node.output.append("")
            node.output[1], node.output[2] = names["key"][1], names["value"][1]
            for kind in ("key", "value"):
                g.g.input.append(helper.make_tensor_value_info(names[kind][0], TensorProto.FLOAT, kv_shape))
                g.g.output.append(helper.make_tensor_value_info(names[kind][1], TensorProto.FLOAT, out_shape))
        g.reindex()
        repointed = self._repoint_lengths(g, layers)
        g.g.node.extend(new_positions(g, reads, self.ids_input))
        sliced = len(reads)
        for i in g.g.input:  # the mask now spans past and new tokens: not the ids' sequence axis
            if i.name == self.mask_input and len(i.type.tensor_type.shape.dim) == 2:
                i.type.tensor_type.shape.dim[1].dim_param = "total_sequence"
        g.toposort()
        g.reindex()
        only_mask = mask_only_values(g, self.mask_input)
        stale = [v for v in g.g.value_info if v.name in only_mask]
        for v in stale:  # values of the mask alone now span past and new tokens: their declared lengths are wrong
            g.g.value_info.remove(v)
        g.toposort()
        g.reindex()
        return PassResult(g.model, True, {"layers": len(layers), "repointed_shapes": repointed, "sliced_positions": sliced})

    def _head_sizes(self, model: onnx.ModelProto, layers: list[onnx.NodeProto]) -> list[int]:
        """Each layer's head size, from the width shape inference gives its key (or packed query) input; the
        configured one where inference cannot tell. Layers may differ (a model with wider global-attention heads)."""
        widths = {}
        inferred = onnx.shape_inference.infer_shapes(model)
        for v in (*inferred.graph.value_info, *inferred.graph.input):
            dims = v.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value"):
                widths[v.name] = dims[-1].dim_value
        out = []
        for node in layers:
            heads, kv = int(attr(node, "num_heads", 0)), int(attr(node, "kv_num_heads", self.num_kv_heads))
            packed = not (len(node.input) > 1 and node.input[1])
            width = widths.get(node.input[0] if packed else node.input[1])
            groups = heads + 2 * kv if packed else kv
            out.append(width // groups if width and groups and width % groups == 0 else self.head_size)
        return out

    def _attention_lengths(self, g: Graph, layers: list[onnx.NodeProto]) -> set[str]:
        """Every value the attention's seqlens / total length / padding bias are computed from."""
        seen: set[str] = set()
        stack = [n.input[i] for n in layers for i in (5, 6, 10) if len(n.input) > i and n.input[i]]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            p = g.producer.get(v)
            if p is not None:
                stack.extend(i for i in p.input if i)
        return seen

    def _repoint_lengths(self, g: Graph, layers: list[onnx.NodeProto]) -> int:
        keep = self._attention_lengths(g, layers)
        count = 0
        for node in g.g.node:
            if node.op_type == "Shape" and node.input[0] == self.mask_input and node.output[0] not in keep:
                node.input[0] = self.ids_input
                count += 1
        return count
