"""A gate, not a rewrite: fail the compile when the TensorRT-flavoured graph holds anything
TensorRT's ONNX parser would reject, instead of letting the engine build fail on the user's GPU.

Checks: every node is in the standard ONNX domain and is an op the parser handles (the table
below, with the TensorRT release that first parses it); ``Attention`` has a single output (no
KV-cache outputs); Quantize/DequantizeLinear zero points are all 0 (TensorRT is symmetric only).
"""

from __future__ import annotations

import onnx

from kiln.errors import KilnError
from kiln.passes.base import Pass, PassResult
from kiln.passes.graph import Graph

# ONNX ops TensorRT 10.x parses (onnx-tensorrt's operator matrix), with the first release that
# does where it is newer than 10.0. Ops kiln never emits are left out rather than guessed.
_SINCE: dict[str, tuple[int, int]] = {
    **{op: (10, 0) for op in (
        "Abs", "Add", "And", "ArgMax", "ArgMin", "Cast", "CastLike", "Ceil", "Clip", "Concat", "Constant",
        "ConstantOfShape", "Cos", "CumSum", "DequantizeLinear", "Div", "Einsum", "Equal", "Erf", "Exp", "Expand",
        "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm", "Greater", "GreaterOrEqual",
        "Identity", "If", "IsNaN", "LayerNormalization", "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max",
        "Mean", "Min", "Mod", "Mul", "Neg", "NonZero", "Not", "Or", "Pad", "Pow", "QuantizeLinear", "Range",
        "Reciprocal", "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
        "ReduceSum", "ReduceSumSquare", "Relu", "Reshape", "Round", "ScatterElements", "ScatterND", "Shape",
        "Sigmoid", "Sign", "Sin", "Size", "Slice", "Softmax", "Softplus", "Split", "Sqrt", "Squeeze", "Sub",
        "Sum", "Tanh", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where", "Xor")},
    "Attention": (10, 14),
    "RMSNormalization": (10, 15),
    "RotaryEmbedding": (10, 15),
}


class TensorRTCompatibilityError(KilnError):
    """The graph would not parse in TensorRT."""


def problems(model: onnx.ModelProto) -> list[str]:
    g = Graph(model)
    found = []
    for node in g.g.node:
        where = node.name or node.output[0]
        if node.domain not in ("", "ai.onnx"):
            found.append(f"{where}: {node.domain}.{node.op_type} is not a standard ONNX op")
        elif node.op_type not in _SINCE:
            found.append(f"{where}: {node.op_type} is not parsed by TensorRT")
        elif node.op_type == "Attention" and any(node.output[1:]):
            found.append(f"{where}: Attention with KV-cache outputs")
        elif node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2]:
            zp = g.constant(node.input[2])
            if zp is None or zp.any():
                found.append(f"{where}: {node.op_type} has a non-zero zero point (TensorRT is symmetric only)")
    return found


def min_tensorrt(model: onnx.ModelProto) -> str:
    """The oldest TensorRT release whose parser takes every op in the graph."""
    need = max((_SINCE.get(n.op_type, (10, 0)) for n in model.graph.node), default=(10, 0))
    return f"{need[0]}.{need[1]}"


class CheckTensorRTOps(Pass):
    name = "check-tensorrt-ops"

    def run(self, model: onnx.ModelProto) -> PassResult:
        found = problems(model)
        if found:
            more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
            raise TensorRTCompatibilityError(
                f"the TensorRT graph has {len(found)} node(s) TensorRT cannot parse: {'; '.join(found[:3])}{more}; "
                "disable the pass that introduced them or compile for --target cpu"
            )
        return PassResult(model, False, {"checked": len(model.graph.node)}, [])


