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
- keeps the last ``sequence`` columns of mask-derived position ids where an embedding table is
  indexed by them (GPT-2's learned positions).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph

PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"


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
        skipped += [Reason(g.node(h).name or h, "attention is not fused to GroupQueryAttention; no layer gets a cache")
                    for h in g.nodes_of("Attention")]
        if skipped or not layers:
            return PassResult(g.model, False, {"layers": 0, "repointed_shapes": 0, "sliced_positions": 0}, skipped)
        kv_shape = ["batch", self.num_kv_heads, "past_sequence", self.head_size]
        out_shape = ["batch", self.num_kv_heads, "present_sequence", self.head_size]
        for i, node in enumerate(layers):
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
        sliced = self._slice_positions(g)
        g.toposort()
        g.reindex()
        return PassResult(g.model, True, {"layers": len(layers), "repointed_shapes": repointed, "sliced_positions": sliced})

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

    def _slice_positions(self, g: Graph) -> int:
        """Gather(table, positions) with positions from the mask alone: keep the last S positions."""
        count = 0
        for handle in g.nodes_of("Gather"):
            node = g.node(handle)
            idx = node.input[1]
            if not g.is_constant(node.input[0]) or g.ancestors_inputs(idx) != {self.mask_input}:
                continue
            c = {k: g.add_initializer(k, v) for k, v in (("pos_axis", np.array([1], np.int64)),
                                                          ("pos_end", np.array([np.iinfo(np.int64).max], np.int64)))}
            t = {k: g.fresh(f"pos_{k}") for k in ("len", "start", "last")}
            new = [helper.make_node("Shape", [self.ids_input], [t["len"]], start=1, end=2, name=g.fresh("NewLength")),
                   helper.make_node("Neg", [t["len"]], [t["start"]], name=g.fresh("NewStart")),
                   helper.make_node("Slice", [idx, t["start"], c["pos_end"], c["pos_axis"]], [t["last"]],
                                    name=g.fresh("NewPositions"))]
            node.input[1] = t["last"]
            g.g.node.extend(new)
            count += 1
        g.reindex()
        return count
