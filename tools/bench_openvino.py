"""kiln INT4 against OpenVINO GenAI INT4 on SmolLM2-135M-Instruct, one run: batch-1 decode and time to first token.

    python tools/bench_openvino.py --artifact ART --openvino OV_DIR --ov-python OV_VENV/bin/python [--threads 2]

OV_DIR: ``optimum-cli export openvino --weight-format int4 --group-size 32 --ratio 1.0`` of the same checkpoint
(plus ``convert_tokenizer --with-detokenizer``), run by ``tools/anchor_openvino.py`` in OpenVINO's own virtual
environment (openvino-genai, optimum-intel). Both get the same prompt token ids (64 and 448 tokens), greedy, 64 new
tokens, EOS ignored. kiln: time to first token is a prefill-only call; decode is (64-token call - prefill) / 63,
medians of the rounds, kiln timed before and after the anchor. Prints the CPU line and a table with ratios.
``--hide-kernels`` times kiln on its MatMulNBits fallback instead (KILN_KERNELS=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln.runtimes as kr  # noqa: E402
from kiln.runtimes.canary import cpu_name, isa  # noqa: E402

PROMPTS = (64, 448)
"""Prompt lengths: 448 + 64 new tokens fill a --max-length 512 artifact (the benchmark artifacts' length)."""
NEW = 64


def kiln_times(model: kr.Model, ids: np.ndarray, rounds: int) -> tuple[float, float]:
    """(time to first token, time per output token) in ms, medians over ``rounds``."""
    mask = np.ones_like(ids)
    first, whole = [], []
    for r in range(rounds + 1):
        ids = ids.copy()
        ids[0, 0] = 100 + r  # as the anchor's rounds (which would otherwise hit OpenVINO's prefix cache)
        t = time.perf_counter()
        model.generate(ids, mask, max_new_tokens=1, stop_token_ids=[], pad_token_id=0)
        t1 = time.perf_counter()
        model.generate(ids, mask, max_new_tokens=NEW, stop_token_ids=[], pad_token_id=0)
        t2 = time.perf_counter()
        if r:
            first.append(t1 - t)
            whole.append(t2 - t1)
    ttft = statistics.median(first)
    return 1e3 * ttft, 1e3 * (statistics.median(whole) - ttft) / (NEW - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--openvino", required=True)
    ap.add_argument("--ov-python", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hide-kernels", action="store_true")
    args = ap.parse_args()
    if args.hide_kernels:
        os.environ["KILN_KERNELS"] = "0"
    model = kr.load(args.artifact, threads=args.threads)  # kiln's defaults, as an app loads it (pool threads spin)
    vocab = int(model.vocab_size or 32000)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(100, min(vocab, 40000), (1, n)).astype(np.int64) for n in PROMPTS}
    ours: dict[int, list[tuple[float, float]]] = {n: [] for n in PROMPTS}
    for n, ids in prompts.items():
        ours[n].append(kiln_times(model, ids, args.rounds))
    theirs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, ids in prompts.items():
            np.save(Path(tmp) / f"ids{n}.npy", ids)
            out = subprocess.run([args.ov_python, str(Path(__file__).with_name("anchor_openvino.py")), args.openvino,
                                  "--ids", str(Path(tmp) / f"ids{n}.npy"), "--new", str(NEW), "--rounds",
                                  str(args.rounds), "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout
            theirs[n] = json.loads(out.strip().splitlines()[-1])
    for n, ids in prompts.items():  # kiln again after the anchor: drift shows as two different kiln numbers
        ours[n].append(kiln_times(model, ids, args.rounds))
    kernels = model.backend.get("kernels", {}).get("ran", "onnxruntime MatMulNBits")
    print(f"machine: {cpu_name()} ({isa()}), threads {args.threads}, kiln low-bit kernels: {kernels}, "
          f"OpenVINO GenAI {theirs[PROMPTS[0]]['version']}")
    print("| prompt | kiln TTFT ms | OpenVINO TTFT ms | TTFT ratio | kiln decode tok/s | OpenVINO decode tok/s | "
          "decode ratio |")
    print("|---|---|---|---|---|---|---|")
    for n in PROMPTS:
        ttft = statistics.median(t for t, _ in ours[n])
        tpot = statistics.median(p for _, p in ours[n])
        ov_ttft, ov_tpot = theirs[n]["ttft_ms"], theirs[n]["tpot_ms"]
        print(f"| {n} | {ttft:.1f} | {ov_ttft:.1f} | {ov_ttft / ttft:.2f}x | {1e3 / tpot:.1f} | {1e3 / ov_tpot:.1f} | "
              f"{ov_tpot / tpot:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
