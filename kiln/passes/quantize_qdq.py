"""Static INT8 in QDQ form: QuantizeLinear/DequantizeLinear pairs around every weight MatMul.

Activations get one calibrated range each (per tensor; one Q/DQ pair shared by every MatMul that
reads the tensor, so Q, K and V projections quantize their common input once). Weights are int8,
symmetric, one scale per output column, stored quantized behind a DequantizeLinear (axis 1): as
int8 for TensorRT, as the same values in uint8 around 128 for ONNX Runtime (exact without VNNI,
``quantize_int8.unsigned_codes``).

Two flavours:
- ``symmetric=False`` (ONNX Runtime CPU): activations uint8 with a zero point, so a post-GELU or
  post-softmax range that is mostly positive keeps all 256 levels;
- ``symmetric=True`` (TensorRT): activations int8 with zero point 0, because TensorRT only takes
  symmetric quantization; the graph stays standard ONNX and also runs on ONNX Runtime.

The ranges come from calibration (``kiln.passes.calibration``), handed to the pass; a MatMul whose
input has no range is left FP32 with the reason. The numpy reference of what Q/DQ compute is here
too, so tests check the graph against it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kiln.errors import KilnError
from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph
from kiln.passes.quantize_int8 import candidates, quantize_per_column, unsigned_codes


def activation_qparams(lo: float, hi: float, symmetric: bool) -> tuple[np.float32, np.integer]:
    """(scale, zero point) for one tensor's range; the range always includes 0 so that 0 is exact."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if symmetric:
        return np.float32(max(-lo, hi) / 127.0 or 1.0), np.int8(0)
    scale = (hi - lo) / 255.0 or 1.0
    return np.float32(scale), np.uint8(np.clip(np.rint(-lo / scale), 0, 255))


def quantize_linear(x: np.ndarray, scale: np.float32, zero: np.integer) -> np.ndarray:
    """ONNX QuantizeLinear: round half to even, saturate to the zero point's type."""
    info = np.iinfo(np.asarray(zero).dtype)
    return np.clip(np.rint(x / scale) + int(zero), info.min, info.max).astype(np.asarray(zero).dtype)


def dequantize_linear(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | np.integer = 0) -> np.ndarray:
    return ((q.astype(np.int32) - np.asarray(zero).astype(np.int32)) * scale).astype(np.float32)


def calibrated_groups(g: Graph, channel_absmax: dict[str, np.ndarray], min_elements: int,
                      skipped: list[Reason]) -> list[tuple[str, list[str], np.ndarray]]:
    """(activation, the weights of the MatMuls reading it, its per-channel calibrated maximum): the unit
    SmoothQuant and split-outliers rewrite (Q/K/V share one). Activations without a usable maximum are skipped."""
    groups: dict[str, list[str]] = {}
    for weight, act in candidates(g.model, min_elements).items():
        groups.setdefault(act, []).append(weight)
    found = []
    for act, weights in groups.items():
        amax = channel_absmax.get(act)
        if amax is None or amax.shape != (g.constant(weights[0]).shape[0],):
            skipped.append(Reason(act, "no per-channel calibration maximum of the right size"))
        else:
            found.append((act, weights, amax))
    return found


class QuantizeStaticQDQ(Pass):
    name = "quantize-qdq"

    def __init__(self, ranges: dict[str, tuple[float, float]] | None = None, symmetric: bool = False,
                 keep_fp32: tuple[str, ...] = (), min_elements: int = 1024) -> None:
        self.ranges = ranges
        self.symmetric = symmetric
        self.keep_fp32 = set(keep_fp32)
        self.min_elements = min_elements

    def run(self, model: onnx.ModelProto) -> PassResult:
        if self.ranges is None:
            raise KilnError("quantize-qdq needs calibrated activation ranges; compile with --calibration FILE "
                            "(or let kiln use its default calibration text)")
        g = Graph(model)
        stats = {"quantized": 0, "activations": 0, "kept_fp32": 0}
        skipped: list[Reason] = []
        dq_of: dict[str, str] = {}  # activation -> its DequantizeLinear output
        new: list[onnx.NodeProto] = []
        for weight, act in candidates(model, self.min_elements).items():
            mm = next(n for n in g.g.node if n.op_type == "MatMul" and n.input[1] == weight)
            where = mm.name or mm.output[0]
            if weight in self.keep_fp32:
                stats["kept_fp32"] += 1
                skipped.append(Reason(where, f"weight {weight} kept in FP32 (accuracy budget)"))
                continue
            if act not in self.ranges:
                skipped.append(Reason(where, f"no calibrated range for its input {act}"))
                continue
            if act not in dq_of:
                scale, zero = activation_qparams(*self.ranges[act], self.symmetric)
                s, z = g.add_initializer(f"{act}_scale", np.asarray(scale)), g.add_initializer(f"{act}_zero", np.asarray(zero))
                q, dq_of[act] = g.fresh(f"{act}_q"), g.fresh(f"{act}_dq")
                new += [helper.make_node("QuantizeLinear", [act, s, z], [q], name=g.fresh("QuantizeLinear")),
                        helper.make_node("DequantizeLinear", [q, s, z], [dq_of[act]], name=g.fresh("DequantizeLinear"))]
                stats["activations"] += 1
            wq, wscale = quantize_per_column(g.constant(weight))
            wq, wzero = (wq, np.zeros(wq.shape[1], np.int8)) if self.symmetric else unsigned_codes(wq)
            names = [g.add_initializer(f"{weight}_{wq.dtype}", wq), g.add_initializer(f"{weight}_scale", wscale),
                     g.add_initializer(f"{weight}_zero", wzero)]
            wdq = g.fresh(f"{weight}_dq")
            new.append(helper.make_node("DequantizeLinear", names, [wdq], name=g.fresh("DequantizeLinear"), axis=1))
            mm.input[0], mm.input[1] = dq_of[act], wdq
            stats["quantized"] += 1
        if new:
            g.g.node.extend(new)
            g.toposort()
            g.reindex()
            g.prune()
        return PassResult(g.model, stats["quantized"] > 0, stats, skipped)
