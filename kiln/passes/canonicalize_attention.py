"""Attention in the form TensorRT fuses best: the standard ONNX ``Attention`` op (opset 23) with the
softmax scale applied to Q before the first MatMul (``scale=1``), and K/V at their own head count.

Why: TensorRT parses ``Attention`` from 10.14 and builds its fused MHA kernel from it; scaling Q
first keeps FP16 scores in range (the product Q·Kᵀ of unscaled FP16 inputs can overflow), and
Attention-23 shares KV heads across query heads itself, so ``repeat_kv`` copies are dropped.
It runs after ``lower-attention``, which turns every captured attention node into that op (K and V at their own
head count already): the scale moves onto Q; a ``repeat_kv`` (Unsqueeze/Expand/Reshape) in front of K or V, which a
model that calls ``scaled_dot_product_attention`` itself may trace, is removed.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import Graph, attr


class CanonicalizeAttention(Pass):
    name = "canonicalize-attention"

    def __init__(self, head_size: int) -> None:
        self.head_size = head_size

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"canonical": 0, "scaled": 0, "repeat_kv_removed": 0}
        skipped = []
        for handle in g.nodes_of("Attention"):
            node = g.node(handle)
            try:
                self._standard(g, node, stats)
            except NoMatch as e:
                skipped.append(Reason(node.name or handle, str(e)))
                continue
            stats["canonical"] += 1
        modified = any(stats[k] for k in ("scaled", "repeat_kv_removed"))
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
        if attr(node, "softcap", 0.0):
            raise NoMatch("a soft-cap applies to unscaled scores; the scale stays in the op")
        if len(node.output) > 1 and any(node.output[1:]):
            raise NoMatch("Attention returns present/qk outputs; its cache is already in the op")
        scale = attr(node, "scale", None)
        scale = scale if scale is not None else self.head_size ** -0.5
        new_inputs = list(node.input)
        add: list[onnx.NodeProto] = []
        remove: list[onnx.NodeProto] = []
        if scale != 1.0:
            new_inputs[0], nodes = self._scale_q(g, node.input[0], scale)
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
