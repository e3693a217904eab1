"""Keep normalisation, softmax and reductions in FP32 inside a reduced-precision graph: Cast in, compute in FP32,
Cast out.

TensorRT 11 builds strongly typed networks only: a layer computes in the type its ONNX inputs have. In FP16 or BF16

- LayerNormalization / RMSNormalization and Softmax lose accuracy (the variance of large activations overflows or
  rounds badly; an FP16 softmax sums thousands of small terms), so they are wrapped: inputs cast to FP32, the op in
  FP32, the output cast back;
- a reduction (ReduceMean, ReduceSum, ...) and Pow (a decomposed norm's x**2: a small LLM's residual stream can
  peak above 25,000, whose square overflows FP16's 65,504) compute in FP32 and their result *stays* FP32 through the elementwise
  ops that only read FP32 statistics and constants (``+ eps``, Sqrt, Reciprocal): the statistic meets the activation
  again, cast down, where it is already normalised;
- an ONNX ``Attention`` gets ``softmax_precision`` = FLOAT (its softmax in FP32, Q/K/V left reduced).

On an FP32 graph there is nothing to pin and the pass says so.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph, attr

_NORMS = ("LayerNormalization", "RMSNormalization")
_SOFTMAX = ("Softmax", "LogSoftmax")
_STATISTICS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "ReduceProd", "Pow")
_FOLLOWERS = ("Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Neg")
"""Elementwise ops that keep a statistic in FP32 while every non-constant input they read is an FP32 statistic."""
_REDUCED = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named value, from the graph and ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model) if model.ByteSize() < (2 << 30) - (1 << 20) else model
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for node in g.node:  # Constant nodes: their value's type
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


class PinNormsFP32(Pass):
    name = "pin-norms-fp32"

    def run(self, model: onnx.ModelProto) -> PassResult:
        types = value_types(model)
        g = Graph(model)
        stats = {"pinned": 0, "already_fp32": 0, "softmax": 0, "statistics": 0, "attention_softmax": 0}
        skipped: list[Reason] = []
        plan: dict[int, str] = {}  # node index -> how it is pinned: "wrap" | "statistic"
        fp32_ok: set[str] = set()  # values that will have an FP32 copy (statistics and their followers)
        attention: list[int] = []
        for idx, node in enumerate(g.g.node):
            dtype = types.get(node.input[0]) if node.input else None
            if node.op_type in _NORMS + _SOFTMAX:
                if dtype == TensorProto.FLOAT:
                    stats["already_fp32"] += 1
                elif dtype in _REDUCED:
                    plan[idx] = "wrap"
                else:
                    skipped.append(Reason(node.name or node.output[0], f"input type {dtype} is unknown or not FP16/BF16"))
            elif node.op_type in _STATISTICS and dtype in _REDUCED:
                plan[idx] = "statistic"
            elif node.op_type in _FOLLOWERS:
                dynamic = [v for v in node.input if v and not g.is_constant(v)]
                if dynamic and all(v in fp32_ok for v in dynamic) and types.get(node.output[0]) in _REDUCED:
                    plan[idx] = "statistic"
            elif node.op_type == "Attention" and dtype in _REDUCED and attr(node, "softmax_precision") != TensorProto.FLOAT:
                attention.append(idx)
            if plan.get(idx) == "statistic":
                fp32_ok.update(o for o in node.output if o)
        if stats["already_fp32"]:
            skipped.append(Reason("*", f"{stats['already_fp32']} norm(s) or softmax(es) already compute in float32"))
        if not plan and not attention:
            return PassResult(g.model, False, stats, skipped)

        fp32_of: dict[str, str] = {}
        new_nodes: list[onnx.NodeProto] = []
        for idx, node in enumerate(g.g.node):
            how = plan.get(idx)
            if idx in attention:
                node.attribute.append(helper.make_attribute("softmax_precision", TensorProto.FLOAT))
                stats["attention_softmax"] += 1
            if how is None:
                new_nodes.append(node)
                continue
            dtype = next(types[o] for o in node.output if o in types)
            if node.op_type in _NORMS:
                stats["pinned"] += 1
            elif node.op_type in _SOFTMAX:
                stats["softmax"] += 1
            else:
                stats["statistics"] += 1
            new_nodes += self._pin(g, node, dtype, types, fp32_of, keep_fp32=how == "statistic")
        del g.g.node[:]
        g.g.node.extend(new_nodes)
        g.reindex()
        return PassResult(g.model, True, stats, skipped)

    def _pin(self, g: Graph, node: onnx.NodeProto, dtype: int, types: dict[str, int], fp32_of: dict[str, str],
             keep_fp32: bool) -> list[onnx.NodeProto]:
        new, inputs, after = [], [], []
        for name in node.input:
            if not name or types.get(name) not in _FLOATS:
                inputs.append(name)
            elif name in fp32_of:
                inputs.append(fp32_of[name])
            elif (c := g.constant(name)) is not None:  # scale / bias / exponent / eps: an FP32 copy
                inputs.append(g.add_initializer(f"{name}_fp32", c.astype(np.float32)))
            elif types.get(name) == TensorProto.FLOAT:
                inputs.append(name)
            else:
                cast = g.fresh(f"{name}_fp32")
                new.append(helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT, name=g.fresh("PinIn")))
                inputs.append(cast)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in _NORMS:
            attrs["stash_type"] = 1
        outputs = []
        for out in node.output:
            if not out or types.get(out) not in _REDUCED:
                outputs.append(out)
                continue
            out32 = g.fresh(f"{out}_fp32")
            outputs.append(out32)
            if keep_fp32:
                fp32_of[out] = out32
            after.append(helper.make_node("Cast", [out32], [out], to=dtype, name=g.fresh("PinOut")))
        new.append(helper.make_node(node.op_type, inputs, outputs, name=node.name, domain=node.domain, **attrs))
        return new + after
