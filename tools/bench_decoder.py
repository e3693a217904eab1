"""Decoder generation speed, side by side in one run: HF eager ``generate``, the anchor (optimum's
``ORTModelForCausalLM`` on its own export, in its own virtual environment) and kiln.

    python tools/bench_decoder.py [--batch-sizes 1 4] [--prompt 64] [--new-tokens 64] [--rounds 5]

Model: a Llama-family decoder of about 32M parameters (8 layers, hidden 512, 8 heads / 4 KV heads,
vocab 8192; random weights, fixed seed: speed does not depend on what the weights learned).
Each round times every system once (rotating who goes first, with an idle gap so no system runs
against another's spinning threads): prefill-only calls (1 new token, median of 3) and a full call
(all new tokens); decode tokens/s = batch x (new - 1) / (full - prefill). Greedy, so every system must
produce the same tokens, which the table reports.

It also measures the machine's streaming read bandwidth (ONNX Runtime MatMul of one row against a
weight matrix far larger than the caches, the shape of a decode step) and prints the decode bound:
weight bytes read per token / bandwidth, and each system's share of it.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_encoder import SESSION_CONFIG, cpu_name  # noqa: E402

CONFIG = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=1376, max_position_embeddings=1024)


def make_checkpoint(path: Path) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def bandwidth_gbs(threads: int, mib: int = 512) -> float:
    """GB/s of a one-row MatMul over a weight matrix of ``mib`` MiB (read once per call): the best of 15
    calls, since a bound is what the machine can do, not what a noisy neighbour left of it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = 4096, mib * (1 << 20) // (4 * 4096)
    w = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "bw",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = np.ones((1, k), np.float32)
    for _ in range(3):
        sess.run(None, {"x": x})
    times = []
    for _ in range(15):
        t = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - t)
    return w.nbytes / min(times) / 1e9


def decode_weight_bytes(ckpt: Path) -> int:
    """Bytes of every weight a decode step reads: all matrices except the embedding table (a row lookup)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    return sum(t.nbytes for name, t in tensors.items() if "embed_tokens" not in name)


class Anchor:
    """The anchor's worker process: one JSON request per generate call."""

    def __init__(self, python: str, ckpt: Path, out: Path, threads: int, extra: list[str] | None = None) -> None:
        self.proc = subprocess.Popen([python, str(ROOT / "tools" / "anchor_decoder.py"), str(ckpt), str(out), str(threads),
                                      *(extra or [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"anchor failed to start (got {line!r}); see its stderr above")

    def __call__(self, ids: np.ndarray, mask: np.ndarray, new: int) -> tuple[float, np.ndarray]:
        self.proc.stdin.write(json.dumps({"ids": ids.tolist(), "mask": mask.tolist(), "max_new_tokens": new}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return reply["seconds"], np.asarray(reply["tokens"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--anchor-python", default=str(ROOT / ".venv-anchor" / "bin" / "python"))
    args = p.parse_args()

    import torch
    import transformers

    import kiln.runtimes as kr
    from kiln.compiler import CompileOptions, compile

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-dec-"))
    ckpt = work / "llama32m"
    params = make_checkpoint(ckpt)
    print(f"compiling {ckpt}", file=sys.stderr)
    art = compile(ckpt, work / "kiln", CompileOptions(threads=args.threads, verify=False,
                                                        max_length=args.prompt + args.new_tokens))
    kiln_model = kr.load(art, threads=args.threads, session_config=SESSION_CONFIG)
    eager = transformers.LlamaForCausalLM.from_pretrained(str(ckpt)).eval()
    anchor = Anchor(args.anchor_python, ckpt, work / "anchor", args.threads) if Path(args.anchor_python).exists() else None
    if anchor is None:
        print(f"anchor skipped: {args.anchor_python} not found (run `make anchor-venv`)", file=sys.stderr)

    def run_eager(ids, mask, new):
        t = time.perf_counter()
        with torch.inference_mode():
            out = eager.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, out[:, ids.shape[1]:].numpy()

    def run_kiln(ids, mask, new):
        t = time.perf_counter()
        out = kiln_model.generate(ids, mask, max_new_tokens=new, stop_token_ids=[], pad_token_id=0)
        return time.perf_counter() - t, out[:, ids.shape[1]:]

    systems = {"HF eager": run_eager, "kiln": run_kiln}
    if anchor:
        systems = {"HF eager": run_eager, "anchor": anchor, "kiln": run_kiln}
    bw = bandwidth_gbs(args.threads)
    weight_bytes = decode_weight_bytes(ckpt)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus, threads {args.threads}, torch {torch.__version__}, "
          f"onnxruntime {__import__('onnxruntime').__version__}")
    print(f"model: Llama {params / 1e6:.1f}M params (8 layers, hidden 512, 8 heads / 4 KV heads, vocab 8192), FP32, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, greedy, median of {args.rounds} alternating rounds")
    print(f"streaming read bandwidth {bw:.1f} GB/s; weights read per decode step {weight_bytes / 1e6:.0f} MB")
    print(f"{'batch':>5} {'system':>9} {'decode tok/s':>13} {'prefill ms':>11} {'vs eager':>9} {'vs anchor':>10} {'of bound':>9}")
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:
        ids = rng.integers(1, CONFIG["vocab_size"], size=(batch, args.prompt), dtype=np.int64)
        mask = np.ones_like(ids)
        tokens = {name: fn(ids, mask, args.new_tokens)[1] for name, fn in systems.items()}  # warm-up + check
        prefill: dict[str, list[float]] = {n: [] for n in systems}
        decode: dict[str, list[float]] = {n: [] for n in systems}
        order = list(systems)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                time.sleep(0.2)
                first = statistics.median(systems[name](ids, mask, 1)[0] for _ in range(3))
                full, _ = systems[name](ids, mask, args.new_tokens)
                prefill[name].append(first)
                decode[name].append(batch * (args.new_tokens - 1) / max(full - first, 1e-9))
        bound = batch * bw * 1e9 / weight_bytes  # a step reads the weights once for the whole batch
        med = {n: statistics.median(v) for n, v in decode.items()}
        for name in systems:
            vs_anchor = f"{med[name] / med['anchor']:>9.2f}x" if anchor else f"{'-':>10}"
            print(f"{batch:>5} {name:>9} {med[name]:>13.1f} {statistics.median(prefill[name]) * 1e3:>11.1f} "
                  f"{med[name] / med['HF eager']:>8.2f}x {vs_anchor} {med[name] / bound:>8.0%}")
        same = all(np.array_equal(tokens["HF eager"], t) for t in tokens.values())
        print(f"      decode bound {bound:.0f} tok/s; greedy tokens identical across systems: {same}")
    if anchor:
        anchor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
