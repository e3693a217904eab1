"""Kernel conformance: ONNX Runtime's low-bit kernels against a numpy reference of the same codes, per weight format
kiln emits and per row count M, on the machine at hand.

``MatMulNBits`` at accuracy level 4 quantizes each activation row to int8 per block of ``block_size`` (MLAS's
``QuantizeARow_CompInt8``: scale = max|a| / 127, codes = a * (127 / max|a|) rounded to nearest even) and sums the
int8 x weight-code products in integers; level 0 keeps the activations FP32. The reference does the same in float64
and exact integers, so a kernel that agrees differs from it by float rounding only: the bound is ``RTOL`` times the
sum of the absolute products, which a reference without the int8 step already misses by orders of magnitude (the
tests plant that, and a wrong zero point). ``GatherBlockQuantized`` (the embedding table) is a lookup: its rows must
equal the dequantized codes.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.graph import MS_DOMAIN
from kiln.passes.codes import pack, pack_zeros

RTOL = 1e-5
"""Agreement: |kernel - reference| <= RTOL * sum_k |a_k w_k| (+ a tiny absolute floor) per output element."""
ROWS = (1, 2, 8)
ACTIVATION_BLOCK = 256
"""MLAS quantizes the activations in blocks of the weights' block size up to 256: a wider weight block (kiln's
``--group-size 0``, one group per row of up to 4096 inputs) meets activations in blocks of 256 (measured: against
256 the kernel is at 0.002 of the bound, against 64-512 or the weight block at 57-85x)."""


@dataclass(frozen=True)
class Format:
    """One weight format: the op, bits, block size, zero points or the kernel's default, accuracy level, and where
    kiln emits it."""

    op: str
    bits: int
    block: int
    zero_points: bool
    accuracy_level: int
    emitted_for: str

    @property
    def name(self) -> str:
        zp = "zp" if self.zero_points else "sym"
        acc = f" acc{self.accuracy_level}" if self.op == "MatMulNBits" else ""
        return f"{self.op} {self.bits}-bit b{self.block} {zp}{acc}"


FORMATS = (
    Format("MatMulNBits", 4, 32, False, 4, "decoders' INT4 (default group 32), imported GPTQ/AWQ sym"),
    Format("MatMulNBits", 4, 128, False, 4, "decoders' INT4 --group-size 128, imported GPTQ/AWQ sym"),
    Format("MatMulNBits", 4, 16, False, 4, "decoders' INT4 --group-size 16"),
    Format("MatMulNBits", 4, 64, False, 4, "decoders' INT4 --group-size 64"),
    Format("MatMulNBits", 4, 32, True, 4, "decoders' INT4 --asym"),
    Format("MatMulNBits", 4, 128, True, 4, "decoders' INT4 --asym --group-size 128, imported asym"),
    Format("MatMulNBits", 4, 32, True, 0, "encoders' INT4 (asym, FP32 activations)"),
    Format("MatMulNBits", 4, 32, False, 0, "INT4 --accuracy-level 0; the compile's codes check"),
    Format("MatMulNBits", 4, 1024, False, 4, "decoders' INT4 --group-size 0 (one group per row, K <= 1024)"),
    Format("MatMulNBits", 8, 128, False, 4, "decoders' --precision int8"),
    Format("MatMulNBits", 8, 64, False, 4, "INT4 decoders' head (--lm-head int8, the default)"),
    Format("MatMulNBits", 8, 32, False, 4, "the mixed recipe's layers promoted to 8 bits"),
    Format("GatherBlockQuantized", 8, 64, False, 0, "INT4 decoders' embedding table (8-bit, the default)"),
    Format("GatherBlockQuantized", 4, 32, False, 0, "the embedding table with --lm-head int4"),
)


def _codes(rng: np.random.Generator, fmt: Format, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    top = (1 << fmt.bits) - 1
    blocks = -(-k // fmt.block)
    codes = rng.integers(0, top + 1, (n, blocks, fmt.block)).astype(np.uint8)
    scales = ((rng.random((n, blocks)) * 0.02 + 0.001) * rng.choice([-1.0, 1.0], (n, blocks))).astype(np.float32)
    zeros = rng.integers(0, top + 1, (n, blocks)).astype(np.uint8) if fmt.zero_points else None
    return codes, scales, zeros


def dequantized(fmt: Format, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, k: int) -> np.ndarray:
    """(N, K) float64 weights the codes stand for."""
    zero = zeros[..., None].astype(np.float64) if zeros is not None else float(1 << (fmt.bits - 1))
    return ((codes.astype(np.float64) - zero) * scales[..., None].astype(np.float64)).reshape(len(codes), -1)[:, :k]


def int8_rows(a: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MLAS's activation quantization: per row and block, float32 scale max|a| / 127 and int8 codes of a * (127 /
    max|a|) rounded to nearest even; (codes (M, blocks, block) int64, scales (M, blocks) float32)."""
    m, k = a.shape
    blocks = -(-k // block)
    padded = np.zeros((m, blocks * block), np.float32)
    padded[:, :k] = a
    padded = padded.reshape(m, blocks, block)
    amax = np.abs(padded).max(-1)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint((padded * inverse[..., None]).astype(np.float32)).astype(np.int64)
    return np.clip(q, -127, 127), scale


def reference(fmt: Format, a: np.ndarray, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
              int8: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(result (M, N) float64, sum of absolute products (M, N)): what the kernel computes, exactly. ``int8``
    (default: accuracy level 4) emulates the activation quantization."""
    k = a.shape[1]
    w = dequantized(fmt, codes, scales, zeros, k)
    if not (fmt.accuracy_level == 4 if int8 is None else int8):
        a64 = a.astype(np.float64)
        return a64 @ w.T, np.abs(a64) @ np.abs(w).T
    step = min(fmt.block, ACTIVATION_BLOCK)
    q, sa = int8_rows(a, step)
    zero = zeros.astype(np.int64) if zeros is not None else np.int64(1 << (fmt.bits - 1))
    centred = codes.astype(np.int64) - (zero[..., None] if zeros is not None else zero)  # (N, blocks, block)
    per = fmt.block // step  # activation blocks per weight block
    centred = centred.reshape(len(codes), -1, step)[:, :q.shape[1]]
    wscale = np.repeat(scales.astype(np.float64), per, 1)[:, :q.shape[1]]
    dots = np.einsum("mbk,nbk->mnb", q, centred)  # exact integer block sums
    factor = sa.astype(np.float64)[:, None, :] * wscale[None, :, :]
    absolute = np.einsum("mbk,nbk->mnb", np.abs(q), np.abs(centred)) * np.abs(factor)
    return (dots * factor).sum(-1), absolute.sum(-1)


def _session(fmt: Format, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, k: int, n: int,
             folder: Path, threads: int | None) -> Any:
    import onnxruntime as ort

    packed = pack(codes, fmt.bits)
    if fmt.op == "MatMulNBits":
        inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S")]
        if zeros is not None:
            z = pack_zeros(zeros, fmt.bits)
            inits.append(numpy_helper.from_array(z.reshape(-1), "Z"))
        node = helper.make_node("MatMulNBits", ["A", *[t.name for t in inits]], ["Y"],
                                domain=MS_DOMAIN, K=k, N=n, bits=fmt.bits, block_size=fmt.block,
                                accuracy_level=fmt.accuracy_level)
        x = helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])
        y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])
    else:  # the table: N rows of K columns, gathered by index
        inits = [numpy_helper.from_array(packed.reshape(n, -1), "T"), numpy_helper.from_array(scales, "S")]
        node = helper.make_node("GatherBlockQuantized", ["T", "A", "S"], ["Y"], domain=MS_DOMAIN, bits=fmt.bits,
                                block_size=fmt.block, gather_axis=0, quantize_axis=1)
        x = helper.make_tensor_value_info("A", TensorProto.INT64, ["M"])
        y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", k])
    graph = helper.make_graph([node], "conformance", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    path = folder / f"{abs(hash(fmt))}.onnx"
    onnx.save(model, str(path))  # a file, never bytes
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check(fmt: Format, k: int, n: int, rows: tuple[int, ...] = ROWS, threads: int | None = None,
          seed: int = 0) -> dict[str, Any]:
    """One format at one (K, N) shape: per M, the worst |kernel - reference| over its bound (<= 1 agrees), whether
    row i of the M-row call equals the one-row call on row i (bit for bit), and (``several_agree``) whether the rows
    of every call of more than one row equal those of the smallest such call."""
    rng = np.random.default_rng(seed)
    codes, scales, zeros = _codes(rng, fmt, n, k)
    a = rng.standard_normal((max(rows), k)).astype(np.float32)
    a[:, 7 % k] *= 20  # an outlier channel, as small LLMs have
    out: dict[str, Any] = {"format": fmt.name, **asdict(fmt), "k": k, "n": n, "error_over_bound": {}, "same_as_m1": {}}
    with tempfile.TemporaryDirectory(prefix="kiln-conformance-") as folder:
        session = _session(fmt, codes, scales, zeros, k, n, Path(folder), threads)
        if fmt.op == "GatherBlockQuantized":
            ids = rng.integers(0, n, max(rows)).astype(np.int64)
            want = dequantized(fmt, codes, scales, zeros, k)[ids]
            got = {m: session.run(None, {"A": ids[:m]})[0] for m in rows}
            for m in rows:
                out["error_over_bound"][str(m)] = float(np.abs(got[m] - want[:m]).max() / (RTOL * max(1e-30, np.abs(want).max())))
                out["same_as_m1"][str(m)] = bool(np.array_equal(got[m][0], got[rows[0]][0]))
        else:
            want, absolute = reference(fmt, a, codes, scales, zeros)
            bound = RTOL * absolute + 1e-30
            alone = np.concatenate([session.run(None, {"A": a[i:i + 1]})[0] for i in range(max(rows))])
            got = {m: session.run(None, {"A": a[:m]})[0] for m in rows}
            for m in rows:
                out["error_over_bound"][str(m)] = float((np.abs(got[m] - want[:m]) / bound[:m]).max())
                out["same_as_m1"][str(m)] = bool(np.array_equal(got[m], alone[:m]))
            several = [m for m in rows if m > 1]  # what a lone row beside an idle one relies on (``min_rows`` 2)
            out["several_agree"] = all(np.array_equal(got[m][:several[0]], got[several[0]]) for m in several)
    out["agrees"] = all(e <= 1.0 for e in out["error_over_bound"].values())
    return out


def table(shape: tuple[int, int] = (256, 96), formats: tuple[Format, ...] = FORMATS, threads: int | None = None,
          seed: int = 0) -> list[dict[str, Any]]:
    return [check(f, *shape, threads=threads, seed=seed) for f in formats]
