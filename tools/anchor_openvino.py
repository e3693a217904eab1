"""OpenVINO GenAI's side of tools/bench_openvino.py, run by that script in OpenVINO's own virtual environment.

    OV_PYTHON anchor_openvino.py MODEL_DIR --ids IDS.npy --new 64 --rounds 5 --threads 2

Reads prompt token ids (one row per prompt, int64), runs ``openvino_genai.LLMPipeline`` on the CPU greedily with
EOS ignored, and prints one JSON line per prompt: the median time to first token and time per output token over the
rounds, from the pipeline's own perf metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    pipe = ov_genai.LLMPipeline(args.model, "CPU", INFERENCE_NUM_THREADS=args.threads, NUM_STREAMS=1,
                                PERFORMANCE_HINT="LATENCY")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = args.new
    config.min_new_tokens = args.new
    config.ignore_eos = True
    config.do_sample = False
    prompts = np.load(args.ids)
    for row in prompts:
        mask = ov.Tensor(np.ones_like(row[None], dtype=np.int64))
        ttft, tpot = [], []
        for r in range(args.rounds + 1):
            # each round its own first token: a repeated prompt would be served from the pipeline's prefix cache
            ids = row[None].astype(np.int64).copy()
            ids[0, 0] = 100 + r
            result = pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(ids), mask), config)
            m = result.perf_metrics
            if r:  # the first round warms up
                ttft.append(m.get_ttft().mean)
                tpot.append(m.get_tpot().mean)
        print(json.dumps({"prompt": int(len(row)), "new": args.new, "ttft_ms": statistics.median(ttft),
                          "tpot_ms": statistics.median(tpot), "version": ov_genai.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
