"""Store and compute a TensorRT graph in FP16 or BF16: weights and activations reduced, inputs and outputs kept in
their declared types, index-derived values (rotary angles, masks built from ids) kept in FP32.

TensorRT 11 builds strongly typed networks only (10.x with ``STRONGLY_TYPED``): every layer computes in the type its
ONNX inputs have, so the precision has to be in the graph. The pass decides one compute type per node:

- activations: anything downstream of a float weight lookup (``Gather`` from a float table) or a float graph input
  computes in the reduced type; its float constants get reduced copies (clamped into the type's finite range, so an
  FP32 ``finfo.min`` mask constant becomes the reduced type's lowest value rather than -inf);
- index-derived values: a ``Cast`` from an integer or bool to float, and everything computed from such values and
  constants alone (RoPE's ``position * inv_freq`` and its Cos/Sin), stays FP32: an angle of 500 rad in FP16 is
  rounded to 0.25 rad; such a value is cast to the reduced type where an activation node takes it;
- a float graph output is cast back to its declared type at the end.

Norms, softmax and reductions are left to ``pin-norms-fp32``, which runs next and pins them to FP32 inside the reduced
graph. Checks first, then mutates: a graph with an op whose float inputs need not share one type (Resize's scales,
Q/DQ scales) or with a subgraph is refused whole and left as it was.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.base import Pass, PassError, PassResult, Reason
from kiln.passes.graph import Graph
from kiln.passes.pin_norms import value_types

REDUCED = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
LOOKUPS = ("Gather", "GatherND", "GatherElements")
"""Ops that read a float constant with integer indices: an embedding lookup starts the activations."""
REFUSED = ("Resize", "Upsample", "QuantizeLinear", "DequantizeLinear", "If", "Loop", "Scan")
"""Float inputs of mixed types (scales) or subgraphs: the pass cannot retype them soundly."""


def to_reduced(array: np.ndarray, dtype: int) -> onnx.TensorProto:
    """A float constant in the reduced type, clamped into its finite range."""
    if dtype == TensorProto.FLOAT16:
        info = np.finfo(np.float16)
        return numpy_helper.from_array(np.clip(array, info.min, info.max).astype(np.float16))
    limit = float(np.float32(3.3895314e38))  # bfloat16's largest finite value
    clipped = np.clip(array.astype(np.float32), -limit, limit)
    bits = clipped.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    t = onnx.TensorProto()
    t.data_type = TensorProto.BFLOAT16
    t.dims.extend(array.shape)
    t.raw_data = rounded.tobytes()
    return t


class ReducePrecision(Pass):
    name = "reduce-precision"

    def __init__(self, dtype: str = "float16", retyped_io: tuple[str, ...] = ()) -> None:
        """``retyped_io``: name prefixes of graph inputs and outputs declared in the reduced type instead of cast at
        the boundary (a decoder's KV cache: it stays FP16 between steps, half the bytes every step reads)."""
        if dtype not in REDUCED:
            raise ValueError(f"reduce-precision: dtype {dtype!r} is not one of {sorted(REDUCED)}")
        self.dtype = dtype
        self.elem = REDUCED[dtype]
        self.retyped_io = retyped_io

    def _retyped(self, name: str) -> bool:
        return any(name.startswith(prefix) for prefix in self.retyped_io)

    def run(self, model: onnx.ModelProto) -> PassResult:
        types = value_types(model)
        g = Graph(model)
        refused = [n for n in g.g.node if n.op_type in REFUSED or n.domain not in ("", "ai.onnx")]
        if refused:
            n = refused[0]
            raise PassError(f"reduce-precision: {n.name or n.output[0]} ({n.domain or 'ai.onnx'}.{n.op_type}) cannot be "
                            f"retyped to {self.dtype}; compile with --precision fp32")
        already = [t for t, k in types.items() if k in REDUCED.values()]
        if already:
            return PassResult(model, False, {"reduced_nodes": 0, "fp32_nodes": 0},
                              [Reason("*", f"the graph already holds {self.dtype}-family values ({already[0]})")])
        is_float = lambda v: types.get(v) in FLOATS  # noqa: E731
        kind: dict[str, str] = {i.name: "act" for i in g.g.input if is_float(i.name)}
        compute: dict[int, str] = {}
        for idx, node in enumerate(g.g.node):
            dynamic = [v for v in node.input if v and is_float(v) and not g.is_constant(v)]
            if node.op_type == "Constant":
                c = "const"
            elif node.op_type == "Cast" and not is_float(node.input[0]):
                c = "aux"
            elif dynamic:
                c = "aux" if all(kind.get(v) == "aux" for v in dynamic) else "act"
            else:
                c = "act" if node.op_type in LOOKUPS and any(is_float(v) for v in node.input if v) else "aux"
            compute[idx] = c
            if c == "aux" and not any(is_float(o) for o in node.output if o):
                compute[idx] = "index"  # shapes and ids: no float in or out, nothing to retype
            for out in node.output:
                if out and is_float(out) and c in ("act", "aux"):
                    kind[out] = c

        # --- mutate ------------------------------------------------------------------------------------------
        reduced_const: dict[str, str] = {}
        down: dict[str, str] = {}
        new_nodes: list[onnx.NodeProto] = []
        entry = {}
        retyped = 0
        for inp in g.g.input:
            if is_float(inp.name) and self._retyped(inp.name):
                inp.type.tensor_type.elem_type = self.elem
                retyped += 1
            elif is_float(inp.name):
                entry[inp.name] = g.fresh(f"{inp.name}_{self.dtype}")
                new_nodes.append(helper.make_node("Cast", [inp.name], [entry[inp.name]], to=self.elem,
                                                  name=g.fresh("ReduceIn")))
        renamed_out: dict[str, str] = {}
        for o in g.g.output:
            if kind.get(o.name) == "act" and self._retyped(o.name):
                o.type.tensor_type.elem_type = self.elem
                retyped += 1
            elif kind.get(o.name) == "act":
                renamed_out[o.name] = g.fresh(f"{o.name}_{self.dtype}")
        counts = {"act": 0, "aux": 0}
        for idx, node in enumerate(g.g.node):
            c = compute[idx]
            if c in ("const", "index"):
                new_nodes.append(node)
                continue
            counts[c] += any(is_float(o) for o in node.output if o)
            if c == "act":
                for i, v in enumerate(node.input):
                    if not v or not is_float(v):
                        continue
                    if v in entry:
                        node.input[i] = entry[v]
                    elif g.constant(v) is not None:
                        if v not in reduced_const:
                            t = to_reduced(g.constant(v), self.elem)
                            t.name = g.fresh(f"{v}_{self.dtype}")
                            g.g.initializer.append(t)
                            reduced_const[v] = t.name
                        node.input[i] = reduced_const[v]
                    elif kind.get(v) == "aux":
                        if v not in down:
                            down[v] = g.fresh(f"{v}_{self.dtype}")
                            new_nodes.append(helper.make_node("Cast", [v], [down[v]], to=self.elem,
                                                              name=g.fresh("ReduceAux")))
                        node.input[i] = down[v]
                if node.op_type == "Cast":
                    for a in node.attribute:
                        if a.name == "to" and a.i in FLOATS:
                            a.i = self.elem
            for i, out in enumerate(node.output):
                if out in renamed_out:
                    node.output[i] = renamed_out[out]
            new_nodes.append(node)
        for name, inner in renamed_out.items():
            declared = next(o for o in g.g.output if o.name == name).type.tensor_type.elem_type
            new_nodes.append(helper.make_node("Cast", [inner], [name], to=declared, name=g.fresh("ReduceOut")))
        # graph outputs renamed inside the graph: consumers of the old name read the reduced value
        for node in new_nodes:
            for i, v in enumerate(node.input):
                if v in renamed_out:
                    node.input[i] = renamed_out[v]
        del g.g.node[:]
        g.g.node.extend(new_nodes)
        changed = {v for v, k in kind.items() if k == "act"}
        keep = [vi for vi in g.g.value_info if vi.name not in changed]
        del g.g.value_info[:]
        g.g.value_info.extend(keep)
        g.reindex()
        g.toposort()
        g.prune()
        return PassResult(g.model, counts["act"] > 0,
                          {"reduced_nodes": counts["act"], "fp32_nodes": counts["aux"],
                           "reduced_constants": len(reduced_const), "boundary_casts": len(entry) + len(renamed_out),
                           "retyped_io": retyped},
                          [Reason("*", f"{counts['aux']} index-derived node(s) kept in float32")] if counts["aux"] else [])
