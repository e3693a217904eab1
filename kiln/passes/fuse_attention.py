"""Captured encoder attention -> ONNX Runtime's fused kernels (CPU/CUDA).

Each ``ai.kiln.CapturedAttention`` node of an encoder (``kiln.passes.attention_node``) becomes, best first:
- ``com.microsoft.Attention`` with packed QKV weights and a 2-D key padding mask: Q, K and V are head splits of
  MatMul (+ bias) projections of one input, with equal shapes; the mask is padding only (found by running its
  subgraph, ``kiln.passes.masks``); no soft-cap, sinks or position bias. INT8 then turns it into ``QAttention``
  (its packed QKV GEMM in INT8), as ONNX Runtime's quantizer does;
- ``com.microsoft.MultiHeadAttention`` for any other self-attention with as many KV heads as query heads and no
  soft-cap or sinks: Q, K and V as (B, S, H x D) (rotary already applied by the model's own ops, so rotary encoders
  need no rule), and the model's mask, whatever it is (a sliding window, a causal mask), plus a position bias, as its
  additive ``attention_bias``.
What neither takes stays for ``lower-attention`` (standard ops), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from kiln.passes import attention_node as an
from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Constants, Graph, emit
from kiln.passes.masks import MaskKind, classify
from kiln.passes.matching import Operand, Projection, additive, flat_operand, match_linear, operand, sole_users, unflatten
from kiln.passes.pin_norms import value_types



@dataclass
class Packed:
    """com.microsoft.Attention: one input, packed weights, the padding as a 2-D mask."""

    node: an.Captured
    operands: tuple[Operand, Operand, Operand]
    projections: tuple[Projection, Projection, Projection]
    padding: bool


@dataclass
class Heads:
    """com.microsoft.MultiHeadAttention: Q, K, V as they come, the mask as an additive bias."""

    node: an.Captured
    operands: tuple[Operand, Operand, Operand]


class FuseAttention(Pass):
    name = "fuse-attention"

    def __init__(self, mask_input: str = "attention_mask") -> None:
        self.mask_input = mask_input

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        types = value_types(model)
        matches, skipped, kinds = [], [], {}
        for n in [n for n in g.g.node if an.is_captured(n)]:
            c = an.read(n)
            try:
                matches.append(self.match(g, c, kinds, types))
            except NoMatch as e:
                skipped.append(Reason(c.where, str(e)))
        stats = {"fused": 0, "packed": 0, "heads": 0}
        if not matches:
            return PassResult(g.model, False, stats, skipped)
        consts, shared = Constants(g), {}
        for m in matches:
            new: list[onnx.NodeProto] = []
            remove = self._packed(g, m, new, consts, shared) if isinstance(m, Packed) else \
                self._heads(g, m, new, consts, shared, types)
            g.replace_nodes(remove, new)
            stats["fused"] += 1
            stats["packed" if isinstance(m, Packed) else "heads"] += 1
        g.ensure_opset(MS_DOMAIN, 1)
        g.prune()
        return PassResult(g.model, True, stats, skipped)

    def match(self, g: Graph, c: an.Captured, kinds: dict, types: dict[str, int]) -> Packed | Heads:
        if c.sinks is not None or c.softcap:
            raise NoMatch("attention sinks or a soft-cap: neither fused encoder kernel takes them")
        if c.q_heads != c.kv_heads or c.head_size != c.v_head_size:
            raise NoMatch(f"{c.q_heads} query / {c.kv_heads} KV heads of {c.head_size} / {c.v_head_size} features: "
                          "the fused encoder kernels take equal heads")
        if c.mask is not None and types.get(c.mask) is None:
            raise NoMatch(f"the type of mask {c.mask} is unknown, so it cannot become an additive bias")
        ops = tuple(operand(g, x, c.node, rotary=False) for x in (c.q, c.k, c.v))
        try:
            return self._match_packed(g, c, ops, kinds)
        except NoMatch:
            if c.mask is None and c.causal:
                raise NoMatch("causal attention without a mask: left to the standard op") from None
            return Heads(c, ops)  # type: ignore[arg-type]

    def _match_packed(self, g: Graph, c: an.Captured, ops: tuple[Operand, ...], kinds: dict) -> Packed:
        if c.bias is not None:
            raise NoMatch("a position bias")
        if not all(o.layout == "flat" and not o.norms for o in ops) or len({o.value for o in ops}) != 3:
            raise NoMatch("Q, K and V are not head splits of three projections")
        projections = tuple(match_linear(g, o.value) for o in ops)
        if len({p.x for p in projections}) != 1 or len({p.weight.shape for p in projections}) != 1:
            raise NoMatch("Q, K and V do not project one input to one width")
        for p in projections:
            sole_users(g, p.nodes)
        key = (c.mask, c.causal)
        if key not in kinds:
            try:
                kinds[key] = classify(g, c.mask, c.causal, 0, self.mask_input)
            except NoMatch as e:
                kinds[key] = e
        kind = kinds[key]
        if isinstance(kind, NoMatch) or kind != MaskKind(False, None, kind.padding):
            raise NoMatch("the mask is not padding only")
        return Packed(c, ops, projections, kind.padding)  # type: ignore[arg-type]

    def _packed(self, g: Graph, m: Packed, new: list, consts: Constants, shared: dict[str, str]) -> list:
        q, k, v = m.projections
        weight = g.add_initializer("qkv_weight", np.concatenate([q.weight, k.weight, v.weight], 1))
        zeros = np.zeros(q.weight.shape[1], dtype=q.weight.dtype)
        bias = g.add_initializer("qkv_bias", np.concatenate([p.bias if p.bias is not None else zeros
                                                             for p in m.projections]).astype(q.weight.dtype))
        inputs = [q.x, weight, bias]
        if m.padding:
            if "mask_index" not in shared:
                shared["mask_index"] = emit(g, new, "Cast", [self.mask_input], "mask_index", to=TensorProto.INT32)
            inputs.append(shared["mask_index"])
        out = emit(g, new, "Attention", inputs, "attention_out", domain=MS_DOMAIN, num_heads=m.node.q_heads,
                   scale=m.node.scale)
        new += unflatten(g, out, m.node, consts)
        return [m.node.node] + [n for o in m.operands for n in o.nodes] + [n for p in m.projections for n in p.nodes]

    def _heads(self, g: Graph, m: Heads, new: list, consts: Constants, shared: dict[str, str],
               types: dict[str, int]) -> list:
        c = m.node
        flat = [flat_operand(g, new, o, c.q_heads, d, consts) for o, d in
                zip(m.operands, (c.head_size, c.head_size, c.v_head_size))]
        bias = additive(g, new, c, types, consts, shared)
        out = emit(g, new, "MultiHeadAttention", [*flat, "", "", bias] if bias else flat, "mha_out",
                   domain=MS_DOMAIN, num_heads=c.q_heads, scale=c.scale)
        new += unflatten(g, out, c, consts)
        return [c.node] + [n for o in m.operands for n in o.nodes]
