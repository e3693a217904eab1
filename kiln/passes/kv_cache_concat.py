"""Decoder KV cache in standard ONNX ops, for TensorRT: every ``Attention`` reads its keys and values through a
``Concat`` of ``past_key_values.{i}.key/value`` and the new ones, and that concatenation is ``present.{i}.key/value``.

TensorRT's ONNX parser takes ``Attention`` without cache inputs or outputs (``check-tensorrt-ops`` refuses those),
and ``GroupQueryAttention`` (the CPU graph's in-place cache) is not a standard op, so the TensorRT graph carries its
cache as plain tensors: layout (batch, kv heads, past, head size), float32 at the graph's boundary, past length 0
for a prefill. A runtime feeds each step's present as the next step's past (the TensorRT backend keeps both on the
GPU, swapping two buffers per tensor).

With a cache, ``attention_mask`` covers past and new tokens (batch, total) while ``input_ids`` holds only the new
ones, so the pass also:

- re-points the exporter's reads of the sequence length from ``attention_mask`` to ``input_ids``;
- keeps the last ``sequence`` columns of mask-derived position ids: where they are cast to float (rotary angles)
  and where an embedding table is indexed by them (GPT-2's learned positions);
- replaces the attention mask with one over (new, total) positions: key ``k`` is visible to the query at absolute
  position ``q`` when ``k <= q`` and ``k`` is a real token, and always to itself, so a left-padding query row is
  never fully masked (its output is unused; a fully masked row would be NaN and leak through the next layer's
  keys and values).

Checks first, then mutates: a graph whose attentions do not all share one mask, already read a past, or ask for
``is_causal`` is left as it was, with the reason.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import PassResult, Reason
from kiln.passes.graph import Graph, attr
from kiln.passes.kv_cache import PAST, PRESENT, CachePass
from kiln.passes.pin_norms import value_types

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


class AddKVCacheConcat(CachePass):
    name = "kv-cache-concat"

    def _refusals(self, g: Graph, layers: list[onnx.NodeProto]) -> list[Reason]:
        why = []
        if not layers:
            why.append(Reason("*", "no standard ONNX Attention to give a cache (canonicalize-attention runs first)"))
        masks = {n.input[3] if len(n.input) > 3 else "" for n in layers}
        if len(masks) > 1 or "" in masks:
            why.append(Reason("*", "the attentions do not share one attention mask; no layer gets a cache"))
        for n in layers:
            if any(n.input[4:6]) or any(n.output[1:]):
                why.append(Reason(n.name or n.output[0], "already reads or writes a past cache"))
            if attr(n, "is_causal", 0):
                why.append(Reason(n.name or n.output[0], "is_causal attention: its mask cannot take a past offset"))
        if any(i.startswith("past_key_values.") for i in g.graph_inputs):
            why.append(Reason("*", "the graph already has a KV cache"))
        if self.mask_input not in g.graph_inputs or self.ids_input not in g.graph_inputs:
            why.append(Reason("*", f"the graph lacks {self.mask_input} or {self.ids_input}"))
        return why

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        layers = [g.node(h) for h in g.nodes_of("Attention")]
        refused = self._refusals(g, layers)
        empty = {"layers": 0, "repointed_shapes": 0, "sliced_positions": 0}
        if refused:
            return PassResult(g.model, False, empty, refused)
        types = value_types(model)
        rope_casts = [n for n in g.g.node if n.op_type == "Cast" and attr(n, "to") in FLOATS
                      and types.get(n.input[0]) not in FLOATS and g.ancestors_inputs(n.input[0]) == {self.mask_input}]
        lookups = [n for n in g.g.node if n.op_type == "Gather" and g.is_constant(n.input[0])
                   and g.ancestors_inputs(n.input[1]) == {self.mask_input}]
        targets = [(n, 0) for n in rope_casts] + [(n, 1) for n in lookups]
        axes = self._sequence_axes(model, [n.input[i] for n, i in targets])
        unknown = [n.input[i] for n, i in targets if axes.get(n.input[i]) is None]
        if unknown:
            return PassResult(g.model, False, empty, [Reason(unknown[0], "cannot tell the sequence axis of these "
                                                             "mask-derived positions; no layer gets a cache")])

        # --- mutate ------------------------------------------------------------------------------------------
        c = {k: g.add_initializer(k, v) for k, v in (
            ("kv_zero", np.array(0, np.int64)), ("kv_one", np.array(1, np.int64)),
            ("kv_axis0", np.array([0], np.int64)), ("kv_axis1", np.array([1], np.int64)),
            ("kv_axes12", np.array([1, 2], np.int64)), ("kv_end", np.array([np.iinfo(np.int64).max], np.int64)))}
        t = {k: g.fresh(f"kv_{k}") for k in ("new_len", "new_len1", "total", "total1", "start", "kpos", "qpos", "k2",
                                             "q2", "causal", "self", "visible", "real", "real4", "mask")}
        new = [
            helper.make_node("Shape", [self.ids_input], [t["new_len1"]], start=1, end=2, name=g.fresh("KVNewLen")),
            helper.make_node("Squeeze", [t["new_len1"], c["kv_axis0"]], [t["new_len"]], name=g.fresh("KVNewLenS")),
            helper.make_node("Shape", [self.mask_input], [t["total1"]], start=1, end=2, name=g.fresh("KVTotal1")),
            helper.make_node("Squeeze", [t["total1"], c["kv_axis0"]], [t["total"]], name=g.fresh("KVTotal")),
            helper.make_node("Sub", [t["total"], t["new_len"]], [t["start"]], name=g.fresh("KVPast")),
            helper.make_node("Range", [c["kv_zero"], t["total"], c["kv_one"]], [t["kpos"]], name=g.fresh("KVKeys")),
            helper.make_node("Range", [t["start"], t["total"], c["kv_one"]], [t["qpos"]], name=g.fresh("KVQueries")),
            helper.make_node("Unsqueeze", [t["kpos"], c["kv_axis0"]], [t["k2"]], name=g.fresh("KVKeysRow")),
            helper.make_node("Unsqueeze", [t["qpos"], c["kv_axis1"]], [t["q2"]], name=g.fresh("KVQueriesCol")),
            helper.make_node("LessOrEqual", [t["k2"], t["q2"]], [t["causal"]], name=g.fresh("KVCausal")),
            helper.make_node("Equal", [t["k2"], t["q2"]], [t["self"]], name=g.fresh("KVSelf")),
            helper.make_node("Cast", [self.mask_input], [t["real"]], to=TensorProto.BOOL, name=g.fresh("KVReal")),
            helper.make_node("Unsqueeze", [t["real"], c["kv_axes12"]], [t["real4"]], name=g.fresh("KVReal4")),
            helper.make_node("And", [t["causal"], t["real4"]], [t["visible"]], name=g.fresh("KVVisible")),
            helper.make_node("Or", [t["visible"], t["self"]], [t["mask"]], name=g.fresh("KVMask")),
        ]
        sliced = 0
        for node, i in targets:
            value = node.input[i]
            last = g.fresh(f"{value}_new")
            axis_c = g.add_initializer("kv_pos_axis", np.array([axes[value]], np.int64))
            neg = g.fresh("kv_neg_len")
            new += [helper.make_node("Neg", [t["new_len1"]], [neg], name=g.fresh("KVNegLen")),
                    helper.make_node("Slice", [value, neg, c["kv_end"], axis_c], [last], name=g.fresh("KVPositions"))]
            node.input[i] = last
            sliced += 1
        kv_shape = ["batch", self.num_kv_heads, "past_sequence", self.head_size]
        out_shape = ["batch", self.num_kv_heads, "present_sequence", self.head_size]
        for i, node in enumerate(layers):
            node.input[3] = t["mask"]
            for slot, kind in ((1, "key"), (2, "value")):
                past, present = PAST.format(i, kind), PRESENT.format(i, kind)
                new.append(helper.make_node("Concat", [past, node.input[slot]], [present], axis=2,
                                            name=g.fresh(f"KVConcat{kind.title()}")))
                node.input[slot] = present
                g.g.input.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, kv_shape))
                g.g.output.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, out_shape))
        repointed = 0
        for node in g.g.node:
            if node.op_type == "Shape" and node.input[0] == self.mask_input:
                node.input[0] = self.ids_input
                repointed += 1
        for node in g.g.input:  # the mask now spans past and new tokens
            if node.name == self.mask_input:
                node.type.tensor_type.shape.dim[1].dim_param = "total_sequence"
        g.g.node.extend(new)
        del g.g.value_info[:]  # sequence-length facts changed: let inference redo them
        g.reindex()
        g.toposort()
        g.reindex()
        g.prune()
        return PassResult(g.model, True, {"layers": len(layers), "repointed_shapes": repointed, "sliced_positions": sliced})

    def _sequence_axes(self, model: onnx.ModelProto, values: list[str]) -> dict[str, int | None]:
        """Per value, the one axis with the mask's sequence length (ONNX shape inference), None when not exactly one."""
        if not values:
            return {}
        inferred = onnx.shape_inference.infer_shapes(model)
        seq = next(i.type.tensor_type.shape.dim[1] for i in model.graph.input if i.name == self.mask_input)
        out: dict[str, int | None] = {v: None for v in values}
        for vi in inferred.graph.value_info:
            if vi.name in out and seq.dim_param:
                hits = [k for k, d in enumerate(vi.type.tensor_type.shape.dim) if d.dim_param == seq.dim_param]
                out[vi.name] = hits[0] if len(hits) == 1 else None
        return out
