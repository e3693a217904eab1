"""GPTQ checkpoints in and out, without requantizing.

In: AutoGPTQ / GPTQModel checkpoints (``quantization_config`` in config.json or ``quantize_config.json``;
per Linear ``qweight`` int32 (K / pack, N) packed along K, ``qzeros`` int32 (G, N / pack) packed along N,
``scales`` (G, N), ``g_idx`` (K,) the group of each input; format v1 stores zero points minus one, v2 as they
are; ``desc_act`` orders groups by activation) and compressed-tensors ``pack-quantized`` (llm-compressor's
W4A16: ``weight_packed`` int32 (N, K / 8) packed along K, values offset by 2^(bits-1), ``weight_scale`` (N, G),
symmetric). Each quantized Linear becomes the kernel's codes (a ``Codebook`` entry) and the FP32 weight those
codes dequantize to, so the compile finds the codes again and packs them as they are.

Out: ``write_v1`` writes kiln's solver codes as a GPTQ v1 checkpoint, the layout most loaders read.
Packing is low bits first: value j of a 32-bit word sits at bits [j * bits, (j + 1) * bits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import CheckpointError
from kiln.passes.quantize_nbits import Codebook, Quantized

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


def quantization_config(path: Path, cfg: dict[str, Any]) -> dict[str, Any] | None:
    q = cfg.get("quantization_config")
    if q is None and (path / "quantize_config.json").is_file():
        q = json.loads((path / "quantize_config.json").read_text())
        q.setdefault("quant_method", "gptq")
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


def dequantize_checkpoint(path: Path, cfg: dict[str, Any], qcfg: dict[str, Any], out: Path) -> tuple[Codebook, dict]:
    """Read a GPTQ or compressed-tensors checkpoint into an FP32 checkpoint directory at ``out`` (config without
    ``quantization_config``, weights the codes dequantize to, tokenizer files copied) and the codes."""
    import shutil

    from safetensors.numpy import save_file

    method = qcfg.get("quant_method")
    tensors = read_tensors(path)
    book, plain, info = Codebook(), {}, {}
    if method == "gptq":
        bits, group = int(qcfg.get("bits", 4)), int(qcfg.get("group_size", 128))
        fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
        if bits not in GPTQ_BITS or fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"GPTQ checkpoint {path}: {bits}-bit, format {fmt}; kiln reads 4-bit GPTQ in "
                                  "format gptq (v1) or gptq_v2")
        v1, sym = fmt == "gptq", bool(qcfg.get("sym", True))
        layers = sorted({k[:-len(".qweight")] for k in tensors if k.endswith(".qweight")})
        for name in layers:
            t = {s: tensors.pop(f"{name}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{s}" in tensors}
            q = from_gptq(t, bits, group, sym, v1, f"{path}: {name}")
            w = q.dequantize()  # (K, N)
            book.add(w, q)
            plain[f"{name}.weight"] = np.ascontiguousarray(w.T)
        info = {"format": f"gptq ({'v1' if v1 else 'v2'})", "bits": bits, "group_size": group,
                "desc_act": bool(qcfg.get("desc_act", False)), "sym": sym}
    elif method == "compressed-tensors":
        if qcfg.get("format") != "pack-quantized":
            raise CheckpointError(f"compressed-tensors checkpoint {path} has format {qcfg.get('format')!r}; kiln reads "
                                  "pack-quantized (W4A16) only")
        groups = list((qcfg.get("config_groups") or {}).values())
        w = (groups[0] if groups else {}).get("weights") or {}
        bits, group = int(w.get("num_bits", 4)), int(w.get("group_size") or -1)
        if bits not in GPTQ_BITS or not w.get("symmetric", True) or w.get("type", "int") != "int" or len(groups) != 1:
            raise CheckpointError(f"compressed-tensors checkpoint {path}: {bits}-bit {w.get('type')} "
                                  f"{'symmetric' if w.get('symmetric', True) else 'asymmetric'} in {len(groups)} groups; "
                                  "kiln reads one group of symmetric 4-bit int weights")
        layers = sorted({k[:-len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")})
        for name in layers:
            t = {s: tensors.pop(f"{name}.{s}") for s in ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx")
                 if f"{name}.{s}" in tensors}
            if "weight_g_idx" in t:
                raise CheckpointError(f"{path}: {name} carries weight_g_idx (activation ordering); kiln reads "
                                      "compressed-tensors pack-quantized without it")
            q = from_compressed(t, bits, group, f"{path}: {name}")
            wq = q.dequantize()
            book.add(wq, q)
            plain[f"{name}.weight"] = np.ascontiguousarray(wq.T)
        info = {"format": "compressed-tensors pack-quantized", "bits": bits, "group_size": group, "sym": True}
    else:
        raise CheckpointError(f"checkpoint {path} is quantized with {method!r}; kiln compiles FP checkpoints, GPTQ and "
                              "compressed-tensors pack-quantized ones")
    if not layers:
        raise CheckpointError(f"checkpoint {path} declares {method} quantization but has no quantized layers")
    for key, v in tensors.items():
        plain[key] = v.astype(np.float32) if v.dtype in (np.float16,) or str(v.dtype) == "bfloat16" else v
    out.mkdir(parents=True, exist_ok=True)
    save_file(plain, str(out / "model.safetensors"))
    clean = {k: v for k, v in cfg.items() if k != "quantization_config"}
    clean["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(clean, indent=2))
    for f in path.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "quantize_config.json") \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    info["layers"] = len(layers)
    return book, info


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


def export(checkpoint: str | Path, output: str | Path, options: Any, say: Any) -> Path:
    """``kiln export-gptq``: GPTQ (kiln's solver, ``options``' group size, act-order, symmetry, calibration) on
    the checkpoint, written as a GPTQ v1 checkpoint at ``output`` (staged, renamed at the end)."""
    from dataclasses import replace

    from kiln.compiler.artifact import check_output, staging
    from kiln.compiler.build import _check_options, model_facts
    from kiln.compiler.load import load_checkpoint
    from kiln.compiler.quantize.int8 import Driver, check_group_size
    from kiln.compiler.scoped import torch_threads
    from kiln.errors import UsageError

    options = replace(options, precision="int4", quant_method="gptq")
    _check_options(options)
    if options.target != "cpu":
        raise UsageError("export-gptq writes a checkpoint, not a target graph; drop --target")
    output = Path(output).absolute()
    check_output(output, options.force)
    say(f"load {checkpoint}")
    ckpt = load_checkpoint(checkpoint, options.task)
    if ckpt.codebook is not None:
        raise UsageError(f"{checkpoint} is already quantized ({ckpt.imported['format']}); export-gptq takes an FP checkpoint")
    if ckpt.tokenizer is None:
        raise UsageError(f"GPTQ calibrates on text read through the checkpoint's tokenizer; {ckpt.path} has none")
    check_group_size(ckpt, options)
    with staging(output, options.force) as root, torch_threads(options.threads):
        driver = Driver(ckpt, model_facts(ckpt), options, say)
        driver._gptq()
        # the solver ran on a copy; write the original model with the solved layers replaced by their codes
        qinfo = {"quant_method": "gptq", "bits": 4, "group_size": options.group_size or -1,
                 "desc_act": bool(options.act_order), "sym": not options.asym, "true_sequential": True,
                 "damp_percent": driver.gptq_info["damp"], "static_groups": bool(options.act_order), "checkpoint_format": "gptq",
                 "quantizer": ["kiln"]}
        write_v1(ckpt.model, driver.named, root, qinfo, ckpt.tokenizer)
        say(f"{len(driver.named)} layers written as GPTQ v1 ({driver.gptq_info['windows']} calibration windows, "
            f"{driver.gptq_info['seconds']:.0f}s)")
    say(f"wrote {output}")
    return output
