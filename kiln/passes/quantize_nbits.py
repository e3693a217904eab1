"""Blocked weight-only quantization: MatMul with a constant weight -> ``com.microsoft.MatMulNBits``.

Each output column's weights are split into blocks of ``block_size`` along the input dimension K, and
every block gets its own scale: one large weight spends the resolution of its block only. At run time
ONNX Runtime's CPU kernel with ``accuracy_level`` 4 quantizes the activations to int8 per row and block
as well, so the few huge activation channels of small LLMs (SmolLM2, Llama-family) cost the blocks they
sit in, not the whole tensor as ``DynamicQuantizeMatMul``'s one per-tensor activation scale does.

Grid (symmetric, the kernel's default zero point 2^(bits-1)): the block's largest-magnitude weight maps
exactly to the most negative code (the scale carries the sign), as ONNX Runtime's own RTN quantizer does;
this uses all 2^bits codes and keeps the extreme weight exact. A tied lm_head (``MatMul(h, Transpose(E))``)
is quantized from E's transpose; the embedding Gather keeps reading E in FP32.

Codes are packed low bits first along K into (N, k_blocks, block_size * bits / 8) bytes; scales are
(N, k_blocks). The math lives in small pure functions so tests can check them against numpy.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph, attr
from kiln.passes.quantize_int8 import matmul_weight, quantizable_matrix

BITS = (4, 8)


def quantize_blocks(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float weights -> codes uint8 (N, k_blocks, block_size) and float32 scales (N, k_blocks).

    w[k, n] ~= (codes[n, k // bs, k % bs] - 2^(bits-1)) * scales[n, k // bs]; K is zero-padded to whole blocks."""
    k, n = w.shape
    blocks = -(-k // block_size)
    wt = np.zeros((n, blocks * block_size), np.float64)
    wt[:, :k] = w.T
    wt = wt.reshape(n, blocks, block_size)
    mid = 1 << (bits - 1)
    idx = np.abs(wt).argmax(-1)
    extreme = np.take_along_axis(wt, idx[..., None], -1)[..., 0]  # signed value of the largest-magnitude weight
    scale = extreme / -mid
    scale[scale == 0] = 1.0  # an all-zero block stays exactly zero
    codes = np.clip(np.rint(wt / scale[..., None]) + mid, 0, (1 << bits) - 1).astype(np.uint8)
    return codes, scale.astype(np.float32)


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """The (K, N) weights the kernel multiplies by: the inverse of ``quantize_blocks``."""
    n = codes.shape[0]
    w = (codes.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]
    return w.reshape(n, -1)[:, :k].T


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (N, k_blocks, block_size) -> bytes (N, k_blocks, block_size * bits / 8), low bits first."""
    if bits == 8:
        return codes
    lo, hi = codes[..., 0::2], codes[..., 1::2]
    return (lo | (hi << 4)).astype(np.uint8)


def unpack(blob: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return blob
    out = np.empty(blob.shape[:-1] + (blob.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = blob & 0x0F, blob >> 4
    return out


def blockwise_weight(g: Graph, node: onnx.NodeProto, min_elements: int) -> np.ndarray | None:
    """The (K, N) weight of a MatMul this pass takes: a constant (``matmul_weight``'s rule), or the transpose of
    one (a tied lm_head: ``MatMul(h, Transpose(embedding))``, whose transpose is too large to be folded)."""
    w = matmul_weight(g, node, min_elements)
    if w is not None or node.op_type != "MatMul":
        return w
    tr = g.producer.get(node.input[1])
    if tr is None or tr.op_type != "Transpose" or list(attr(tr, "perm", [1, 0])) != [1, 0]:
        return None
    t = g.constant(tr.input[0])
    w = t.T if t is not None else None
    return w if quantizable_matrix(w, min_elements) else None


def weights(model: onnx.ModelProto, min_elements: int = 1024) -> list[str]:
    """Every weight this pass can quantize (its MatMul's second input), in graph order: for the budget."""
    g = Graph(model)
    return [n.input[1] for n in g.g.node if blockwise_weight(g, n, min_elements) is not None]


class QuantizeBlockwise(Pass):
    """Weights -> ``MatMulNBits`` (``bits`` 4 or 8, one scale per ``block_size`` inputs of each column)."""

    name = "quantize-nbits"

    def __init__(self, bits: int = 8, block_size: int = 32, accuracy_level: int = 4, keep_fp32: tuple[str, ...] = (),
                 min_elements: int = 1024) -> None:
        if bits not in BITS or block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"MatMulNBits takes bits {BITS} and a power-of-two block size >= 16 "
                             f"(got {bits} bits, block {block_size})")
        self.bits, self.block_size, self.accuracy_level = bits, block_size, accuracy_level
        self.keep_fp32 = set(keep_fp32)
        self.min_elements = min_elements

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"quantized": 0, "kept_fp32": 0, "bits": self.bits, "block_size": self.block_size}
        skipped = []
        for handle in g.nodes_of("MatMul"):
            mm = g.node(handle)
            where = mm.name or handle
            w = blockwise_weight(g, mm, self.min_elements)
            if w is None:
                skipped.append(Reason(where, "second input is not a constant FP32 matrix of at least "
                                             f"{self.min_elements} elements: nothing to quantize"))
                continue
            if mm.input[1] in self.keep_fp32:
                stats["kept_fp32"] += 1
                skipped.append(Reason(where, f"weight {mm.input[1]} kept in FP32 (accuracy budget)"))
                continue
            codes, scales = quantize_blocks(w, self.bits, self.block_size)
            inputs = [mm.input[0], g.add_initializer(f"{mm.input[1]}_q{self.bits}", pack(codes, self.bits)),
                      g.add_initializer(f"{mm.input[1]}_scales", scales)]
            node = helper.make_node("MatMulNBits", inputs, [mm.output[0]], name=g.fresh("MatMulNBits"), domain=MS_DOMAIN,
                                    K=int(w.shape[0]), N=int(w.shape[1]), bits=self.bits, block_size=self.block_size,
                                    accuracy_level=self.accuracy_level)
            g.replace_nodes([mm], [node])
            stats["quantized"] += 1
        if stats["quantized"]:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, stats["quantized"] > 0, stats, skipped)
