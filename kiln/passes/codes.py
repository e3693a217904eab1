"""Blocked low-bit weights: the quantization math and the codes store, one torch-free and ONNX-free home.

The GPTQ / AWQ solvers (``kiln.compiler.quantize``), an imported checkpoint's codes (``gptq_format``), the
``quantize-nbits`` pass and kiln's kernel (whose packer, ``kiln/kernels/gemm.cpp``, reads the layout ``pack`` writes)
all use these functions and defaults, so a code means one thing everywhere.

Layout: a (K, N) weight becomes codes (N, k_blocks, block_size) in the kernel's input order, scales (N, k_blocks)
and, on the asym grid, zero points (N, k_blocks); ``pack`` stores codes low bits first along K, two 4-bit codes a
byte, as ONNX Runtime's MatMulNBits and kiln's ``ai.kiln.MatMulNBits`` read them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GROUP_SIZE = 32
"""The default inputs per scale (``--group-size``, ``gptq.Settings``, ``QuantizeBlockwise``). SmolLM2-135M held-out
perplexity: see docs/int4.md."""
BITS = (4, 8)
PROMOTED = (8, 32)
"""Bits and block size of a weight an INT4 budget promotes (``promote_int8``)."""
HALF_MIN, HALF_MAX = 2.0 ** -14, 65504.0
"""Scales whose magnitude lies in FP16's normal range are rounded to FP16 by every quantizer (``half_exact``) and
stored as FP16 with a Cast the session folds at load (same kernel, same speed: a prepacked MatMulNBits reads the
folded FP32 scales): group 32 costs 4.5 bits per weight instead of 5. A weight with any scale outside the range
keeps FP32 scales, and so does the asym grid: a sentence encoder at INT4 (asym, GPTQ) lost
measurably more with FP16 ones (docs/int4.md)."""
GRIDS = ("signed", "positive", "asym")
"""signed: symmetric, the block's largest-magnitude weight exact at the most negative code (scale carries the
sign; ONNX Runtime's RTN grid). positive: symmetric with a positive scale, the smallest that keeps both
extremes in [-2^(b-1), 2^(b-1)-1] (TensorRT's Q/DQ). asym: min/max with a zero point per block."""


@dataclass(frozen=True)
class Quantized:
    """One weight's codes in the kernel's layout: w[k, n] = (codes[n, j // bs, j % bs] - zero) * scales[n, j // bs]
    with j the kernel's index of input k (``perm[j] == k`` under act-order, else j == k)."""

    codes: np.ndarray  # uint8 (N, k_blocks, block_size)
    scales: np.ndarray  # float32 (N, k_blocks)
    zeros: np.ndarray | None  # uint8 (N, k_blocks); None: 2^(bits-1)
    bits: int
    block_size: int
    k: int
    perm: np.ndarray | None = None  # int64 (K,): act-order column order

    def dequantize(self) -> np.ndarray:
        """The (K, N) float32 weights the kernel multiplies by, in the graph's input order (computed over slices of
        output columns, so the temporaries stay small)."""
        n = self.codes.shape[0]
        out = np.empty((self.k, n), np.float32)
        step = max(1, (1 << 22) // max(1, self.k))
        for lo in range(0, n, step):
            codes = self.codes[lo:lo + step]
            zero = np.float32(1 << (self.bits - 1)) if self.zeros is None else \
                self.zeros[lo:lo + step].astype(np.float32)[..., None]
            w = ((codes.astype(np.float32) - zero) * self.scales[lo:lo + step, :, None]).reshape(len(codes), -1)[:, :self.k]
            if self.perm is not None:
                ordered = np.empty_like(w)
                ordered[:, self.perm] = w
                w = ordered
            out[:, lo:lo + step] = w.T
        return out


def weight_key(w_kn: np.ndarray) -> str:
    """Identity of a (K, N) FP32 weight as the graph holds it: codes computed elsewhere (GPTQ, an imported
    checkpoint) are handed to the pass by this key."""
    a = np.ascontiguousarray(w_kn, dtype=np.float32)
    digest = hashlib.sha1(a.reshape(-1).view(np.uint8))  # the array's own bytes: no copy (an 8B lm_head is 2.1 GB)
    digest.update(str(a.shape).encode())
    return digest.hexdigest()


class Codebook:
    """Codes computed elsewhere (GPTQ, an imported checkpoint), found again by the FP32 weights they replace:
    whole, or side by side in a weight a fusion packed (Q, K and V concatenated along N).

    ``directory``: each entry's codes are written there (two 4-bit codes per byte) as they are added and read
    back when found, so a streamed 8B model's 7 GB of codes never sit in memory together."""

    def __init__(self, directory: Path | None = None) -> None:
        self.whole: dict[str, Quantized | Path] = {}
        self.first_column: dict[str, tuple[str, int]] = {}
        self.directory = directory

    def __len__(self) -> int:
        return len(self.whole)

    def add(self, w_kn: np.ndarray, q: Quantized) -> str:
        """Keep ``q`` as the codes of ``w_kn``; returns its key (``get`` gives it back)."""
        key = weight_key(w_kn)
        self.whole[key] = q if self.directory is None else _save(q, self.directory / f"{key}.npz")
        self.first_column[weight_key(w_kn[:, :1])] = (key, w_kn.shape[1])
        return key

    def get(self, key: str) -> Quantized:
        q = self.whole[key]
        return q if isinstance(q, Quantized) else _load(q)

    def find(self, w_kn: np.ndarray) -> Quantized | None:
        key = weight_key(w_kn)
        if key in self.whole:
            return self.get(key)
        parts, col = [], 0
        while col < w_kn.shape[1]:
            key, n = self.first_column.get(weight_key(w_kn[:, col:col + 1]), (None, 0))
            if key is None or weight_key(w_kn[:, col:col + n]) != key:
                return None
            parts.append(self.get(key))
            col += n
        first = parts[0]
        same = all(p.bits == first.bits and p.block_size == first.block_size and (p.zeros is None) == (first.zeros is None)
                   and (p.perm is None and first.perm is None or p.perm is not None and first.perm is not None
                        and np.array_equal(p.perm, first.perm)) for p in parts)
        if not same:
            return None
        return Quantized(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                         None if first.zeros is None else np.concatenate([p.zeros for p in parts]),
                         first.bits, first.block_size, first.k, first.perm)


def _save(q: Quantized, path: Path) -> Path:
    codes = q.codes
    if q.bits == 4 and codes.shape[-1] % 2 == 0:  # two codes per byte on disk
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    extra = {"zeros": q.zeros} if q.zeros is not None else {}
    if q.perm is not None:
        extra["perm"] = q.perm
    with open(path, "wb") as fh:
        np.savez(fh, codes=codes, scales=q.scales, meta=np.array([q.bits, q.block_size, q.k], np.int64), **extra)
    return path


def _load(path: Path) -> Quantized:
    with np.load(path) as f:
        bits, block, k = (int(v) for v in f["meta"])
        codes = f["codes"]
        if codes.shape[-1] * 2 == block:
            unpacked = np.empty(codes.shape[:-1] + (block,), np.uint8)
            unpacked[..., 0::2], unpacked[..., 1::2] = codes & 15, codes >> 4
            codes = unpacked
        return Quantized(codes, f["scales"], f["zeros"] if "zeros" in f else None, bits, block, k,
                         f["perm"] if "perm" in f else None)



CHUNK = 1 << 22
"""Weights are rounded and dequantized in slices of about this many values (output columns are independent):
the float64 temporaries of a whole 128k x 4096 embedding table would take tens of gigabytes."""


def rtn(w: np.ndarray, bits: int, block_size: int, grid: str = "signed") -> Quantized:
    """Round-to-nearest of a (K, N) weight on ``grid``; K zero-padded to whole blocks (block 0: one per row,
    padded to a power of two). Computed over slices of output columns, so its temporaries stay small."""
    k, n = w.shape
    step = max(1, CHUNK // max(1, k))
    if n <= step:
        return _rtn(w, bits, block_size, grid)
    parts = [_rtn(w[:, lo:lo + step], bits, block_size, grid) for lo in range(0, n, step)]
    zeros = np.concatenate([p.zeros for p in parts]) if parts[0].zeros is not None else None
    return Quantized(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]), zeros,
                     bits, parts[0].block_size, k)


def _rtn(w: np.ndarray, bits: int, block_size: int, grid: str) -> Quantized:
    k, n = w.shape
    block_size = block_size or 1 << max(4, (k - 1).bit_length())
    blocks = -(-k // block_size)
    wt = np.zeros((n, blocks * block_size), np.float64)
    wt[:, :k] = w.T
    wt = wt.reshape(n, blocks, block_size)
    top, mid = (1 << bits) - 1, 1 << (bits - 1)
    zeros = None
    if grid == "signed":
        idx = np.abs(wt).argmax(-1)
        scale = np.take_along_axis(wt, idx[..., None], -1)[..., 0] / -mid  # signed value of the largest weight
        zero = np.float64(mid)
    elif grid == "positive":
        scale = np.maximum(-wt.min(-1) / mid, wt.max(-1) / (mid - 1))
        zero = np.float64(mid)
    else:
        lo, hi = np.minimum(wt.min(-1), 0), np.maximum(wt.max(-1), 0)
        scale = (hi - lo) / top
        safe = np.where(scale == 0, 1.0, scale)
        zeros = np.clip(np.rint(-lo / safe), 0, top).astype(np.uint8)
        zero = zeros.astype(np.float64)[..., None]
    scale = half_exact(np.where(scale == 0, 1.0, scale), grid)  # an all-zero block stays exactly zero
    codes = np.clip(np.rint(wt / scale[..., None]) + zero, 0, top).astype(np.uint8)
    return Quantized(codes, scale.astype(np.float32), zeros, bits, block_size, k)


def half_exact(scale: np.ndarray, grid: str) -> np.ndarray:
    """``scale`` rounded to FP16 where FP16 holds it as a normal number (``HALF_MIN``); the asym grid's unchanged."""
    if grid == "asym":
        return scale
    half = scale.astype(np.float16).astype(scale.dtype)
    return np.where((np.abs(scale) >= HALF_MIN) & (np.abs(scale) <= HALF_MAX), half, scale)


def half_scales(scales: np.ndarray) -> bool:
    """Every scale exactly an FP16 number: stored in half the bytes."""
    return bool(np.array_equal(scales.astype(np.float16).astype(np.float32), scales))


def quantize_blocks(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, N) float weights -> codes uint8 (N, k_blocks, block_size) and float32 scales (N, k_blocks), signed grid."""
    q = rtn(w, bits, block_size)
    return q.codes, q.scales


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """The (K, N) weights the kernel multiplies by: the inverse of ``quantize_blocks``."""
    return Quantized(codes, scales, None, bits, codes.shape[-1], k).dequantize()


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (..., m) -> bytes (..., m * bits / 8), low bits first (m even for 4 bits)."""
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


def pack_zeros(zeros: np.ndarray, bits: int) -> np.ndarray:
    """Zero points (N, k_blocks) as MatMulNBits / GatherBlockQuantized read them: 4-bit pairs per byte, padded."""
    if bits == 8:
        return zeros
    if zeros.shape[-1] % 2:
        zeros = np.concatenate([zeros, np.full(zeros.shape[:-1] + (1,), 8, np.uint8)], -1)
    return pack(zeros, bits)
