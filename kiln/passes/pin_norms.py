"""Keep normalisation in FP32 inside a reduced-precision graph: Cast in, norm in FP32, Cast out.

TensorRT 11 builds strongly typed networks only: a norm computes in the type its ONNX input has.
LayerNormalization / RMSNormalization in FP16 loses accuracy (the variance of large activations
overflows or rounds badly), so the TensorRT flavour pins every norm whose input is FP16 or BF16 to
FP32 with explicit Casts. On an FP32 graph there is nothing to pin and the pass says so.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph

_NORMS = ("LayerNormalization", "RMSNormalization")
_REDUCED = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named value, from the graph and ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model) if model.ByteSize() < (2 << 30) - (1 << 20) else model
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    return types


class PinNormsFP32(Pass):
    name = "pin-norms-fp32"

    def run(self, model: onnx.ModelProto) -> PassResult:
        types = value_types(model)
        g = Graph(model)
        pinned, already = 0, 0
        skipped = []
        for op in _NORMS:
            for handle in g.nodes_of(op):
                node = g.node(handle)
                dtype = types.get(node.input[0])
                if dtype == TensorProto.FLOAT:
                    already += 1
                    continue
                if dtype not in _REDUCED:
                    skipped.append(Reason(node.name or handle, f"input type {dtype} is unknown or not FP16/BF16"))
                    continue
                g.replace_nodes([node], self._pin(g, node, dtype))
                pinned += 1
        if already:
            skipped.append(Reason("*", f"{already} norm(s) already compute in float32"))
        return PassResult(g.model, pinned > 0, {"pinned": pinned, "already_fp32": already}, skipped)

    def _pin(self, g: Graph, node: onnx.NodeProto, dtype: int) -> list[onnx.NodeProto]:
        new, inputs = [], []
        for i, name in enumerate(node.input):
            if not name:
                inputs.append(name)
                continue
            c = g.constant(name)
            if i > 0 and c is not None:  # scale / bias: an FP32 copy of the constant
                inputs.append(g.add_initializer(f"{name}_fp32", c.astype(np.float32)))
                continue
            cast = g.fresh(f"{name}_fp32")
            new.append(helper.make_node("Cast", [name], [cast], to=TensorProto.FLOAT, name=g.fresh("PinIn")))
            inputs.append(cast)
        out32 = g.fresh(f"{node.output[0]}_fp32")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs["stash_type"] = 1
        new.append(helper.make_node(node.op_type, inputs, [out32], name=node.name, **attrs))
        new.append(helper.make_node("Cast", [out32], [node.output[0]], to=dtype, name=g.fresh("PinOut")))
        return new


