"""Perplexity of causal-LM artifacts on a text file, for comparing precisions of one model.

    python tools/eval_perplexity.py ARTIFACT [ARTIFACT ...] --text heldout.txt [--window 128] [--windows 200]

The text goes through the first artifact's tokenizer and is cut into non-overlapping windows; every
artifact scores the same windows (next-token negative log-likelihood, FP64 softmax).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import kiln.runtimes as kr


def perplexity(model: kr.Model, ids: list[int], window: int, windows: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, min(len(ids) - 1, window * windows), window):
        chunk = np.asarray([ids[start:start + window + 1]], np.int64)
        if chunk.shape[1] < 2:
            break
        logits = model.run({"input_ids": chunk[:, :-1], "attention_mask": np.ones_like(chunk[:, :-1])})["logits"][0]
        logits = logits.astype(np.float64)
        top = logits.max(-1)
        lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
        nll += float((lse - logits[np.arange(len(logits)), chunk[0, 1:]]).sum())
        count += chunk.shape[1] - 1
    return float(np.exp(nll / count)), count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--text", required=True)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--windows", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    models = [kr.load(a, threads=args.threads) for a in args.artifacts]
    text = open(args.text, encoding="utf-8", errors="replace").read()
    ids = models[0].text_encoder.encode_ids(text)
    base = None
    for path, model in zip(args.artifacts, models):
        ppl, n = perplexity(model, ids, args.window, args.windows)
        base = base or ppl
        print(f"{path}: precision {model.manifest.data['precision']}, {n} tokens, perplexity {ppl:.3f} "
              f"({100 * (ppl / base - 1):+.2f}% vs the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
