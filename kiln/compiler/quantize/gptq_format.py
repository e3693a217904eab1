"""GPTQ checkpoints in and out, without requantizing.

In: AutoGPTQ / GPTQModel checkpoints (``quantization_config`` in config.json or ``quantize_config.json``;
per Linear ``qweight`` int32 (K / pack, N) packed along K, ``qzeros`` int32 (G, N / pack) packed along N,
``scales`` (G, N), ``g_idx`` (K,) the group of each input; format v1 stores zero points minus one, v2 as they
are; ``desc_act`` orders groups by activation) and compressed-tensors ``pack-quantized`` (llm-compressor's
W4A16: ``weight_packed`` int32 (N, K / 8) packed along K, values offset by 2^(bits-1), ``weight_scale`` (N, G),
symmetric) and AutoAWQ's GEMM layout (``quant_method: awq``, version gemm: ``qweight`` int32 (K, N / 8) packed
along N in the interleaved order ``AWQ_ORDER``, ``qzeros`` int32 (G, N / 8) the same way, ``scales`` (G, N), zero
points stored as they are, groups in input order). Each quantized Linear becomes the kernel's codes (a ``Codebook`` entry) and the FP32 weight those
codes dequantize to, so the compile finds the codes again and packs them as they are.

Out: ``write_v1`` writes kiln's solver codes as a GPTQ v1 checkpoint, the layout most loaders read.
Packing is low bits first: value j of a 32-bit word sits at bits [j * bits, (j + 1) * bits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kiln.compiler.lazy import Entry, LazyWeights
from kiln.errors import CheckpointError
from kiln.passes.codes import Codebook, Quantized

GPTQ_BITS = (4,)
"""What kiln lowers an imported checkpoint to: 4-bit MatMulNBits (``--precision int4``)."""


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint codes -> int32 words, ``32 // bits`` consecutive values along ``axis`` per word, low bits first."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    if v.shape[0] % per:
        raise ValueError(f"{v.shape[0]} values along the packed axis are not a multiple of {per}")
    v = v.reshape(v.shape[0] // per, per, *v.shape[1:])
    word = np.zeros(v.shape[:1] + v.shape[2:], np.uint32)
    for j in range(per):
        word |= (v[:, j] & ((1 << bits) - 1)) << np.uint32(bits * j)
    return np.moveaxis(word.view(np.int32), 0, axis)


def unpack_int32(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    per = 32 // bits
    w = np.moveaxis(words.view(np.uint32), axis, 0)
    out = np.stack([(w >> np.uint32(bits * j)) & ((1 << bits) - 1) for j in range(per)], 1)
    return np.moveaxis(out.reshape(w.shape[0] * per, *w.shape[1:]).astype(np.uint8), 0, axis)


def to_gptq(q: Quantized) -> dict[str, np.ndarray]:
    """Kernel codes -> GPTQ v1 tensors (qweight, qzeros, scales, g_idx) in the checkpoint's input order."""
    n, bs, k, bits = q.codes.shape[0], q.block_size, q.k, q.bits
    kernel = q.codes.reshape(n, -1)[:, :k]  # (N, K) in the kernel's order
    perm = q.perm if q.perm is not None else np.arange(k)
    q_kn = np.empty((k, n), np.uint8)
    q_kn[perm] = kernel.T
    g_idx = np.empty(k, np.int32)
    g_idx[perm] = np.arange(k) // bs
    zeros = np.full(q.scales.shape, 1 << (bits - 1), np.uint8) if q.zeros is None else q.zeros
    stored = (zeros.astype(np.int32) - 1) & ((1 << bits) - 1)  # v1: zero points minus one
    return {"qweight": pack_int32(q_kn, bits, 0), "qzeros": pack_int32(stored.T.astype(np.uint8), bits, 1),
            "scales": q.scales.T.astype(np.float16), "g_idx": g_idx}


def from_gptq(t: dict[str, np.ndarray], bits: int, group_size: int, sym: bool, v1: bool, where: str) -> Quantized:
    """GPTQ tensors -> kernel codes (act-order becomes a permutation with contiguous groups)."""
    q_kn = unpack_int32(t["qweight"], bits, 0)  # (K, N)
    k, n = q_kn.shape
    scales = t["scales"].astype(np.float32).T  # (N, G)
    groups = scales.shape[1]
    zeros = unpack_int32(t["qzeros"], bits, 1)[:, :n].T.astype(np.int32)  # (N, G)
    if v1:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    gs = group_size if group_size > 0 else k
    g_idx = t.get("g_idx")
    natural = np.arange(k) // gs
    if g_idx is None or np.array_equal(g_idx, natural):
        perm = None
    else:
        g_idx = g_idx.astype(np.int64)
        counts = np.bincount(g_idx, minlength=groups)
        if g_idx.min() < 0 or g_idx.max() >= groups or np.any(counts[:-1] != gs) or counts[-1] > gs:
            raise CheckpointError(f"{where}: g_idx does not put {gs} inputs in each of its {groups} groups; "
                                  "kiln reads GPTQ's act-order (desc_act) layout only")
        perm = np.argsort(g_idx, kind="stable")
    layout = gs if group_size > 0 else 1 << max(4, (k - 1).bit_length())
    if layout & (layout - 1) or layout < 16:
        raise CheckpointError(f"{where}: group size {gs} is not a power of two >= 16, which the kernel needs")
    ordered = q_kn if perm is None else q_kn[perm]
    mid = 1 << (bits - 1)
    if sym and not np.all(zeros == mid):
        sym = False  # a "symmetric" checkpoint whose zero points are not the midpoint: read them as they are
    codes = np.repeat(zeros.astype(np.uint8), layout, axis=1)
    codes[:, :k] = ordered.T
    return Quantized(codes.reshape(n, groups, layout), scales, None if sym else zeros.astype(np.uint8), bits, layout, k,
                     None if perm is None else perm.astype(np.int64))


def from_compressed(t: dict[str, np.ndarray], bits: int, group_size: int, where: str) -> Quantized:
    """compressed-tensors pack-quantized (symmetric): int32 (N, K / pack) along K, values offset by 2^(bits-1)."""
    shape = t.get("weight_shape")
    q_nk = unpack_int32(t["weight_packed"], bits, 1)
    n, k = (int(shape[0]), int(shape[1])) if shape is not None else q_nk.shape
    q_nk = q_nk[:, :k]
    scales = t["weight_scale"].astype(np.float32).reshape(n, -1)
    gs = group_size if group_size > 0 else k
    layout = gs if group_size > 0 else 1 << max(4, (k - 1).bit_length())
    if layout & (layout - 1) or layout < 16:
        raise CheckpointError(f"{where}: group size {gs} is not a power of two >= 16, which the kernel needs")
    mid = 1 << (bits - 1)
    codes = np.full((n, scales.shape[1] * layout), mid, np.uint8)
    codes[:, :k] = q_nk
    return Quantized(codes.reshape(n, scales.shape[1], layout), scales, None, bits, layout, k)


AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
"""AutoAWQ's 4-bit packing order: value i of int32 word c holds output column 8c + AWQ_ORDER[i]."""


def awq_columns(words: np.ndarray, bits: int) -> np.ndarray:
    """AutoAWQ int32 words (R, N / 8) packed along the output dimension -> values (R, N) in column order."""
    packed = unpack_int32(words, bits, 1)  # (R, N): value i of word c at position 8c + i
    per = 32 // bits
    target = (np.arange(packed.shape[1] // per)[:, None] * per + AWQ_ORDER[None, :per]).reshape(-1)
    out = np.empty_like(packed)
    out[:, target] = packed
    return out


def from_awq(t: dict[str, np.ndarray], bits: int, group_size: int, where: str) -> Quantized:
    """AutoAWQ GEMM tensors -> kernel codes: W[n, k] = scales[g, n] * (q[k, n] - zeros[g, n]), g = k // group."""
    q_kn = awq_columns(t["qweight"], bits)  # (K, N)
    k, n = q_kn.shape
    scales = t["scales"].astype(np.float32).T  # (N, G)
    zeros = awq_columns(t["qzeros"], bits)[:, :n].T  # (N, G)
    groups = scales.shape[1]
    if group_size <= 0 or group_size * groups != k or group_size & (group_size - 1) or group_size < 16:
        raise CheckpointError(f"{where}: {k} inputs in {groups} groups of {group_size}; kiln reads AWQ groups that "
                              "are a power of two >= 16 and divide the inputs")
    sym = bool(np.all(zeros == 1 << (bits - 1)))
    return Quantized(np.ascontiguousarray(q_kn.T).reshape(n, groups, group_size), scales,
                     None if sym else zeros.astype(np.uint8), bits, group_size, k)


def quantization_config(path: Path, cfg: dict[str, Any]) -> dict[str, Any] | None:
    q = cfg.get("quantization_config")
    if q is None and (path / "quantize_config.json").is_file():
        q = json.loads((path / "quantize_config.json").read_text())
        q.setdefault("quant_method", "gptq")
    if q is None and (path / "quant_config.json").is_file():  # AutoAWQ's own copy
        q = json.loads((path / "quant_config.json").read_text())
        q.setdefault("quant_method", "awq")
    return q


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"quantized checkpoint {path} has no .safetensors weights; kiln reads GPTQ and "
                              "compressed-tensors checkpoints saved as safetensors")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


class Layout:
    """How a GPTQ, AWQ or compressed-tensors checkpoint stores its quantized Linears: the settings (checked against what
    kiln reads), which modules are quantized, and each module's codes from its packed tensors."""

    SUFFIXES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
                "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx")}

    def __init__(self, path: Path, qcfg: dict[str, Any]) -> None:
        self.path, self.method = path, qcfg.get("quant_method")
        if self.method == "gptq":
            self.bits, self.group = int(qcfg.get("bits", 4)), int(qcfg.get("group_size", 128))
            fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
            if self.bits not in GPTQ_BITS or fmt not in ("gptq", "gptq_v2"):
                raise CheckpointError(f"GPTQ checkpoint {path}: {self.bits}-bit, format {fmt}; kiln reads 4-bit GPTQ "
                                      "in format gptq (v1) or gptq_v2")
            self.v1, self.sym = fmt == "gptq", bool(qcfg.get("sym", True))
            self.info = {"format": f"gptq ({'v1' if self.v1 else 'v2'})", "bits": self.bits, "group_size": self.group,
                         "desc_act": bool(qcfg.get("desc_act", False)), "sym": self.sym}
        elif self.method == "awq":  # transformers' config names, or AutoAWQ's own quant_config.json names
            self.bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
            self.group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
            version = str(qcfg.get("version", "gemm")).lower()
            if self.bits not in GPTQ_BITS or version != "gemm" or not qcfg.get("zero_point", True):
                raise CheckpointError(f"AWQ checkpoint {path}: {self.bits}-bit, version {version}, zero_point "
                                      f"{qcfg.get('zero_point', True)}; kiln reads 4-bit AutoAWQ GEMM checkpoints with "
                                      "zero points (re-save GEMV/Marlin/ExLlama layouts as GEMM)")
            self.sym = False
            self.info = {"format": "awq (gemm)", "bits": self.bits, "group_size": self.group, "sym": False}
        elif self.method == "compressed-tensors":
            if qcfg.get("format") != "pack-quantized":
                raise CheckpointError(f"compressed-tensors checkpoint {path} has format {qcfg.get('format')!r}; kiln "
                                      "reads pack-quantized (W4A16) only")
            groups = list((qcfg.get("config_groups") or {}).values())
            w = (groups[0] if groups else {}).get("weights") or {}
            self.bits, self.group = int(w.get("num_bits", 4)), int(w.get("group_size") or -1)
            if self.bits not in GPTQ_BITS or not w.get("symmetric", True) or w.get("type", "int") != "int" or \
                    len(groups) != 1:
                raise CheckpointError(f"compressed-tensors checkpoint {path}: {self.bits}-bit {w.get('type')} "
                                      f"{'symmetric' if w.get('symmetric', True) else 'asymmetric'} in {len(groups)} "
                                      "groups; kiln reads one group of symmetric 4-bit int weights")
            self.info = {"format": "compressed-tensors pack-quantized", "bits": self.bits, "group_size": self.group,
                         "sym": True}
        else:
            raise CheckpointError(f"checkpoint {path} is quantized with {self.method!r}; kiln compiles FP checkpoints, "
                                  "GPTQ, AutoAWQ (GEMM) and compressed-tensors pack-quantized ones")
        self.suffixes = self.SUFFIXES[self.method]

    def modules(self, names: Any) -> list[str]:
        """The quantized modules among the checkpoint's tensor ``names``; none is a one-line error."""
        first = "." + self.suffixes[0]
        found = sorted({k[:-len(first)] for k in names if k.endswith(first)})
        if not found:
            raise CheckpointError(f"checkpoint {self.path} declares {self.method} quantization but has no quantized "
                                  "layers")
        return found

    def codes(self, name: str, t: dict[str, np.ndarray]) -> Quantized:
        """One module's kernel codes from its packed tensors (by suffix)."""
        if self.method == "gptq":
            return from_gptq(t, self.bits, self.group, self.sym, self.v1, f"{self.path}: {name}")
        if self.method == "awq":
            return from_awq(t, self.bits, self.group, f"{self.path}: {name}")
        if "weight_g_idx" in t:
            raise CheckpointError(f"{self.path}: {name} carries weight_g_idx (activation ordering); kiln reads "
                                  "compressed-tensors pack-quantized without it")
        return from_compressed(t, self.bits, self.group, f"{self.path}: {name}")


def dequantize_checkpoint(path: Path, cfg: dict[str, Any], qcfg: dict[str, Any], out: Path) -> tuple[Codebook, dict]:
    """Read a GPTQ, AWQ or compressed-tensors checkpoint into an FP32 checkpoint directory at ``out`` (config without
    ``quantization_config``, weights the codes dequantize to, tokenizer files copied) and the codes. The whole
    checkpoint passes through memory: large ones are streamed instead (``DequantizedWeights``)."""
    import shutil

    from safetensors.numpy import save_file

    layout = Layout(path, qcfg)
    tensors = read_tensors(path)
    book, plain = Codebook(), {}
    layers = layout.modules(tensors)
    for name in layers:
        t = {s: tensors.pop(f"{name}.{s}") for s in layout.suffixes if f"{name}.{s}" in tensors}
        q = layout.codes(name, t)
        w = q.dequantize()  # (K, N)
        book.add(w, q)
        plain[f"{name}.weight"] = np.ascontiguousarray(w.T)
    for key, v in tensors.items():
        plain[key] = v.astype(np.float32) if v.dtype in (np.float16,) or str(v.dtype) == "bfloat16" else v
    out.mkdir(parents=True, exist_ok=True)
    save_file(plain, str(out / "model.safetensors"))
    clean = {k: v for k, v in cfg.items() if k != "quantization_config"}
    clean["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(clean, indent=2))
    for f in path.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "quantize_config.json",
                                                                           "quant_config.json") \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return book, dict(layout.info, layers=len(layers))


class DequantizedWeights(LazyWeights):
    """A quantized checkpoint read shard by shard, as ``LazyWeights`` reads an FP one: each quantized Linear's packed
    tensors are replaced by its ``NAME.weight``, dequantized from its codes (FP32, exact) when it is read; the other
    tensors are read as they are. ``codebook`` reads every module's codes once (one module at a time) into a
    directory-backed ``Codebook``."""

    def __init__(self, path: Path, layout: Layout) -> None:
        super().__init__(path)
        self.layout = layout
        self.packed: dict[str, dict[str, Entry]] = {}
        for name in layout.modules(self.entries):
            parts = {s: self.entries.pop(f"{name}.{s}") for s in layout.suffixes if f"{name}.{s}" in self.entries}
            self.packed[name] = parts
            self.entries[f"{name}.weight"] = Entry(next(iter(parts.values())).file, "F32", self._shape(name, parts))

    def _shape(self, name: str, parts: dict[str, Entry]) -> tuple[int, int]:
        """(N, K) of a quantized module's weight, from its packed tensors' shapes (compressed-tensors: its
        weight_shape, which is read)."""
        per = 32 // self.layout.bits
        if "qweight" in parts:
            rows, cols = parts["qweight"].shape
            return (cols * per, rows) if self.layout.method == "awq" else (cols, rows * per)  # AWQ packs along N
        if "weight_shape" in parts:
            n, k = (int(v) for v in self.read(parts["weight_shape"], f"{name}.weight_shape").tolist())
            return n, k
        rows, cols = parts["weight_packed"].shape
        return rows, cols * per

    def quantized(self, name: str) -> Quantized:
        parts = {s: self.read(e, f"{name}.{s}").numpy() for s, e in self.packed[name].items()}
        return self.layout.codes(name, parts)

    def torch(self, key: str, transpose: bool = False) -> Any:
        module = key[:-len(".weight")] if key.endswith(".weight") else None
        if module in self.packed:
            w_kn = self.quantized(module).dequantize()
            return self.own(w_kn if transpose else w_kn.T)
        return super().torch(key, transpose)

    def codebook(self, directory: Path) -> Codebook:
        book = Codebook(directory)
        for name in self.packed:
            q = self.quantized(name)
            book.add(q.dequantize(), q)
        return book


def write_v1(model: Any, named: dict[str, Quantized], out: Path, qinfo: dict[str, Any], tokenizer: Any) -> None:
    """The model with every solved Linear as GPTQ v1 tensors, config.json with ``quantization_config`` and
    quantize_config.json (AutoGPTQ's copy), and the tokenizer."""
    from safetensors.numpy import save_file

    per = 32 // 4
    odd = [f"{name} ({q.k} inputs x {q.codes.shape[0]} outputs)" for name, q in named.items()
           if q.k % per or q.codes.shape[0] % per]
    if odd:
        from kiln.errors import UsageError

        raise UsageError(f"GPTQ packs {per} values per int32 along both dimensions; {odd[0]} is not a multiple of {per} "
                         f"(and {len(odd) - 1} more layers): this model cannot be written as a GPTQ checkpoint")
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    for name, q in named.items():
        state.pop(f"{name}.weight")
        for key, value in to_gptq(q).items():
            state[f"{name}.{key}"] = value
    seen: dict[int, str] = {}
    for key in list(state):  # tied or shared tensors once (safetensors refuses shared storage)
        arr = state[key]
        ptr = arr.__array_interface__["data"][0]
        if ptr in seen and arr.size:
            state.pop(key)
        else:
            seen[ptr] = key
            state[key] = np.ascontiguousarray(arr)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qinfo
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "quantize_config.json").write_text(json.dumps({k: v for k, v in qinfo.items() if k != "quant_method"},
                                                         indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
