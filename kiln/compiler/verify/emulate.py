"""Run a reduced-precision (FP16/BF16) graph's numerics where ONNX Runtime's CPU provider has no kernels for it.

ONNX Runtime 1.32's CPU provider runs the FP16 TensorRT graphs kiln emits (Add, MatMul, Attention, ... have FP16
kernels) but has no BF16 kernel for most of them (``Add`` is the first it meets). For those graphs verification runs
an emulation instead: an FP32 copy of the graph in which every value the reduced graph stores in FP16/BF16 is rounded
to that type (``Cast`` to it and back) right where it is produced, and every reduced constant is widened exactly.
Each op then computes in FP32 and stores in the reduced type, which is what TensorRT's reduced-precision kernels do
(FP32 accumulation, reduced-precision storage); fused kernels that keep an intermediate in registers round less
often, so the emulation is the pessimistic side of the engine.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.pin_norms import value_types

REDUCED = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _round(array: np.ndarray, dtype: int) -> np.ndarray:
    """``array`` rounded to ``dtype`` (saturating at its largest finite value, as ONNX's Cast to float8 does) and
    widened back to FP32."""
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    top = float(ml_dtypes.finfo(np_type).max)
    return np.clip(array.astype(np.float32), -top, top).astype(np_type).astype(np.float32)


def reduced_types(model: onnx.ModelProto) -> set[int]:
    """The reduced float types the graph's values or constants hold (empty for an FP32 graph)."""
    return {t for t in value_types(model).values() if t in REDUCED}


def emulate(model: onnx.ModelProto, store_as: int | None = None) -> onnx.ModelProto:
    """An FP32 copy of ``model`` that rounds every reduced-precision value to its type where it is produced.
    ``store_as`` (a TensorProto float type) rounds them to that type instead, constants included: what the same graph
    would compute stored one precision lower (the tolerance tests' planted bug)."""
    types = value_types(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for t in g.initializer:
        if t.data_type in REDUCED:
            wide = numpy_helper.to_array(t).astype(np.float32)
            if store_as is not None:
                wide = _round(wide, store_as)
            t.CopyFrom(numpy_helper.from_array(wide, t.name))
    taken = {v for n in g.node for v in list(n.input) + list(n.output)} | {t.name for t in g.initializer}
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        if node.op_type == "Constant" and node.attribute[0].t.data_type in REDUCED:
            a = node.attribute[0]
            a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
            nodes.append(node)
            continue
        if node.op_type == "Cast":
            for a in node.attribute:
                if a.name == "to" and a.i in REDUCED:
                    a.i = TensorProto.FLOAT
        rounding = []
        for i, v in enumerate(node.output):
            if v and types.get(v) in REDUCED:
                raw, stored = f"{v}__wide", f"{v}__stored"
                assert raw not in taken and stored not in taken, f"emulate: {raw} is already a value name"
                node.output[i] = raw
                rounding += [helper.make_node("Cast", [raw], [stored], to=store_as or types[v], name=f"{v}__round"),
                             helper.make_node("Cast", [stored], [v], to=TensorProto.FLOAT, name=f"{v}__widen")]
        nodes += [node, *rounding]
    # inputs and outputs declared in a reduced type (an FP16 KV cache) keep it: widened on the way in, narrowed
    # (exactly: the value is already rounded) on the way out
    entry = []
    for vi in g.input:
        t = vi.type.tensor_type.elem_type
        if t in REDUCED:
            wide = f"{vi.name}__wide_in"
            entry.append(helper.make_node("Cast", [vi.name], [wide], to=TensorProto.FLOAT, name=f"{vi.name}__widen_in"))
            for node in nodes:
                for i, v in enumerate(node.input):
                    if v == vi.name:
                        node.input[i] = wide
    exits = []
    for vi in g.output:
        t = vi.type.tensor_type.elem_type
        if t in REDUCED:
            inner = f"{vi.name}__emulated"
            for node in nodes:
                for i, v in enumerate(node.output):
                    if v == vi.name:
                        node.output[i] = inner
                for i, v in enumerate(node.input):
                    if v == vi.name:
                        node.input[i] = inner
            exits.append(helper.make_node("Cast", [inner], [vi.name], to=t, name=f"{vi.name}__narrow_out"))
    del g.node[:]
    g.node.extend(entry + nodes + exits)
    del g.value_info[:]
    return out
