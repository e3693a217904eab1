"""Every captured attention node a fused kernel did not take -> standard ONNX: the ``Attention`` op (opset 23) where
it computes the same thing, else MatMul / Softmax / MatMul.

This is the fallback that makes any model transformers runs compile: whatever the node carries (a mask of any form,
a position bias, a soft-cap, value heads wider than key heads), one of the two forms computes it exactly.
- ``Attention`` (opset 23): Q, K, V as captured (the op shares KV heads across query heads itself), the scale, the
  soft-cap (applied before the mask, as transformers does), the mask as its ``attn_mask`` (boolean, or additive
  float), a position bias added to it, ``is_causal`` when the model gave no mask. Its output (B, H, S, Dv) is
  transposed to the node's (B, S, H, Dv).
- plain ops when the node has attention sinks (an extra softmax column per head, which ``Attention`` lacks) or the
  graph's opset predates 23: scores = Q Kᵀ x scale [soft-cap] [+ bias] [mask], softmax (with the sink column, dropped
  after it), times V; KV heads repeated to the query heads by Expand.

A decoder lowered here gets its KV cache from ``kv-cache-concat`` (the cache as Concats of past and new keys).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes import attention_node as an
from kiln.passes.base import Pass, PassResult
from kiln.passes.graph import Constants, Graph, emit
from kiln.passes.pin_norms import value_types

NEG = float(np.finfo(np.float32).min)


class LowerAttention(Pass):
    name = "lower-attention"

    def __init__(self, standard_op: bool = True) -> None:
        self.standard_op = standard_op
        """False: plain ops even where the ``Attention`` op would do (a runtime without it)."""

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        nodes = [an.read(n) for n in g.g.node if an.is_captured(n)]
        stats = {"lowered": 0, "onnx_attention": 0, "plain": 0}
        if not nodes:
            return PassResult(g.model, False, stats)
        types = value_types(model)
        opset = next((o.version for o in g.model.opset_import if o.domain in ("", "ai.onnx")), 0)
        consts, biases = Constants(g), {}
        for c in nodes:
            new: list[onnx.NodeProto] = []
            if c.sinks is None and opset >= 23 and self.standard_op:
                self._standard(g, c, new, types, consts, biases)
                stats["onnx_attention"] += 1
            else:
                self._plain(g, c, new, types, consts, biases)
                stats["plain"] += 1
            g.replace_nodes([c.node], new)
            stats["lowered"] += 1
        g.prune()
        return PassResult(g.model, True, stats)

    @staticmethod
    def _additive(g: Graph, c: an.Captured, new: list, types: dict[str, int], consts: Constants,
                  biases: dict[str, str]) -> str:
        """The node's mask as an additive float bias (0 / float32 min), built once per mask."""
        assert c.mask is not None
        if c.mask not in biases:
            biases[c.mask] = c.mask if types.get(c.mask) != TensorProto.BOOL else \
                emit(g, new, "Where", [c.mask, consts.float32("zero", 0.0), consts.float32("neg", NEG)], "mask_bias")
        return biases[c.mask]

    def _standard(self, g: Graph, c: an.Captured, new: list, types: dict[str, int], consts: Constants,
                  biases: dict[str, str]) -> None:
        mask = c.mask or ""
        if c.bias is not None:
            mask = c.bias if not mask else emit(g, new, "Add", [c.bias, self._additive(g, c, new, types, consts, biases)],
                                                "scores_bias")
        attrs: dict = {"scale": c.scale}
        if c.softcap:
            attrs["softcap"] = c.softcap
        if c.mask is None and c.causal:
            attrs["is_causal"] = 1
        y = emit(g, new, "Attention", [c.q, c.k, c.v] + ([mask] if mask else []), "attention_bhsd", **attrs)
        new.append(helper.make_node("Transpose", [y], [c.out], perm=[0, 2, 1, 3], name=g.fresh("AttentionMerge")))

    def _plain(self, g: Graph, c: an.Captured, new: list, types: dict[str, int], consts: Constants,
               biases: dict[str, str]) -> None:
        k, v = (self._repeat(g, x, c, new, consts) for x in (c.k, c.v))
        kt = emit(g, new, "Transpose", [k], "keys_t", perm=[0, 1, 3, 2])
        scores = emit(g, new, "Mul", [emit(g, new, "MatMul", [c.q, kt], "scores"),
                                      g.add_initializer("scale", np.array(c.scale, np.float32))], "scaled")
        if c.softcap:
            cap = g.add_initializer("softcap", np.array(c.softcap, np.float32))
            tanh = emit(g, new, "Tanh", [emit(g, new, "Div", [scores, cap], "capped")], "tanh")
            scores = emit(g, new, "Mul", [tanh, cap], "softcapped")
        if c.bias is not None:
            scores = emit(g, new, "Add", [scores, c.bias], "biased")
        if c.mask is not None:
            scores = emit(g, new, "Add", [scores, self._additive(g, c, new, types, consts, biases)], "masked")
        elif c.causal:
            scores = emit(g, new, "Add", [scores, self._causal(g, new, scores, consts, biases)], "masked")
        if c.sinks is not None:  # one more column per head: exp(sink) joins the softmax's denominator
            shape = emit(g, new, "Shape", [scores], "scores_shape", start=0, end=3)
            column_shape = emit(g, new, "Concat", [shape, consts.int64("one1", [1])], "sink_shape", axis=0)
            sinks = emit(g, new, "Reshape", [c.sinks, consts.int64("sink_view", [1, -1, 1, 1])], "sinks")
            column = emit(g, new, "Expand", [sinks, column_shape], "sink_column")
            joined = emit(g, new, "Concat", [scores, column], "with_sinks", axis=-1)
            probs = emit(g, new, "Softmax", [joined], "probs_sinks", axis=-1)
            keys = emit(g, new, "Shape", [kt], "key_count", start=3, end=4)
            probs = emit(g, new, "Slice", [probs, consts.int64("zero1", [0]), keys, consts.int64("three1", [3])],
                         "probs")
        else:
            probs = emit(g, new, "Softmax", [scores], "probs", axis=-1)
        y = emit(g, new, "MatMul", [probs, v], "attention_bhsd")
        new.append(helper.make_node("Transpose", [y], [c.out], perm=[0, 2, 1, 3], name=g.fresh("AttentionMerge")))

    @staticmethod
    def _repeat(g: Graph, x: str, c: an.Captured, new: list, consts: Constants) -> str:
        """(B, Hkv, T, D) -> (B, Hq, T, D), each KV head shared by Hq / Hkv consecutive query heads."""
        repeat = c.q_heads // c.kv_heads
        if repeat == 1:
            return x
        shape = emit(g, new, "Shape", [x], "kv_shape")
        bh = emit(g, new, "Slice", [shape, consts.int64("zero1", [0]), consts.int64("two1", [2])], "kv_bh")
        td = emit(g, new, "Slice", [shape, consts.int64("two1", [2]), consts.int64("four1", [4])], "kv_td")
        five = emit(g, new, "Concat", [bh, consts.int64(f"rep:{repeat}", [repeat]), td], "kv_five", axis=0)
        wide = emit(g, new, "Expand", [emit(g, new, "Unsqueeze", [x, consts.int64("two1", [2])], "kv_5d"), five],
                    "kv_wide")
        last = emit(g, new, "Slice", [shape, consts.int64("three1", [3]), consts.int64("four1", [4])], "kv_d")
        target = emit(g, new, "Concat", [consts.int64("zero1", [0]), consts.int64(f"hq:{c.q_heads}", [c.q_heads]),
                                         consts.int64("minus1", [-1]), last], "kv_target", axis=0)
        return emit(g, new, "Reshape", [wide, target], "kv_repeated")

    @staticmethod
    def _causal(g: Graph, new: list, scores: str, consts: Constants, biases: dict[str, str]) -> str:
        """An additive causal mask for square scores (no cache in the graph: queries and keys are the same tokens)."""
        if "causal" not in biases:
            n = emit(g, new, "Shape", [scores], "score_len", start=3, end=4)
            length = emit(g, new, "Squeeze", [n, consts.int64("zero1", [0])], "score_len0")
            steps = emit(g, new, "Range", [consts.int64("i0", 0), length, consts.int64("i1", 1)], "steps")
            rows = emit(g, new, "Unsqueeze", [steps, consts.int64("one1", [1])], "rows")
            later = emit(g, new, "Greater", [steps, rows], "later")
            biases["causal"] = emit(g, new, "Where", [later, consts.float32("neg", NEG), consts.float32("zero", 0.0)],
                                    "causal_bias")
        return biases["causal"]
