"""Structured pruning on the real decoder SmolLM2-135M-Instruct, side by side in one run: kiln FP32 unpruned against
``--prune ffn=0.2`` with flap (uniform and adaptive per-layer counts), wanda and magnitude, no retraining.

    python tools/bench_prune_decoder.py [--prune ffn=0.2] [--windows 40] [--rounds 5]

Accuracy: held-out perplexity on the model's ``heldout.txt`` (the same 128-token windows for every artifact, as
``tools/bench_int4.py``); pruning is chosen on ``calibration.txt``. Speed: decode tokens/s at batch 1 (prompt 64,
64 new tokens), median of alternating rounds, every artifact loaded in this process and torch never imported.
Artifacts are cached under ``--work`` (delete it to rebuild).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_encoder import SESSION_CONFIG, cpu_name  # noqa: E402
from bench_int4 import compile_variant, size_mb  # noqa: E402
from eval_perplexity import perplexity  # noqa: E402

from kiln.compiler.prune import span  # noqa: E402

METHODS = {"flap": [], "flap adaptive": ["--prune-layers", "adaptive"], "wanda": ["--prune-method", "wanda"],
           "magnitude": ["--prune-method", "magnitude"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prune", default="ffn=0.2")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "kiln" / "bench-prune-decoder"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--windows", type=int, default=40)
    args = p.parse_args()

    import reference_models

    import kiln.runtimes as kr

    ckpt = reference_models.smollm2()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    variants = {"fp32": []} | {m: ["--prune", args.prune, "--calibration", "{cal}", *flags] for m, flags in METHODS.items()}
    arts = {}
    for name, flags in variants.items():
        arts[name] = work / (name.replace(" ", "-") + ("" if name == "fp32" else "-" + args.prune.replace(",", "-")))
        compile_variant(ckpt, arts[name], flags, args.threads)
    manifests = {n: json.loads((a / "manifest.json").read_text()) for n, a in arts.items()}
    print(f"machine: {cpu_name()}, threads {args.threads}, onnxruntime {__import__('onnxruntime').__version__}")
    print(f"model: SmolLM2-135M-Instruct, --prune {args.prune}, held-out text: {ckpt / 'heldout.txt'}")

    text = (ckpt / "heldout.txt").read_text()
    models = {n: kr.load(a, threads=args.threads, session_config=SESSION_CONFIG) for n, a in arts.items()}
    ppl = {}
    for name, model in models.items():
        ppl[name], tokens = perplexity(model, model.text_encoder.encode_ids(text), 128, args.windows)

    prompt, new = 64, 64
    ids = np.random.default_rng(0).integers(1, 49152, size=(1, prompt), dtype=np.int64)
    mask = np.ones_like(ids)

    def seconds(model, n):
        t = time.perf_counter()
        model.generate(ids, mask, max_new_tokens=n, stop_token_ids=[], pad_token_id=0)
        return time.perf_counter() - t

    for model in models.values():
        seconds(model, 4)
    decode = {n: [] for n in models}
    order = list(models)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(0.3)
            first = statistics.median(seconds(models[name], 1) for _ in range(3))
            decode[name].append((new - 1) / max(seconds(models[name], new) - first, 1e-9))
    tok_s = {n: statistics.median(v) for n, v in decode.items()}

    print(f"\nperplexity on {tokens} held-out tokens; decode batch 1, prompt {prompt}, {new} new tokens, median of "
          f"{args.rounds} alternating rounds")
    print(f"{'artifact':<14} {'FFN kept/layer':>15} {'perplexity':>10} {'vs FP32':>9} {'tok/s':>7} {'vs FP32':>8} "
          f"{'size MB':>8}  compile-time cost (64 held-out texts)")
    for name in models:
        pr = manifests[name].get("pruning")
        kept = "-" if pr is None else span(pr["ffn_per_layer"])
        cost = "" if pr is None else ", ".join(f"{k} {v:.4g}" for k, v in pr["cost"].items() if k != "texts")
        change = 100 * (ppl[name] / ppl["fp32"] - 1)
        pct = f"{change:+.1f}%" if abs(change) < 1e4 else f"{change:+.2g}%"
        print(f"{name:<14} {kept:>15} {ppl[name]:>10.6g} {pct:>9} {tok_s[name]:>7.1f} "
              f"{tok_s[name] / tok_s['fp32']:>7.2f}x {size_mb(arts[name]):>8.0f}  {cost}")
    for model in models.values():
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
