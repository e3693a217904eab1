"""Captured decoder self-attention -> ``com.microsoft.GroupQueryAttention`` (ONNX Runtime CPU/CUDA).

Every ``ai.kiln.CapturedAttention`` node of a decoder (``kiln.passes.attention_node``) becomes one kernel call
when what it computes is what the kernel computes:
- the mask is causal, with or without a sliding window, the padding of ``attention_mask`` applied or not (found by
  running the mask's subgraph, ``kiln.passes.masks``); the kernel builds it itself (its window ``i - j < W`` is
  transformers'), so the traced mask goes;
- no additive bias; the soft-cap and attention sinks are the kernel's (``softcap``, ``head_sink``);
- head sizes equal for keys and values and a multiple of 8; query heads a multiple of KV heads.

Q, K and V reach the kernel as (B, S, H x D). Where the node's input is a head split of a projection the split goes
(``kiln.passes.matching.operand``); otherwise a Transpose brings it to that layout. Two optional speed-ups:
- the rotary embedding both Q and K get is folded into the kernel (``do_rotary``, cos/sin caches computed here
  from the graph's constant ``inv_freq`` for every position up to the model's maximum; partial rotary over the first
  ``d`` features when ``d`` is a multiple of 16). A rotary that does not fold stays in the graph, which is correct
  for any rotary (scaled, YaRN, LongRoPE): the kernel then gets Q and K already rotated;
- Q, K and V from one packed projection or three projections of one input go in as one packed input.
Per-head norms between the projection and the rotary are re-applied on (B, S, H, D) views, in front of the kernel.

Left padding: the kernel numbers positions from the start of the row, while the graph numbers real tokens from 0.
Rotary scores depend only on position differences and padded keys are masked, so real tokens see the same scores.

All layers or none: a decoder's layers share one KV-cache form, so when one layer cannot be lowered, none is, and the
reasons say which (``lower-attention`` then lowers every layer to standard ops, with a Concat cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes import attention_node as an
from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Constants, Graph, emit
from kiln.passes.masks import MaskKind, classify
from kiln.passes.matching import (Operand, Packing, Rotary, flat_operand, heads_packing, operand, packing, rotary,
                                  unflatten)


@dataclass
class Match:
    node: an.Captured
    q: Operand
    k: Operand
    v: Operand
    rotary: Rotary | None
    packing: Packing | None
    mask: MaskKind
    notes: tuple[str, ...] = ()
    """Why an optional speed-up did not apply (the rotary stayed in the graph, Q/K/V stayed apart)."""


class FuseGroupQueryAttention(Pass):
    name = "fuse-gqa"

    def __init__(self, max_length: int, mask_input: str = "attention_mask", ids_input: str = "input_ids") -> None:
        self.max_length = max_length
        self.mask_input = mask_input
        self.ids_input = ids_input

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        nodes = [an.read(n) for n in g.g.node if an.is_captured(n)]
        matches, skipped, kinds = [], [], {}
        for c in nodes:
            try:
                matches.append(self.match(g, c, kinds))
            except NoMatch as e:
                skipped.append(Reason(c.where, str(e)))
        stats = {"fused": 0, "rotary": 0, "packed_qkv": 0, "layers": len(nodes)}
        if skipped or not matches:
            if matches:
                skipped.append(Reason("*", f"the other {len(matches)} layers stay unfused too: a decoder's layers share "
                                           "one KV-cache form"))
            return PassResult(g.model, False, stats, skipped)
        # --- every layer checked: from here on the graph changes
        shared: dict[str, str] = {}
        consts = Constants(g)
        notes = []
        for m in matches:
            new, remove = self.emit(g, m, shared, consts)
            g.replace_nodes(remove, new)
            stats["fused"] += 1
            stats["rotary"] += int(m.rotary is not None)
            stats["packed_qkv"] += int(m.packing is not None)
            notes += [Reason(m.node.where, n) for n in m.notes]
        g.ensure_opset(MS_DOMAIN, 1)
        g.prune()
        return PassResult(g.model, True, stats, notes)

    # --- checks ---------------------------------------------------------------------------------------------------
    def match(self, g: Graph, c: an.Captured, kinds: dict) -> Match:
        if c.bias is not None:
            raise NoMatch("the scores get an additive bias (a position bias), which GroupQueryAttention does not take")
        if c.head_size != c.v_head_size:
            raise NoMatch(f"keys have {c.head_size} features and values {c.v_head_size}; the kernel needs them equal")
        if c.head_size % 8:
            raise NoMatch(f"head size {c.head_size} is not a multiple of 8, which GroupQueryAttention requires")
        if c.q_heads % c.kv_heads:
            raise NoMatch(f"{c.q_heads} query heads do not share {c.kv_heads} KV heads evenly")
        key = (c.mask, c.causal, c.window)
        if key not in kinds:
            try:
                kinds[key] = classify(g, c.mask, c.causal, c.window, self.mask_input)
            except NoMatch as e:
                kinds[key] = e
        kind = kinds[key]
        if isinstance(kind, NoMatch):
            raise NoMatch(str(kind))
        if not kind.causal:
            raise NoMatch(f"the attention is {kind.describe()}, not causal: not decoder self-attention")
        notes = []
        q, k, v = (operand(g, x, c.node, rotary=role != "v") for x, role in ((c.q, "q"), (c.k, "k"), (c.v, "v")))
        try:
            rope = rotary(g, q.rope, k.rope, c.head_size, {self.mask_input, self.ids_input})
        except NoMatch as e:
            notes.append(f"rotary stays in the graph ({e})")
            rope = None
        if rope is None:  # the kernel gets Q and K rotated: the rotary nodes stay
            q, k = (operand(g, x, c.node, rotary=False) for x in (c.q, c.k))
        pack = None
        if all(o.layout == "flat" and not o.norms for o in (q, k, v)) and len({q.value, k.value, v.value}) == 3:
            try:
                pack = packing(g, q.value, k.value, v.value, c.q_heads, c.kv_heads, c.head_size)
            except NoMatch as e:
                notes.append(f"Q, K and V go in apart ({e})")
        elif all(o.layout == "bhsd" and not o.norms for o in (q, k, v)) and c.q_heads == c.kv_heads:
            try:
                pack = heads_packing(g, q.value, k.value, v.value, c.node, c.q_heads, c.head_size)
            except NoMatch as e:
                notes.append(f"Q, K and V go in apart ({e})")
        return Match(c, q, k, v, rope, pack, kind, tuple(notes))

    # --- rewrite --------------------------------------------------------------------------------------------------
    def emit(self, g: Graph, m: Match, shared: dict[str, str], consts: Constants) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
        c, new = m.node, []
        remove = [c.node] + m.q.nodes + m.k.nodes + m.v.nodes
        if m.packing is not None:
            qkv, old = self._emit_pack(g, new, m.packing, consts)
            remove += old
        else:
            qkv = [flat_operand(g, new, o, heads, c.head_size, consts)
                   for o, heads in ((m.q, c.q_heads), (m.k, c.kv_heads), (m.v, c.kv_heads))]
        bias = self._padding_bias(g, new, shared, consts) if m.mask.padding else ""
        seqlens, total = self._lengths(g, new, shared, consts)
        cos = sin = ""
        if m.rotary is not None:
            cos, sin = self._caches(g, m.rotary, shared)
        inputs = [*qkv, *[""] * (3 - len(qkv)), "", "", seqlens, total, cos, sin, "", bias, c.sinks or ""]
        while not inputs[-1]:
            inputs.pop()
        attrs = dict(num_heads=c.q_heads, kv_num_heads=c.kv_heads, do_rotary=int(m.rotary is not None),
                     rotary_interleaved=m.rotary.interleaved if m.rotary else 0, scale=c.scale)
        if m.mask.window:
            attrs["local_window_size"] = int(m.mask.window)
        if c.softcap:
            attrs["softcap"] = c.softcap
        out = emit(g, new, "GroupQueryAttention", inputs, "gqa_out", domain=MS_DOMAIN, **attrs)
        new += unflatten(g, out, c, consts)
        return new, list({id(n): n for n in remove}.values())

    @staticmethod
    def _emit_pack(g: Graph, new: list, p: Packing, consts: Constants) -> tuple[list[str], list[onnx.NodeProto]]:
        if p.kind in ("split", "slices"):
            return [p.source], p.nodes
        if p.kind == "heads":  # (B, S, H * 3 * D) -> (B, S, H, 3, D) -> (B, S, 3, H, D) -> (B, S, 3 * H * D)
            view = consts.int64(f"qkv_heads_view:{p.heads}:{p.head_size}", [0, 0, p.heads, 3, p.head_size])
            grouped = emit(g, new, "Transpose", [emit(g, new, "Reshape", [p.source, view], "qkv_heads")], "qkv_grouped",
                           perm=[0, 1, 3, 2, 4])
            return [emit(g, new, "Reshape", [grouped, consts.int64("head_flat", [0, 0, -1])], "qkv_packed")], p.nodes
        q, k, v = p.projections
        weight = g.add_initializer("qkv_weight", np.concatenate([q.weight, k.weight, v.weight], 1))
        out = emit(g, new, "MatMul", [q.x, weight], "qkv")
        if any(x.bias is not None for x in p.projections):
            biases = [x.bias if x.bias is not None else np.zeros(x.weight.shape[1], x.weight.dtype) for x in p.projections]
            out = emit(g, new, "Add", [out, g.add_initializer("qkv_bias", np.concatenate(biases).astype(q.weight.dtype))],
                        "qkv_biased")
        return [out], [n for x in p.projections for n in x.nodes]

    # --- shared inputs, built once per graph -------------------------------------------------
    def _padding_bias(self, g: Graph, new: list, shared: dict[str, str], consts: Constants) -> str:
        """attention_mask (B, T) -> additive bias (B, 1, S, T): 0 for real tokens, float32 min for padding."""
        if "bias" not in shared:
            inv = emit(g, new, "Sub", [consts.float32("pad_one", 1.0),
                                        emit(g, new, "Cast", [self.mask_input], "pad_f", to=TensorProto.FLOAT)], "pad_inv")
            b2 = emit(g, new, "Mul", [inv, consts.float32("pad_neg", float(np.finfo(np.float32).min))], "pad_b2")
            b4 = emit(g, new, "Unsqueeze", [b2, consts.int64("pad_axes", [1, 2])], "pad_b4")
            seq = emit(g, new, "Shape", [self.ids_input], "pad_seq", start=1, end=2)
            shape = emit(g, new, "Concat", [consts.int64("pad_ones2", [1, 1]), seq, consts.int64("one1", [1])],
                          "pad_shape", axis=0)
            shared["bias"] = emit(g, new, "Expand", [b4, shape], "pad_bias")
        return shared["bias"]

    def _lengths(self, g: Graph, new: list, shared: dict[str, str], consts: Constants) -> tuple[str, str]:
        """seqlens_k (B,): each row's index of its last 1 in the mask, and total_sequence_length T. A left-padded
        batch has T - 1 in every row (its padding is in the bias); a right-padded row (continuous batching,
        ``kiln.runtimes.scheduler``) gets its own past length, where the kernel writes its new token and from which
        it takes the row's rotary position."""
        if "total" not in shared:
            length = emit(g, new, "Shape", [self.mask_input], "len_t", start=1, end=2)
            total64 = emit(g, new, "Reshape", [length, consts.int64("len_scalar", [])], "len_total64")
            steps = emit(g, new, "Range", [consts.int64("len_zero", 0), total64, consts.int64("len_one", 1)],
                          "len_steps")
            where = emit(g, new, "Mul", [self.mask_input, steps], "len_where")
            last = emit(g, new, "ReduceMax", [where, consts.int64("len_axes", [1])], "len_last", keepdims=0)
            shared["seqlens"] = emit(g, new, "Cast", [last], "seqlens_k", to=TensorProto.INT32)
            shared["total"] = emit(g, new, "Cast", [total64], "total_len", to=TensorProto.INT32)
        return shared["seqlens"], shared["total"]

    def _caches(self, g: Graph, r: Rotary, shared: dict[str, str]) -> tuple[str, str]:
        key = f"rope:{r.inv_freq.tobytes().hex()}:{r.scale}"
        if f"{key}:cos" not in shared:
            angles = np.arange(self.max_length, dtype=np.float64)[:, None] * r.inv_freq[None, :]  # (max_len, d/2)
            shared[f"{key}:cos"] = g.add_initializer("cos_cache", (np.cos(angles) * r.scale).astype(np.float32))
            shared[f"{key}:sin"] = g.add_initializer("sin_cache", (np.sin(angles) * r.scale).astype(np.float32))
        return shared[f"{key}:cos"], shared[f"{key}:sin"]
