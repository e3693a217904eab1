"""The standard ``RotaryEmbedding`` op (opset 23) with its cos/sin tables at the batch size of its input.

The exporter's rewriter fuses a model's rotary arithmetic into ``RotaryEmbedding``; a model that computes its
tables once for the whole batch (shape (1, S, D/2), broadcast in PyTorch) then feeds the op tables of batch 1, which
ONNX Runtime refuses for a batch of more than one ("cos_cache and sin_cache are expected to have the same shape as
input x"). Each such table gets an Expand to the input's batch (a no-op when it already has it). Tables whose batch
is provably the input's, and ops that take position ids (tables indexed by position), are left as they are.
"""

from __future__ import annotations

import onnx

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Constants, Graph, emit


def _dims(inferred: onnx.ModelProto) -> dict[str, list]:
    out = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        if v.type.tensor_type.HasField("shape"):
            out[v.name] = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                           for d in v.type.tensor_type.shape.dim]
    return out


class BroadcastRotary(Pass):
    name = "broadcast-rotary"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        ropes = [n for n in g.g.node if n.op_type == "RotaryEmbedding" and n.domain in ("", "ai.onnx")
                 and not (len(n.input) > 3 and n.input[3])]
        if not ropes:
            return PassResult(g.model, False, {"expanded": 0})
        dims = _dims(onnx.shape_inference.infer_shapes(model))
        todo, kept = [], []
        for n in ropes:
            x, tables = dims.get(n.input[0]), [dims.get(t) for t in n.input[1:3]]
            if x and all(t and len(t) == 3 and t[0] == x[0] and x[0] is not None for t in tables):
                kept.append(Reason(n.name or n.output[0], "its tables have the input's batch"))
            else:
                todo.append(n)
        consts, new, made = Constants(g), [], {}
        for n in todo:
            batch = emit(g, new, "Shape", [n.input[0]], "rope_batch", start=0, end=1)
            shape = emit(g, new, "Concat", [batch, consts.int64("ones2", [1, 1])], "rope_table_shape", axis=0)
            for i in (1, 2):
                key = (n.input[i], n.input[0])
                if key not in made:
                    made[key] = emit(g, new, "Expand", [n.input[i], shape], "rope_table")
                n.input[i] = made[key]
        g.g.node.extend(new)
        g.toposort()
        g.reindex()
        return PassResult(g.model, bool(todo), {"expanded": len(todo)}, kept)
