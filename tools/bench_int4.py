"""Decoder INT4 and INT8 on a real model, side by side in one run: SmolLM2-135M-Instruct (real weights,
``tools/reference_models.py smollm2``), kiln FP32 / INT8 / INT4 against ONNX Runtime's INT4 quantizer and
llama.cpp (Q8_0, Q4_K_M, Q4_0; ``tools/llama_cpp.py``).

    python tools/bench_int4.py [--work DIR] [--rounds 5] [--threads 2] [--only ppl|speed] [--variants NAME ...]
                               [--permuted] [--no-llama-cpp]

llama.cpp: its tools built from the llama-cpp-python sdist (``python tools/llama_cpp.py build``; skipped with one
line when they are not built); its GGUFs are ``llama-quantize`` of an F32 GGUF written from SmolLM2's own GGUF,
the weights kiln's checkpoint holds. Perplexity for the comparison uses llama-perplexity's protocol on the same
held-out text (``-c 128 --chunks 40``: the second half of each 128-token chunk; kiln artifacts scored the same
way, column "ppl 2nd half"), each tool against its own F32. Decode: llama-bench tg64 at depth 64, batch 1.
``--permuted``: every system on a copy of SmolLM2 with its hidden, FFN and head channels permuted (the same
function, off the Q4_1 grid the published GGUF put the weights on).

Accuracy: held-out perplexity (the last 7% of Python's pydoc topics, 40 windows of 128 tokens; GPTQ calibrates
on the other 93%). Anchor for accuracy: ``MatMulNBitsQuantizer`` (round-to-nearest, symmetric, block 128) on
kiln's own FP32 graph, so only the quantizer differs (its lm_head, a MatMul on the embedding's transpose, stays
FP32 as the anchor leaves it). Anchor for speed: optimum's export + ``MatMulNBitsQuantizer`` block 32
(accuracy level 4), ``ORTModelForCausalLM.generate`` in its own virtual environment (``make anchor-venv``).
Decode: batch 1, 64-token prompt, 64 new tokens, greedy, median of alternating rounds (prefill-only calls
subtracted). Artifacts are compiled by the kiln CLI in child processes, so no torch runs in this process
while it times ONNX Runtime sessions. Sizes: every file of the artifact directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_decoder import Anchor  # noqa: E402
from bench_encoder import SESSION_CONFIG, cpu_name  # noqa: E402
from eval_perplexity import perplexity  # noqa: E402

import llama_cpp  # noqa: E402

LLAMA_CPP_TYPES = ("F32", "Q8_0", "Q4_K_M", "Q4_0")

VARIANTS = {
    "fp32": [],
    "int8": ["--precision", "int8"],
    # round-to-nearest: built unverified, only its perplexity is measured
    "int4 rtn g128 head fp32": ["--precision", "int4", "--quant-method", "rtn", "--group-size", "128",
                                "--lm-head", "fp32", "--no-verify"],
    "int4 gptq g128 head fp32": ["--precision", "int4", "--group-size", "128", "--lm-head", "fp32",
                                 "--calibration", "{cal}"],
    "int4 (default)": ["--precision", "int4", "--calibration", "{cal}"],
    "int4 awq": ["--precision", "int4", "--quant-method", "awq", "--calibration", "{cal}"],
    "int4 awq+gptq": ["--precision", "int4", "--quant-method", "awq+gptq", "--calibration", "{cal}"],
    "int4 awq+gptq g128 head fp32": ["--precision", "int4", "--quant-method", "awq+gptq", "--group-size", "128",
                                     "--lm-head", "fp32", "--calibration", "{cal}"],
    "int4 lm-head int4": ["--precision", "int4", "--lm-head", "int4", "--calibration", "{cal}"],
    "int4 max-drop ppl=5": ["--precision", "int4", "--max-drop", "ppl=5", "--calibration", "{cal}"],
}


def size_mb(path: Path) -> float:
    """MiB of a file, or of every file of an artifact directory."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 2**20


def compile_variant(ckpt: Path, out: Path, flags: list[str], threads: int) -> float:
    if (out / "manifest.json").is_file():
        return float("nan")
    cal = str(ckpt / "calibration.txt")
    cmd = [sys.executable, "-m", "kiln.cli", "compile", str(ckpt), "-o", str(out), "--threads", str(threads), "-q",
           "--max-length", "512", *[f.replace("{cal}", cal) for f in flags]]
    print("$ kiln " + " ".join(cmd[3:]), file=sys.stderr)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t


def anchor_rtn(fp32: Path, out: Path, block: int) -> Path:
    """ONNX Runtime's INT4 quantizer on kiln's FP32 graph, as an artifact (manifest re-hashed)."""
    if (out / "manifest.json").is_file():
        return out
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime").setLevel(logging.WARNING)  # one INFO line per node otherwise

    from kiln.compiler.manifest import write

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(fp32, tmp)
    model = onnx.load(str(tmp / "model.onnx"))
    q = MatMulNBitsQuantizer(model, block_size=block, is_symmetric=True, accuracy_level=4)
    q.process()
    for f in tmp.glob("model.onnx*"):
        f.unlink()
    onnx.save_model(q.model.model, str(tmp / "model.onnx"))
    data = json.loads((tmp / "manifest.json").read_text())
    data["precision"] = f"int4 (onnxruntime MatMulNBitsQuantizer RTN block {block})"
    data.pop("files", None)
    (tmp / "manifest.json").unlink()
    write(tmp, data)
    tmp.replace(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=str(Path.home() / ".cache" / "kiln" / "bench-int4"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--only", choices=("ppl", "speed"))
    p.add_argument("--anchor-python", default=str(ROOT / ".venv-anchor" / "bin" / "python"))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="kiln variants (default: all)")
    p.add_argument("--permuted", action="store_true", help="SmolLM2 with permuted channels (off the GGUF's grid)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--spin", action="store_true",
                   help="decode timings with ONNX Runtime's pool threads spinning between runs, as kiln loads an "
                        "artifact by default (the default here turns spinning off: several sessions share the cores)")
    args = p.parse_args()

    import reference_models

    import kiln.runtimes as kr

    ckpt = reference_models.smollm2()
    work = Path(args.work) / ("permuted" if args.permuted else "")
    work.mkdir(parents=True, exist_ok=True)
    f32_gguf = llama_cpp.write_f32(ckpt / "model.gguf", work / "smollm2-f32.gguf", 1 if args.permuted else None)
    if args.permuted:
        ckpt = permuted_checkpoint(ckpt, f32_gguf, work / "checkpoint")
    names = ["fp32"] + [n for n in (args.variants or VARIANTS) if n != "fp32"]
    arts = {}
    for name in names:
        arts[name] = work / name.replace(" ", "-").replace("(", "").replace(")", "")
        compile_variant(ckpt, arts[name], VARIANTS[name], args.threads)
    gguf_files = {}
    if args.no_llama_cpp:
        pass
    elif llama_cpp.binaries() is None:
        print(f"llama.cpp skipped: not built in {llama_cpp.home()} (python tools/llama_cpp.py build)", file=sys.stderr)
    else:
        for kind in LLAMA_CPP_TYPES:
            gguf_files[f"llama.cpp {kind}"] = (f32_gguf if kind == "F32" else
                                               llama_cpp.quantize(f32_gguf, work / f"smollm2-{kind}.gguf", kind,
                                                                  args.threads))
    anchor_name = "ORT RTN g128 (anchor)"
    arts[anchor_name] = anchor_rtn(arts["fp32"], work / "ort-rtn-g128", 128)
    manifests = {n: json.loads((a / "manifest.json").read_text()) for n, a in arts.items()}
    print(f"machine: {cpu_name()}, threads {args.threads}, onnxruntime {__import__('onnxruntime').__version__}")
    print(f"model: SmolLM2-135M-Instruct ({ckpt}), held-out text: {ckpt / 'heldout.txt'}")

    if args.only != "speed":
        text = (ckpt / "heldout.txt").read_text()
        base = None
        print(f"\n{'artifact':<28} {'perplexity':>10} {'vs FP32':>8} {'ppl 2nd half':>12} {'vs FP32':>8} "
              f"{'size MiB':>8} {'vs FP32':>8}  quantization")
        for name, art in arts.items():
            model = kr.load(art, threads=args.threads, session_config=SESSION_CONFIG)
            ids = model.text_encoder.encode_ids(text)
            ppl, n = perplexity(model, ids, 128, args.windows)
            half, _ = llama_cpp.perplexity_second_half(model, ids, 128, args.windows)
            base = base or (ppl, size_mb(arts["fp32"]), half)
            q = next((x for x in manifests[name]["passes"] if x["name"] == "quantize-nbits"), None)
            info = ""
            if q and "int4" in q:
                i4 = q["int4"]
                g = i4.get("gptq") or {}
                b = q.get("budget")
                bpw = q["stats"].get("bits_per_weight")
                info = (f"{i4['method']} group {i4['group_size']}, head {i4['lm_head']}, embedding {i4['embedding']}"
                        + (f", {bpw:.2f} bits/weight" if bpw else "")
                        + (f", {g['windows']} windows in {g['seconds']:.0f}s" if g else "")
                        + (f", {len(b['promoted_int8'])} INT8 + {len(b['kept_fp32'])} FP32 of {b['weights']}" if b else ""))
            print(f"{name:<28} {ppl:>10.3f} {100 * (ppl / base[0] - 1):>+7.1f}% {half:>12.3f} "
                  f"{100 * (half / base[2] - 1):>+7.1f}% {size_mb(art):>8.1f} {size_mb(art) / base[1]:>7.2f}x  {info}")
            del model
        f32 = None
        for name, f in gguf_files.items():
            ppl = llama_cpp.perplexity(f, ckpt / "heldout.txt", 128, args.windows, args.threads)
            f32 = f32 or (ppl, size_mb(f))
            print(f"{name:<28} {'-':>10} {'-':>8} {ppl:>12.3f} {100 * (ppl / f32[0] - 1):>+7.1f}% {size_mb(f):>8.1f} "
                  f"{size_mb(f) / f32[1]:>7.2f}x  llama-quantize of the F32 GGUF")
        print(f"({n} held-out tokens for the full-window perplexity; llama.cpp rows against llama.cpp F32)")

    if args.only != "ppl":
        speed(args, arts, ckpt, work, gguf_files)
    return 0


def permuted_checkpoint(src: Path, f32_gguf: Path, out: Path) -> Path:
    """kiln's checkpoint directory for the permuted F32 GGUF (the same conversion as the reference's), with the
    reference's held-out and calibration text."""
    if (out / "heldout.txt").is_file():
        return out
    from kiln.compiler import gguf

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    gguf.convert(f32_gguf, tmp)
    for f in ("calibration.txt", "heldout.txt"):
        shutil.copy2(src / f, tmp / f)
    tmp.replace(out)
    return out


@contextlib.contextmanager
def hidden_kernels(hide: bool):
    """kiln's kernel library hidden from loads inside (``KILN_KERNELS=0``) when ``hide``."""
    from kiln.runtimes import kernels

    old = os.environ.get(kernels.HIDE)
    if hide:
        os.environ[kernels.HIDE] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(kernels.HIDE, None)
        else:
            os.environ[kernels.HIDE] = old


def speed(args: argparse.Namespace, arts: dict[str, Path], ckpt: Path, work: Path, gguf_files: dict[str, Path]) -> None:
    import kiln.runtimes as kr

    prompt, new = 64, 64
    systems = {}
    for name in [n for n in ("fp32", "int8", "int4 (default)", "int4 awq+gptq", "int4 lm-head int4", "int4 max-drop ppl=5")
                 if n in arts]:
        kiln_kernels = "kernels" in json.loads((arts[name] / "manifest.json").read_text())
        # an artifact on kiln's kernel is timed twice: as loaded, and on its fallback (ONNX Runtime's MatMulNBits,
        # the same codes) with the library hidden, so the two kernels compare inside one run
        for label, hide in ((f"kiln {name}", False), (f"kiln {name} on MatMulNBits", True))[:1 + kiln_kernels]:
            with hidden_kernels(hide):
                model = kr.load(arts[name], threads=args.threads, session_config={} if args.spin else SESSION_CONFIG)

            def run(ids, mask, n, model=model):
                t = time.perf_counter()
                out = model.generate(ids, mask, max_new_tokens=n, stop_token_ids=[], pad_token_id=0)
                return time.perf_counter() - t, out[:, ids.shape[1]:]

            systems[label] = run
    anchor = None
    if Path(args.anchor_python).exists():
        print("starting the anchor (optimum export + ORT INT4 RTN block 32)", file=sys.stderr)
        anchor = Anchor(args.anchor_python, ckpt, work / "anchor-optimum-int4", args.threads, extra=["int4"])
        systems["optimum+ORT int4 (anchor)"] = anchor
    else:
        print(f"speed anchor skipped: {args.anchor_python} not found (make anchor-venv)", file=sys.stderr)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 49152, size=(1, prompt), dtype=np.int64)
    mask = np.ones_like(ids)
    for fn in systems.values():
        fn(ids, mask, 4)
    decode = {n: [] for n in systems}
    order = list(systems)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(0.3)
            first = statistics.median(systems[name](ids, mask, 1)[0] for _ in range(3))
            full, _ = systems[name](ids, mask, new)
            decode[name].append((new - 1) / max(full - first, 1e-9))
    med = {n: statistics.median(v) for n, v in decode.items()}
    print(f"\ndecode, batch 1, prompt {prompt}, {new} new tokens, median of {args.rounds} alternating rounds, kiln's pool "
          f"threads {'spinning, kiln default' if args.spin else 'not spinning'}")
    print(f"{'system':<28} {'tok/s':>7} {'vs kiln fp32':>13} {'vs anchor':>10}")
    for name, v in med.items():
        vs = f"{v / med['optimum+ORT int4 (anchor)']:>9.2f}x" if anchor else f"{'-':>10}"
        print(f"{name:<28} {v:>7.1f} {v / med['kiln fp32']:>12.2f}x {vs}")
    if anchor:
        anchor.close()
    if gguf_files:
        print(f"\nllama.cpp, llama-bench tg{new} at depth {prompt}, batch 1, {args.rounds} repetitions (same machine, "
              "after the table above)")
        for name, f in gguf_files.items():
            tps = llama_cpp.decode_tps(f, args.threads, new, prompt, args.rounds)
            print(f"{name:<28} {tps:>7.1f} {tps / med['kiln fp32']:>12.2f}x kiln fp32; kiln int4 (default) "
                  f"{med.get('kiln int4 (default)', float('nan')) / tps:.2f}x this")


if __name__ == "__main__":
    sys.exit(main())
