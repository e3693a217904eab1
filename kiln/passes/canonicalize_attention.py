"""Attention in the form TensorRT fuses best: the standard ONNX ``Attention`` op (opset 23) with the
softmax scale applied to Q before the first MatMul (``scale=1``), and K/V at their own head count.

Why: TensorRT parses ``Attention`` from 10.14 and builds its fused MHA kernel from it; scaling Q
first keeps FP16 scores in range (the product Q·Kᵀ of unscaled FP16 inputs can overflow), and
Attention-23 shares KV heads across query heads itself, so ``repeat_kv`` copies are dropped.
Rules, each with a reason when it does not apply:
- the exporter's ``Attention`` op: scale moved onto Q, ``repeat_kv`` (Unsqueeze/Expand/Reshape) removed;
- the explicit chain MatMul(Q, Kᵀ) -> scale -> [mask Add] -> Softmax -> MatMul(V): rewritten to
  ``Attention`` with K taken before its (0,2,3,1) transpose and the additive mask as ``attn_mask``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.fuse_attention import (
    NoMatch,
    attention_candidates,
    match_explicit_chain,
    match_onnx_attention,
    transpose_perm,
)
from kiln.passes.graph import Graph


class CanonicalizeAttention(Pass):
    name = "canonicalize-attention"

    def __init__(self, head_size: int) -> None:
        self.head_size = head_size

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"canonical": 0, "scaled": 0, "repeat_kv_removed": 0, "from_chain": 0}
        skipped = []
        for handle in attention_candidates(g):
            node = g.node(handle)
            if node is None:
                continue
            where = node.name or handle
            try:
                if node.op_type == "Attention":
                    self._standard(g, node, stats)
                else:
                    self._chain(g, node, stats)
            except NoMatch as e:
                skipped.append(Reason(where, str(e)))
                continue
            stats["canonical"] += 1
        modified = any(stats[k] for k in ("scaled", "repeat_kv_removed", "from_chain"))
        if modified:
            g.prune()
        return PassResult(g.model, modified, stats, skipped)

    def _scale_q(self, g: Graph, q: str, scale: float) -> tuple[str, list[onnx.NodeProto]]:
        c = g.add_initializer("q_scale", np.array(scale, dtype=np.float32))
        out = g.fresh(f"{q}_scaled")
        return out, [helper.make_node("Mul", [q, c], [out], name=g.fresh("ScaleQ"))]

    def _drop_repeat_kv(self, g: Graph, value: str) -> tuple[str, list[onnx.NodeProto]]:
        rs = g.producer.get(value)
        ex = g.parent(rs, 0, "Expand") if rs is not None and rs.op_type == "Reshape" else None
        un = g.parent(ex, 0, "Unsqueeze") if ex is not None else None
        if un is None or any(len(g.consumers[n.output[0]]) != 1 for n in (un, ex)):
            return value, []
        return un.input[0], [un, ex, rs] if len(g.consumers[rs.output[0]]) == 1 else []

    def _standard(self, g: Graph, node: onnx.NodeProto, stats: dict[str, int]) -> None:
        core = match_onnx_attention(g, node)
        scale = core.scale if core.scale is not None else self.head_size ** -0.5
        new_inputs = list(node.input)
        add: list[onnx.NodeProto] = []
        remove: list[onnx.NodeProto] = []
        if scale != 1.0:
            new_inputs[0], nodes = self._scale_q(g, core.q, scale)
            add += nodes
            stats["scaled"] += 1
        for i in (1, 2):
            src, chain = self._drop_repeat_kv(g, new_inputs[i])
            if chain:
                new_inputs[i] = src
                remove += chain
                stats["repeat_kv_removed"] += 1
        if not add and not remove:
            return  # already canonical
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "scale"}
        new = helper.make_node("Attention", new_inputs, list(node.output), name=node.name, scale=1.0, **attrs)
        g.replace_nodes([node] + remove, add + [new])

    def _chain(self, g: Graph, sm: onnx.NodeProto, stats: dict[str, int]) -> None:
        core = match_explicit_chain(g, sm)
        k_tr = g.producer.get(core.k)
        if transpose_perm(k_tr) != [0, 2, 3, 1] or len(g.consumers[k_tr.output[0]]) != 1:
            raise NoMatch("K is not a (0,2,3,1) head-split transpose used only here")
        k = g.fresh(f"{core.k}_bhsd")
        add = [helper.make_node("Transpose", [k_tr.input[0]], [k], name=g.fresh("KHeads"), perm=[0, 2, 1, 3])]
        q = core.q
        if core.scale not in (None, 1.0):
            q, nodes = self._scale_q(g, core.q, core.scale)
            add += nodes
            stats["scaled"] += 1
        inputs = [q, k, core.v]
        if core.mask is not None:  # (B, 1, 1, S) padding biases broadcast in an Add, but attn_mask needs the query axis
            c = {n: g.add_initializer(n, np.array(v, np.int64)) for n, v in (("mask_ones2", [1, 1]), ("mask_one1", [1]))}
            t = {n: g.fresh(f"mask_{n}") for n in ("seq", "shape", "full")}
            add += [helper.make_node("Shape", [core.q], [t["seq"]], start=2, end=3, name=g.fresh("QLen")),
                    helper.make_node("Concat", [c["mask_ones2"], t["seq"], c["mask_one1"]], [t["shape"]], axis=0,
                                     name=g.fresh("MaskShape")),
                    helper.make_node("Expand", [core.mask, t["shape"]], [t["full"]], name=g.fresh("MaskExpand"))]
            inputs.append(t["full"])
        add.append(helper.make_node("Attention", inputs, [core.out], name=g.fresh("Attention"), scale=1.0))
        g.replace_nodes(core.nodes + [k_tr], add)
        stats["from_chain"] += 1
