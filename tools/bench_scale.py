"""kiln at scale, in one run: random-init decoders in real shapes (``tools/scale_checkpoints.py``: TinyLlama-1.1B's
and Llama-3.1-8B's, FP16 shards with an index, cached outside the repository), compiled with ``kiln compile`` in
child processes; each compile's time and peak RSS next to the bound the issue sets (the written artifact plus
3 GiB at 1.1B; 12 GiB at 8B); then the artifacts loaded with ``kiln.runtimes`` (no torch in that process) for
decode at batch 1 (64-token prompt, 64 new tokens, greedy), and the peak RSS of load + generate against its files.

    python tools/bench_scale.py [--only 1.1b|8b] [--threads 2] [--work DIR] [--variants fp32,int4]
                                [--llama-cpp LLAMA_CPP_SOURCE [--gguf Q4_K_M,Q5_K_M]] [--keep | --reuse]

``int4`` is the default INT4 method (GPTQ, calibrated on the default text through SmolLM2's tokenizer, which the
checkpoints get: its vocabulary is the 1.1B shape's). With ``--llama-cpp`` (a llama.cpp source tree with
``build/bin/llama-bench`` and ``llama-quantize``; see docs/streaming.md) the 1.1B checkpoint is also
converted (``convert_hf_to_gguf.py``, F16; it needs ``sentencepiece``), quantized to each ``--gguf`` type (Q4_K_M
and Q5_K_M by default: the second is the one the size of kiln's default INT4 artifact), and decoded with
``llama-bench -p 64 -n 64 -d 64`` in the same run; the GGUF files are cached beside the checkpoints.

The checkpoints' weights lie on the INT4 group-32 grid (see scale_checkpoints.py): the numbers are memory and
time, not accuracy. Peak RSS is the child's ``ru_maxrss`` (resident pages, the mapped artifact's included).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import scale_checkpoints  # noqa: E402
import reference_models  # noqa: E402
from bench_encoder import cpu_name  # noqa: E402

KILN = [sys.executable, "-m", "kiln.cli"]
GIB = 1 << 30
VARIANTS = {
    "fp32": [],
    "int8": ["--precision", "int8"],
    "int4-rtn": ["--precision", "int4", "--quant-method", "rtn"],
    "int4": ["--precision", "int4"],
}
BOUNDS = {"1.1b": {"minutes": {"fp32": 10, "int4": 30}, "rss": "artifact + 3 GiB"},
          "8b": {"minutes": {"int4-rtn": 45}, "rss": "12 GiB"}}
DEFAULT_VARIANTS = {"1.1b": ["fp32", "int8", "int4-rtn", "int4"], "8b": ["int4-rtn", "int4"]}


def measured(cmd: list[str], log: Path) -> tuple[int, float, int]:
    """Run ``cmd`` in a child (its output and progress to ``log``, to follow with ``tail -f``); returns exit code,
    seconds and the child's peak RSS (bytes). Through a one-line wrapper so ``RUSAGE_CHILDREN`` is that child's alone."""
    wrapper = ("import resource, subprocess, sys, json; "
               "r = subprocess.run(sys.argv[1:], stderr=subprocess.STDOUT).returncode; "
               "print(json.dumps([r, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]), file=sys.stderr)")
    t = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.run([sys.executable, "-c", wrapper, *cmd], stdout=out, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t
    code, kib = json.loads(p.stderr.strip().splitlines()[-1])
    return code, seconds, kib * 1024


def files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


DECODE = r"""
import json, resource, sys, time
import numpy as np
import kiln.runtimes as kr
path, threads = sys.argv[1], int(sys.argv[2])
assert "torch" not in sys.modules
model = kr.load(path, threads=threads)
vocab = model.manifest.data["model"]["vocab_size"]
ids = np.random.default_rng(0).integers(3, vocab, (1, 64))
mask = np.ones_like(ids)
def run(n):
    t = time.perf_counter()
    model.generate(ids, mask, max_new_tokens=n, stop_token_ids=[], pad_token_id=0)
    return time.perf_counter() - t
run(4)
rates = []
for _ in range(3):
    prefill = run(1)
    full = run(64)
    rates.append(63 / (full - prefill))
print(json.dumps({"tok_s": sorted(rates)[1], "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def decode(artifact: Path, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", DECODE, str(artifact), str(threads)], capture_output=True, text=True)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


PROGRESS = re.compile(r"^\[kiln +[\d.]+s [\d.]+ GiB, peak ([\d.]+)\] (.*)$")


def peak_step(log: Path) -> str | None:
    """The compile step that set its peak RSS, from the progress lines' running peak: the step that was running
    when the peak first reached its final value (the line before the one that first shows it)."""
    steps = [(float(m[1]), m[2]) for line in log.read_text(errors="replace").splitlines() if (m := PROGRESS.match(line))]
    if not steps:
        return None
    top = max(p for p, _ in steps)
    i = next(i for i, (p, _) in enumerate(steps) if p == top)
    return steps[max(0, i - 1)][1][:80]


def llama_cpp(source: Path, ckpt: Path, threads: int, kind: str = "Q4_K_M") -> dict:
    """llama.cpp's ``kind`` (a llama-quantize type) of ``ckpt``: converted and quantized once (cached), then
    ``llama-bench``'s decode."""
    gguf_dir = scale_checkpoints.cache_dir() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    f16, quantized = gguf_dir / f"{ckpt.name}-f16.gguf", gguf_dir / f"{ckpt.name}-{kind.lower()}.gguf"
    bins = source / "build" / "bin"
    if not quantized.exists():
        if not f16.exists():
            env = dict(__import__("os").environ, PYTHONPATH=str(source / "gguf-py"))
            subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", "f16",
                            "--outfile", str(f16)], check=True, env=env, capture_output=True)
        subprocess.run([str(bins / "llama-quantize"), str(f16), str(quantized), kind, str(threads)], check=True,
                       capture_output=True)
    out = subprocess.run([str(bins / "llama-bench"), "-m", str(quantized), "-p", "64", "-n", "64", "-d", "64",
                          "-t", str(threads), "-o", "json"], check=True, capture_output=True, text=True)
    runs = json.loads(out.stdout)
    tg = next(r for r in runs if r["n_gen"] > 0)
    return {"kind": kind, "tok_s": tg["avg_ts"], "bytes": quantized.stat().st_size, "build": runs[0].get("build_commit")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("1.1b", "8b"), action="append")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=scale_checkpoints.cache_dir() / "artifacts")
    ap.add_argument("--variants", default=None, help="comma-separated (default: fp32,int8,int4-rtn,int4 at 1.1B; "
                                                     "int4-rtn,int4 at 8B)")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp source tree, built (1.1B Q4_K_M decode)")
    ap.add_argument("--gguf", default="Q4_K_M,Q5_K_M",
                    help="llama.cpp quantization types to decode beside kiln's INT4 (comma-separated; the table marks "
                         "the one nearest in size to kiln's artifact)")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts (default: removed after measuring)")
    ap.add_argument("--reuse", action="store_true",
                    help="measure an artifact already in --work (kept by an earlier --keep run) instead of compiling")
    args = ap.parse_args()
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx512", "avx2", "amx"))}) \
        if Path("/proc/cpuinfo").exists() else []
    print(f"machine: {cpu_name()}, {len(__import__('os').sched_getaffinity(0))} cores, flags {' '.join(flags)}; "
          f"threads {args.threads}")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.only or ["1.1b", "8b"]:
        ckpt = scale_checkpoints.make(shape, tokenizer=reference_models.smollm2())
        variants = args.variants.split(",") if args.variants else DEFAULT_VARIANTS[shape]
        for v in variants:
            out = args.work / f"{shape}-{v}"
            if args.reuse and (out / "manifest.json").is_file():
                code, seconds, rss = 0, float("nan"), 0  # compiled by an earlier run: its time and RSS are in that log
            else:
                shutil.rmtree(out, ignore_errors=True)
                cmd = [*KILN, "compile", str(ckpt), "-o", str(out), "--max-length", "512", "--threads",
                       str(args.threads), *VARIANTS[v]]
                code, seconds, rss = measured(cmd, args.work / f"{shape}-{v}.log")
            row = {"model": shape, "variant": v, "exit": code, "minutes": seconds / 60, "peak_rss_gib": rss / GIB,
                   "peak_step": peak_step(args.work / f"{shape}-{v}.log") if rss else None}
            if code == 0:
                size = files_bytes(out)
                row["artifact_gib"] = size / GIB
                row["rss_bound_gib"] = size / GIB + 3 if shape == "1.1b" else 12.0
                d = decode(out, args.threads)
                row.update({"decode_tok_s": d.get("tok_s"), "runtime_rss_gib": d.get("rss", 0) / GIB,
                            "runtime_rss_over_files": d.get("rss", 0) / size if "rss" in d else None})
                row["artifact_bytes"] = size
                if not (args.keep or args.reuse):
                    shutil.rmtree(out, ignore_errors=True)
            else:
                row["error"] = (args.work / f"{shape}-{v}.log").read_text().strip().splitlines()[-1:]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'model':<6} {'variant':<9} {'compile':>9} {'bound':>6} {'peak RSS':>9} {'bound':>8} {'artifact':>9} "
          f"{'decode':>10} {'load+gen RSS':>13}")
    for r in rows:
        if r["exit"]:
            print(f"{r['model']:<6} {r['variant']:<9} FAILED (exit {r['exit']}): {r.get('error')}")
            continue
        bound = BOUNDS[r["model"]]["minutes"].get(r["variant"])
        print(f"{r['model']:<6} {r['variant']:<9} {r['minutes']:>6.1f} min {bound or '-':>5} {r['peak_rss_gib']:>6.2f} GiB "
              f"{r['rss_bound_gib']:>5.2f} GiB {r['artifact_gib']:>5.2f} GiB {r['decode_tok_s'] or 0:>6.1f} tok/s "
              f"{r['runtime_rss_gib']:>5.2f} GiB ({r['runtime_rss_over_files'] or 0:.2f}x)")
    for r in rows:
        if r.get("peak_step"):
            print(f"{r['model']} {r['variant']}: peak RSS set during \"{r['peak_step']}\"")
    fp32 = next((r for r in rows if r["model"] == "1.1b" and r["variant"] == "fp32" and not r["exit"]), None)
    int4 = next((r for r in rows if r["model"] == "1.1b" and r["variant"] == "int4" and not r["exit"]), None)
    if fp32 and int4 and fp32.get("decode_tok_s") and int4.get("decode_tok_s"):
        print(f"1.1B decode INT4 (default) / FP32: {int4['decode_tok_s'] / fp32['decode_tok_s']:.2f}x (target 2.5x)")
    if args.llama_cpp and (args.only is None or "1.1b" in args.only):
        ggufs = [llama_cpp(args.llama_cpp, scale_checkpoints.make("1.1b"), args.threads, k)
                 for k in args.gguf.split(",")]
        same = min(ggufs, key=lambda g: abs(g["bytes"] - int4["artifact_bytes"])) if int4 else None
        if int4:
            print(f"kiln INT4 (default) of the 1.1B checkpoint: {int4['artifact_bytes'] / 1e6:.1f} MB, "
                  f"{int4['decode_tok_s']:.1f} tok/s decode")
        for g in ggufs:
            line = (f"llama.cpp {g['build']} {g['kind']} of the 1.1B checkpoint ({g['bytes'] / 1e6:.1f} MB): "
                    f"llama-bench -p 64 -n 64 -d 64 -t {args.threads}: {g['tok_s']:.1f} tok/s decode")
            if int4 and int4.get("decode_tok_s"):
                line += (f"; kiln INT4 / {g['kind']}: {int4['decode_tok_s'] / g['tok_s']:.2f}x"
                         + (" (the same-size GGUF; target 1.2x)" if g is same else ""))
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
