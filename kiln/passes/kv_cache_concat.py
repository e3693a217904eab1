"""Decoder KV cache as standard ONNX ops: every captured attention node (``kiln.passes.attention_node``) reads its
keys and values through a ``Concat`` of ``past_key_values.{i}.key/value`` and the new ones, and that concatenation is
``present.{i}.key/value``. The cache is found from the node's own K and V, never from a pattern.

Two graphs take it: the TensorRT flavour (TensorRT parses the standard ``Attention`` op without cache inputs, and
``GroupQueryAttention``'s in-place cache is not a standard op), and any CPU decoder whose attention no fused kernel
took (``fuse-gqa`` refused a layer): ``lower-attention`` then lowers the cached nodes. Layout (batch, kv heads, past,
head size), float32 at the graph's boundary, past length 0 for a prefill; a runtime feeds each step's present as the
next step's past.

With a cache, ``attention_mask`` covers past and new tokens (batch, total) while ``input_ids`` holds only the new
ones, so the pass also:
- re-points the exporter's reads of the sequence length from ``attention_mask`` to ``input_ids``;
- keeps the last ``sequence`` columns of mask-derived position ids where they become rotary angles or index an
  embedding table (``kv_cache.position_reads``);
- replaces each node's mask by one over (new, total) positions of the same kind (``kiln.passes.masks``: causal,
  with the layer's sliding window or none, the padding applied or not): key ``k`` is visible to the query at
  absolute position ``q`` when ``k <= q`` (and ``q - k < window``) and ``k`` is a real token, and always to itself,
  so a left-padding query row is never fully masked (its output is unused; a fully masked row would be NaN and leak
  through the next layer's keys and values).

Checks first, then mutates: a graph with a mask that is not causal (a prefix-LM, a custom mask), or that already
has a cache, is left as it was, with the reason.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from kiln.passes import attention_node as an
from kiln.passes.base import NoMatch, PassResult, Reason
from kiln.passes.graph import Constants, Graph, emit
from kiln.passes.kv_cache import PAST, PRESENT, CachePass, new_positions, position_reads
from kiln.passes.masks import MaskKind, classify, subgraph


class AddKVCacheConcat(CachePass):
    name = "kv-cache-concat"

    def _refusals(self, g: Graph, layers: list[an.Captured]) -> list[Reason]:
        why = []
        if not layers:
            why.append(Reason("*", "no captured attention left to give a cache (a fused kernel took every layer)"))
        if any(i.startswith("past_key_values.") for i in g.graph_inputs):
            why.append(Reason("*", "the graph already has a KV cache"))
        if self.mask_input not in g.graph_inputs or self.ids_input not in g.graph_inputs:
            why.append(Reason("*", f"the graph lacks {self.mask_input} or {self.ids_input}"))
        return why

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        layers = [an.read(n) for n in g.g.node if an.is_captured(n)]
        empty = {"layers": 0, "repointed_shapes": 0, "sliced_positions": 0}
        refused = self._refusals(g, layers)
        if refused:
            return PassResult(g.model, False, empty, refused)
        kinds: dict[tuple, MaskKind] = {}
        for c in layers:
            key = (c.mask, c.causal, c.window)
            try:
                kind = kinds.get(key) or classify(g, c.mask, c.causal, c.window, self.mask_input)
            except NoMatch as e:
                return PassResult(g.model, False, empty, [Reason(c.where, f"{e}; no layer gets a cache")])
            if not kind.causal:
                return PassResult(g.model, False, empty,
                                  [Reason(c.where, f"the attention is {kind.describe()}: a cache needs causal attention")])
            kinds[key] = kind
        keep = {v for c in layers if c.mask for n in subgraph(g, c.mask)[0] for v in n.output}
        reads = position_reads(g, model, self.mask_input, keep)
        if isinstance(reads, Reason):
            return PassResult(g.model, False, empty, [reads])

        # --- mutate ------------------------------------------------------------------------------------------
        repointed = 0
        for node in g.g.node:
            if node.op_type == "Shape" and node.input[0] == self.mask_input:
                node.input[0] = self.ids_input
                repointed += 1
        consts, new = Constants(g), []
        new += new_positions(g, reads, self.ids_input)
        masks: dict[MaskKind, str] = {}
        for i, c in enumerate(layers):
            kind = kinds[(c.mask, c.causal, c.window)]
            if kind not in masks:
                masks[kind] = self._mask(g, new, kind, consts)
            node = g.node(c.out)
            while len(node.input) < 4:
                node.input.append("")
            node.input[3] = masks[kind]
            for slot, what, size in ((1, "key", c.head_size), (2, "value", c.v_head_size)):
                past, present = PAST.format(i, what), PRESENT.format(i, what)
                new.append(helper.make_node("Concat", [past, node.input[slot]], [present], axis=2,
                                            name=g.fresh(f"KVConcat{what.title()}")))
                node.input[slot] = present
                g.g.input.append(helper.make_tensor_value_info(past, TensorProto.FLOAT,
                                                               ["batch", c.kv_heads, "past_sequence", size]))
                g.g.output.append(helper.make_tensor_value_info(present, TensorProto.FLOAT,
                                                                ["batch", c.kv_heads, "present_sequence", size]))
        for node in g.g.input:  # the mask now spans past and new tokens
            if node.name == self.mask_input:
                node.type.tensor_type.shape.dim[1].dim_param = "total_sequence"
        g.g.node.extend(new)
        del g.g.value_info[:]  # sequence-length facts changed: let inference redo them
        g.reindex()
        g.toposort()
        g.reindex()
        g.prune()
        return PassResult(g.model, True, {"layers": len(layers), "repointed_shapes": repointed,
                                          "sliced_positions": len(reads)})

    def _mask(self, g: Graph, new: list, kind: MaskKind, consts: Constants) -> str:
        """A boolean (B, 1, new, total) mask of ``kind`` over past and new tokens."""
        new_len1 = emit(g, new, "Shape", [self.ids_input], "kv_new_len1", start=1, end=2)
        new_len = emit(g, new, "Squeeze", [new_len1, consts.int64("axis0", [0])], "kv_new_len")
        total1 = emit(g, new, "Shape", [self.mask_input], "kv_total1", start=1, end=2)
        total = emit(g, new, "Squeeze", [total1, consts.int64("axis0", [0])], "kv_total")
        start = emit(g, new, "Sub", [total, new_len], "kv_past")
        keys = emit(g, new, "Unsqueeze", [emit(g, new, "Range", [consts.int64("zero", 0), total, consts.int64("one", 1)],
                                               "kv_keys"), consts.int64("axis0", [0])], "kv_keys_row")
        queries = emit(g, new, "Unsqueeze", [emit(g, new, "Range", [start, total, consts.int64("one", 1)], "kv_queries"),
                                             consts.int64("axis1", [1])], "kv_queries_col")
        visible = emit(g, new, "LessOrEqual", [keys, queries], "kv_causal")
        if kind.window:
            distance = emit(g, new, "Sub", [queries, keys], "kv_distance")
            near = emit(g, new, "Less", [distance, consts.int64(f"window:{kind.window}", kind.window)], "kv_near")
            visible = emit(g, new, "And", [visible, near], "kv_window")
        if kind.padding:
            real = emit(g, new, "Cast", [self.mask_input], "kv_real", to=TensorProto.BOOL)
            real4 = emit(g, new, "Unsqueeze", [real, consts.int64("axes12", [1, 2])], "kv_real4")
            visible = emit(g, new, "And", [visible, real4], "kv_visible")
        own = emit(g, new, "Equal", [keys, queries], "kv_self")
        return emit(g, new, "Or", [visible, own], "kv_mask")
