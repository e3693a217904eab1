"""Dynamic INT8: MatMul with a constant weight (+ bias Add) -> ``com.microsoft.DynamicQuantizeMatMul``,
and the fused ``com.microsoft.Attention`` (packed QKV weight) -> ``DynamicQuantizeLinear`` + ``QAttention``.

Weights are int8, symmetric, one scale per output column (per-channel: a column of small weights
does not lose its resolution to the largest column of the matrix), stored as uint8 codes with zero
point 128 so that the kernel is exact on CPUs without VNNI (``unsigned_codes``); activations are quantized to
uint8 per tensor at run time by the kernel. The bias Add that follows a MatMul is folded into the
kernel. QAttention runs the packed QKV GEMM in INT8 (per-column weight scales) and the attention
core in FP32, so one quantized input feeds all three projections. MatMuls whose second input is not
a constant (attention scores) stay FP32, and so do weights named in ``keep_fp32`` (the accuracy
budget's choice) or smaller than ``min_elements``.

The math lives in small pure functions so tests can check them against numpy on random tensors.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph

MIN_INNER = 16
"""A product over fewer input channels saves nothing in INT8 (split-outliers' FP32 side products)."""
WEIGHT_ZERO = 128
"""Zero point of the stored uint8 weight codes (``unsigned_codes``): the symmetric int8 values shifted by 128."""


def quantize_per_column(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float -> int8 (K, N) and float32 scales (N,), symmetric: w ~= q * scale."""
    scale = np.abs(w).max(axis=0).astype(np.float64) / 127.0
    scale[scale == 0] = 1.0  # an all-zero column stays exactly zero
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_per_column(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale


def unsigned_codes(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (K, N) -> the same values as uint8 codes ``q + 128`` and their zero points (N,) of 128.

    ONNX Runtime's uint8 x int8 kernels on x86 CPUs without VNNI (AVX2, AVX-512 before Cascade Lake) add
    each pair of byte products in int16 with saturation (VPMADDUBSW): 255 * 127 * 2 overflows, and a
    384 x 1536 product came out wrong by up to 41.6 on an AVX2 machine. uint8 x uint8 widens to int16
    before multiplying and is exact on every CPU; the weight keeps all 255 levels (a 7-bit grid would
    also avoid the overflow, at twice the rounding error)."""
    return (q.astype(np.int16) + WEIGHT_ZERO).astype(np.uint8), np.full(q.shape[1], WEIGHT_ZERO, np.uint8)


def fake_quantize_activation(x: np.ndarray) -> np.ndarray:
    """What the kernel does to its input: uint8, per tensor, asymmetric, range including 0."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 255.0 or 1.0
    zero = np.clip(np.rint(-lo / scale), 0, 255)
    return ((np.clip(np.rint(x / scale) + zero, 0, 255) - zero) * scale).astype(np.float32)


def matmul_weight(g: Graph, node: onnx.NodeProto, min_elements: int) -> np.ndarray | None:
    """The weight of a MatMul the quantizers take (2-D FP32 constant, at least ``min_elements`` elements
    and ``MIN_INNER`` input channels, not a mixture-of-experts router: ``Graph.routes``), else None. Shared by both
    quantizers and the budget."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or g.routes(node.output[0]):
        return None
    w = g.constant(node.input[1])
    return w if quantizable_matrix(w, min_elements) else None


def quantizable_matrix(w: np.ndarray | None, min_elements: int) -> bool:
    """A (K, N) FP32 weight worth quantizing: at least ``min_elements`` elements and ``MIN_INNER`` input channels."""
    return w is not None and w.ndim == 2 and w.dtype == np.float32 and w.size >= min_elements and w.shape[0] >= MIN_INNER


def candidates(model: onnx.ModelProto, min_elements: int = 1024) -> dict[str, str]:
    """MatMul weight name -> its activation input, for every MatMul ``matmul_weight`` accepts."""
    g = Graph(model)
    return {n.input[1]: n.input[0] for n in g.g.node if matmul_weight(g, n, min_elements) is not None}


def weights(model: onnx.ModelProto, min_elements: int = 1024) -> list[str]:
    """Every weight this pass can quantize, in graph order: MatMul weights and fused Attention's packed QKV weights."""
    g = Graph(model)
    found = []
    for n in g.g.node:
        if matmul_weight(g, n, min_elements) is not None:
            found.append(n.input[1])
        elif n.op_type == "Attention" and n.domain == MS_DOMAIN:
            w = g.constant(n.input[1])
            if w is not None and w.ndim == 2 and w.dtype == np.float32:
                found.append(n.input[1])
    return found


class QuantizeDynamicInt8(Pass):
    name = "quantize-int8"

    def __init__(self, keep_fp32: tuple[str, ...] = (), min_elements: int = 1024) -> None:
        self.keep_fp32 = set(keep_fp32)
        self.min_elements = min_elements

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"quantized": 0, "with_bias": 0, "kept_fp32": 0}
        skipped = []
        for handle in g.nodes_of("MatMul"):
            mm = g.node(handle)
            where = mm.name or handle
            w = g.constant(mm.input[1])
            if w is None or w.ndim != 2 or w.dtype != np.float32:  # attention scores: activations x activations
                skipped.append(Reason(where, "second input is not a constant FP32 matrix: no weight to quantize"))
                continue
            if mm.input[1] in self.keep_fp32:
                stats["kept_fp32"] += 1
                skipped.append(Reason(where, f"weight {mm.input[1]} kept in FP32 (accuracy budget)"))
                continue
            if w.size < self.min_elements or w.shape[0] < MIN_INNER:
                skipped.append(Reason(where, f"weight of shape {w.shape} is below {self.min_elements} elements or "
                                             f"{MIN_INNER} input channels"))
                continue
            q, scale = quantize_per_column(w)
            codes, zero = unsigned_codes(q)
            inputs = [mm.input[0], g.add_initializer(f"{mm.input[1]}_u8", codes),
                      g.add_initializer(f"{mm.input[1]}_scale", scale), g.add_initializer(f"{mm.input[1]}_zero", zero)]
            remove, out = [mm], mm.output[0]
            add = g.only_consumer(mm.output[0], "Add")
            if add is not None:
                other = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
                b = g.constant(other)
                if b is not None and b.shape == (w.shape[1],):
                    inputs.append(other)
                    remove.append(add)
                    out = add.output[0]
                    stats["with_bias"] += 1
            g.replace_nodes(remove, [helper.make_node("DynamicQuantizeMatMul", inputs, [out], name=g.fresh("DQMatMul"),
                                                      domain=MS_DOMAIN)])
            stats["quantized"] += 1
        for handle in g.nodes_of("Attention", MS_DOMAIN):
            att = g.node(handle)
            where = att.name or handle
            w = g.constant(att.input[1])
            if w is None or w.ndim != 2 or len(att.input) > 4 and any(att.input[4:]):
                skipped.append(Reason(where, "Attention without a constant packed weight, or with past/bias inputs"))
                continue
            if att.input[1] in self.keep_fp32:
                stats["kept_fp32"] += 1
                skipped.append(Reason(where, f"weight {att.input[1]} kept in FP32 (accuracy budget)"))
                continue
            q, scale = quantize_per_column(w)
            codes, zero = unsigned_codes(q)
            x = att.input[0]
            xq, xs, xz = g.fresh(f"{x}_u8"), g.fresh(f"{x}_scale"), g.fresh(f"{x}_zero")
            mask = att.input[3] if len(att.input) > 3 else ""
            inputs = [xq, g.add_initializer(f"{att.input[1]}_u8", codes), att.input[2], xs,
                      g.add_initializer(f"{att.input[1]}_scale", scale), mask, xz,
                      g.add_initializer(f"{att.input[1]}_zero", zero)]
            attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
            g.replace_nodes([att], [
                helper.make_node("DynamicQuantizeLinear", [x], [xq, xs, xz], name=g.fresh("DynamicQuantizeLinear")),
                helper.make_node("QAttention", inputs, list(att.output), name=g.fresh("QAttention"), domain=MS_DOMAIN,
                                 **attrs)])
            stats["quantized"] += 1
            stats["attention"] = stats.get("attention", 0) + 1
        if stats["quantized"]:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, stats["quantized"] > 0, stats, skipped)
