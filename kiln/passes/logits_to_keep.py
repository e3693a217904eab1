"""Decoders: an optional ``logits_to_keep`` input (int64 scalar) that limits the lm_head to the last K positions.

Generation needs the last position's logits only; computing the head over the whole prompt costs a
(prompt, vocab) product and buffer (a vocabulary's worth of floats per token). The pass slices the final
hidden states before the head: ``K = 0`` (the default a runtime fills in) keeps every position, so ``run`` and
``kiln report`` see the full logits; the generation loop feeds ``K = 1`` at prefill.

Recognised: the graph output ``logits`` produced by the head (MatMul, MatMulNBits or Gemm over (batch,
sequence, hidden), or a last-axis Concat of such parts over one input), optionally followed by elementwise ops
with a constant operand over the vocabulary at most (a logits scaling, a head bias).
Anything else is refused with the reason and the graph is left as it was.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import Graph, attr

INPUT = "logits_to_keep"
_HEADS = {"MatMul", "MatMulNBits", "Gemm"}


class LogitsToKeep(Pass):
    name = "logits-to-keep"

    def __init__(self, output: str = "logits") -> None:
        self.output = output

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        if INPUT in g.graph_inputs:
            return PassResult(g.model, False, {"sliced": 0}, [Reason(INPUT, "the graph already takes it")])
        try:
            heads = self._head(g)
        except NoMatch as e:
            return PassResult(g.model, False, {"sliced": 0}, [Reason(self.output, str(e))])
        hidden = heads[0].input[0]
        c = {k: g.add_initializer(k, v) for k, v in (("keep_shape", np.array([1], np.int64)),
                                                      ("keep_zero", np.array([0], np.int64)),
                                                      ("keep_end", np.array([np.iinfo(np.int64).max], np.int64)),
                                                      ("keep_axis", np.array([1], np.int64)))}
        t = {k: g.fresh(f"keep_{k}") for k in ("k", "seq", "pos", "min", "eff", "start", "hidden")}
        new = [
            helper.make_node("Reshape", [INPUT, c["keep_shape"]], [t["k"]], name=g.fresh("KeepReshape")),
            helper.make_node("Shape", [hidden], [t["seq"]], start=1, end=2, name=g.fresh("KeepSeq")),
            helper.make_node("Greater", [t["k"], c["keep_zero"]], [t["pos"]], name=g.fresh("KeepPositive")),
            helper.make_node("Min", [t["k"], t["seq"]], [t["min"]], name=g.fresh("KeepMin")),
            helper.make_node("Where", [t["pos"], t["min"], t["seq"]], [t["eff"]], name=g.fresh("KeepCount")),
            helper.make_node("Sub", [t["seq"], t["eff"]], [t["start"]], name=g.fresh("KeepStart")),
            helper.make_node("Slice", [hidden, t["start"], c["keep_end"], c["keep_axis"]], [t["hidden"]],
                             name=g.fresh("KeepLast")),
        ]
        for head in heads:
            head.input[0] = t["hidden"]
        g.g.node.extend(new)
        g.g.input.append(helper.make_tensor_value_info(INPUT, TensorProto.INT64, []))
        g.reindex()
        g.toposort()
        g.reindex()
        return PassResult(g.model, True, {"sliced": 1})

    def _head(self, g: Graph) -> list[onnx.NodeProto]:
        """The head node (or its parts): walk back from the output through constant-operand elementwise ops (a
        scaling, a bias; checks only)."""
        if self.output not in g.graph_outputs:
            raise NoMatch(f"the graph has no {self.output} output")
        cur = g.producer.get(g.before_scaling(self.output))
        parts = [cur]
        if cur is not None and cur.op_type == "Concat" and attr(cur, "axis", 0) in (-1, 2):
            # a head lowered in parts (quantize-nbits' PART_BYTES): every part reads the same hidden states
            parts = [g.producer.get(i) for i in cur.input]
            if any(p is None or p.op_type not in _HEADS for p in parts) or len({p.input[0] for p in parts}) != 1:
                raise NoMatch(f"{self.output} is a Concat of something other than head parts over one input")
        for head in parts:
            if head is None or head.op_type not in _HEADS:
                raise NoMatch(f"{self.output} is not produced by a MatMul/MatMulNBits/Gemm head")
            if head.op_type == "Gemm":
                raise NoMatch("the head is a 2-D Gemm (flattened positions): slicing the sequence axis needs (B, S, H)")
            if g.ancestors_inputs(head.input[1]):  # a constant, or computed from constants only (a tied head's Transpose)
                raise NoMatch("the head's weight depends on the graph's inputs")
        # the head keeps its input's rank and the ops after it are elementwise: a rank-3 output means the head
        # reads (batch, sequence, hidden), so axis 1 is the sequence
        out = next(o for o in g.g.output if o.name == self.output)
        if len(out.type.tensor_type.shape.dim) != 3:
            raise NoMatch(f"{self.output} is not declared (batch, sequence, vocab)")
        return parts
