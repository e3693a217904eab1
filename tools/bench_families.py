"""Decode speed of the newer decoder families against a Llama of the same shape, in one run.

    python tools/bench_families.py [--families qwen3 phi3 ...] [--prompt 32] [--new-tokens 64] [--rounds 5]
                                   [--repeats 3] [--against REF] [--smollm2 fp32 int4]

``--against REF`` compiles every model a second time with the kiln of git ref REF (a worktree of this repository,
on the same Python) and times both artifacts of each model back to back: the "vs REF" column is the median over the
repeats of this checkout's decode tok/s over REF's. ``--smollm2`` adds SmolLM2-135M-Instruct (real weights,
``tools/reference_models.py smollm2``) at those precisions (INT4: the default recipe).

Every family is built here with random weights (fixed seed) at one shape: 8 layers, hidden 512, 8 query / 4 KV
heads of 64 features, vocab 8192 (GPT-NeoX has no grouped KV heads: 8 / 8). Each MLP keeps its family's form
(gated or not, packed or not), so parameter counts differ a little; Qwen3-MoE has 8 experts of 688, top 2, so
its routed MLP FLOPs equal the Llama's 1376 and its weights are 4x the MLP ("qwen3_moe-dense": the same model with
``--disable-pass fuse-moe``, every expert over every token, as kiln compiled MoE before). kiln compiles each at FP32 (fusion
coverage still checked; parity is the tests' job), then a child process without torch (its OpenMP threads would
slow ONNX Runtime) times batch-1 greedy decode of one artifact: decode tok/s = (new - 1) / (full call - prefill-only
call), median of the rounds; every artifact gets its own child, in turn, ``--repeats`` times, and the median of those
(a session created beside others runs a few percent faster or slower by where it was created).

Two ratios against the Llama: raw tok/s, and per weight byte (tok/s x the bytes a decode step reads), which
removes the differences in size: a family on the fused path reads its weights as fast as the Llama does. A routed
decode step reads the router and its k picked experts only (the dense form reads all of them).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

SHAPE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=1024)
FAMILIES = ["llama", "qwen3", "gemma3_text", "phi3", "stablelm", "gpt_neox", "phi", "qwen3_moe", "qwen3_moe-dense",
            "llama-unfused", "deepseek_v3", "bloom"]
DISABLED = {"qwen3_moe-dense": ("fuse-moe",), "llama-unfused": ("fuse-gqa",)}
"""Compiled with these passes off: every expert on every token; every attention layer on the standard-op fallback
with a Concat cache (what a layer no fused kernel takes costs)."""


def config(family: str):
    import transformers as T

    s = dict(SHAPE)
    if family == "qwen3":
        return T.Qwen3Config(intermediate_size=1376, head_dim=64, **s)
    if family == "gemma3_text":
        return T.Gemma3TextConfig(intermediate_size=1376, head_dim=64, sliding_window=512, pad_token_id=0,
                                  eos_token_id=1, bos_token_id=2, **s)
    if family == "phi3":
        return T.Phi3Config(intermediate_size=1376, pad_token_id=0, eos_token_id=1, bos_token_id=2, **s)
    if family == "stablelm":  # rotary over 16 of 64 features
        return T.StableLmConfig(intermediate_size=1376, partial_rotary_factor=0.25, **s)
    if family == "gpt_neox":  # no grouped KV heads; rotary over 16 of 64; MLP 4x hidden
        s.pop("num_key_value_heads")
        return T.GPTNeoXConfig(intermediate_size=2048, rotary_pct=0.25, **s)
    if family == "phi":  # rotary over 32 of 64; parallel block; MLP 4x hidden
        return T.PhiConfig(intermediate_size=2048, partial_rotary_factor=0.5, pad_token_id=0, **s)
    if family in ("llama", "llama-unfused"):
        return T.LlamaConfig(intermediate_size=1376, **s)
    if family == "deepseek_v3":  # latent attention (keys 64 + 32 rotary features, values 64): the fallback; MLP dense
        return T.DeepseekV3Config(intermediate_size=1376, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64,
                                  qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=8, n_routed_experts=8,
                                  **dict(s, num_key_value_heads=8))
    if family == "bloom":  # ALiBi in its own attention code: no cache to attach, generation recomputes
        return T.BloomConfig(hidden_size=512, n_layer=8, n_head=8, vocab_size=8192)
    if family in ("qwen3_moe", "qwen3_moe-dense"):
        return T.Qwen3MoeConfig(intermediate_size=1376, moe_intermediate_size=688, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, head_dim=64, **s)  # as Qwen3-30B-A3B
    raise SystemExit(f"unknown family {family}")


def build(family: str, work: Path, threads: int) -> dict:
    import torch
    import transformers as T

    from kiln.compiler import CompileOptions, compile

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = work / f"{family}-ckpt"
    model.save_pretrained(ckpt)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    dense = family in DISABLED and "fuse-moe" in DISABLED[family]
    cfg = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    idle = 0 if dense or not experts else experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    # a decode step reads every matrix but the embedding table (one row) and the experts not picked; a tied head is
    # read as the head
    read = 4 * (params - embed.numel() + (head.numel() if head is embed else 0) - idle)
    t = time.perf_counter()
    art = compile(ckpt, work / family, CompileOptions(threads=threads, verify=False,
                                                      disabled_passes=DISABLED.get(family, ())))
    manifest = json.loads((art / "manifest.json").read_text())
    cov = {p["name"]: p.get("coverage") for p in manifest["passes"]}
    return {"family": family, "artifact": str(art), "params": params, "read_bytes": read,
            "compile_s": time.perf_counter() - t, "fuse_gqa": cov.get("fuse-gqa"),
            "kv_cache": cov.get("kv-cache") if (cov.get("kv-cache") or {}).get("fused") else cov.get("kv-cache-concat"),
            "fuse_moe": cov.get("fuse-moe"), "cache": (manifest.get("attention") or {}).get("cache")}


def compile_at(ref_tree: Path, ckpt: Path, out: Path, threads: int, precision: str = "fp32",
               disabled: tuple[str, ...] = ()) -> bool:
    """Compile ``ckpt`` with the kiln checked out at ``ref_tree`` (a subprocess importing it first); False when that
    kiln cannot (an older kiln refuses what it has no rule for)."""
    code = ("import sys; from kiln.compiler import CompileOptions, compile; "
            f"compile({str(ckpt)!r}, {str(out)!r}, CompileOptions(threads={threads}, verify=False, "
            f"precision={precision!r}, disabled_passes={disabled!r}))")
    # run from the worktree: ``python -c`` puts the working directory ahead of PYTHONPATH on sys.path
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ref_tree)),
                          cwd=str(ref_tree), capture_output=True, text=True)
    return done.returncode == 0


def graph_signature(artifact: str) -> list:
    """What a decode step runs, names and node order aside: every node's op, domain and attributes, and the
    initializers' shapes. Two artifacts with one signature run the same kernels, as many times, on the same weights'
    shapes."""
    import onnx
    from onnx import helper

    model = onnx.load(str(Path(artifact) / "model.onnx"), load_external_data=False)
    nodes = sorted((n.op_type, n.domain, sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute))
                   for n in model.graph.node)
    return nodes + sorted(tuple(t.dims) for t in model.graph.initializer)


def worktree(ref: str) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="kiln-bench-ref-")) / "kiln"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True,
                   capture_output=True)
    return tree


def time_decode(artifacts: dict[str, str], prompt: int, new: int, rounds: int, threads: int) -> dict[str, float]:
    """Child process (no torch): median decode tok/s per artifact, every artifact timed in every round."""
    import numpy as np

    import kiln.runtimes as kr
    from bench_encoder import SESSION_CONFIG

    models = {f: kr.load(a, threads=threads, session_config=SESSION_CONFIG) for f, a in artifacts.items()}
    vocab = min(int(m.manifest.data["model"]["vocab_size"]) for m in models.values())
    ids = np.random.default_rng(0).integers(3, vocab, size=(1, prompt), dtype=np.int64)
    mask = np.ones_like(ids)

    def call(m, n):
        t = time.perf_counter()
        m.generate(ids, mask, max_new_tokens=n, stop_token_ids=[], pad_token_id=0)
        return time.perf_counter() - t

    for m in models.values():
        call(m, new)  # warm-up
    speeds: dict[str, list[float]] = {f: [] for f in models}
    groups = [[f for f in models if f.split("@")[0] == base] for base in dict.fromkeys(f.split("@")[0] for f in models)]
    for r in range(rounds):  # groups rotate; within a group (a model and its --against twin) the two alternate
        for group in groups[r % len(groups):] + groups[:r % len(groups)]:
            for f in group if r % 2 == 0 else group[::-1]:
                time.sleep(0.2)
                first = statistics.median(call(models[f], 1) for _ in range(3))
                speeds[f].append((new - 1) / max(call(models[f], new) - first, 1e-9))
    return {f: statistics.median(v) for f, v in speeds.items()}


def timed_in_turn(artifacts: dict[str, str], args: argparse.Namespace) -> dict[str, list[float]]:
    """Decode tok/s per artifact, one per repeat: each artifact timed alone in its own child process
    (``args.rounds`` rounds), the artifacts in turn, ``args.repeats`` times (the turn order rotated, a model and its
    --against twin back to back, swapped each time, so a pair's ratio is taken within minutes of drift). One
    process per artifact, because where a session is created among others moves its speed: on a Zen 4 machine the
    same two artifacts timed 0.96x with one created first and 1.04x with the other (30 alternating rounds, twice
    each way), and 1.01x each in a process of its own."""
    groups = [[f] + ([f + "@ref"] if f + "@ref" in artifacts else []) for f in artifacts if not f.endswith("@ref")]
    speeds: dict[str, list[float]] = {f: [] for f in artifacts}
    for rep in range(args.repeats):
        rotated = groups[rep % len(groups):] + groups[:rep % len(groups)]
        turn = [f for g in rotated for f in (g if rep % 2 == 0 else g[::-1])]
        for f in turn:
            child = subprocess.run([sys.executable, __file__, "--child", json.dumps({f: artifacts[f]}),
                                    "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                                    "--rounds", str(args.rounds), "--threads", str(args.threads)],
                                   capture_output=True, text=True, check=True)
            speeds[f].append(json.loads(child.stdout.strip().splitlines()[-1])[f])
    return speeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=FAMILIES)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="times each artifact's child process runs, in turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", metavar="REF", help="also compile with the kiln at this git ref; time both")
    ap.add_argument("--smollm2", nargs="*", choices=["fp32", "int4"], default=[],
                    help="add SmolLM2-135M-Instruct at these precisions")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        artifacts = json.loads(args.child)
        print(json.dumps(time_decode(artifacts, args.prompt, args.new_tokens, args.rounds, args.threads)))
        return 0
    import onnxruntime
    import torch

    from bench_encoder import cpu_name

    families = ["llama"] + [f for f in args.families if f != "llama"]
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-families-"))
    built = {}
    for f in families:
        print(f"[bench] build and compile {f}", file=sys.stderr, flush=True)
        built[f] = build(f, work, args.threads)
    real = {}
    if args.smollm2:
        import reference_models

        from kiln.compiler import CompileOptions, compile

        ckpt = reference_models.smollm2()
        for p in args.smollm2:
            print(f"[bench] compile smollm2 {p}", file=sys.stderr, flush=True)
            real[f"smollm2-{p}"] = {"ckpt": ckpt, "precision": p, "artifact": str(compile(
                ckpt, work / f"smollm2-{p}", CompileOptions(threads=args.threads, verify=False, precision=p)))}
    artifacts = {f: b["artifact"] for f, b in built.items()} | {f: r["artifact"] for f, r in real.items()}
    if args.against:
        tree = worktree(args.against)
        for f in list(artifacts):
            print(f"[bench] compile {f} with kiln {args.against}", file=sys.stderr, flush=True)
            ckpt, p = (real[f]["ckpt"], real[f]["precision"]) if f in real else (work / f"{f}-ckpt", "fp32")
            if compile_at(tree, ckpt, work / f"{f}@ref", args.threads, p, DISABLED.get(f, ())):
                artifacts[f"{f}@ref"] = str(work / f"{f}@ref")
    repeats = timed_in_turn(artifacts, args)
    speed = {f: statistics.median(v) for f, v in repeats.items()}
    flags = sorted({w for w in Path("/proc/cpuinfo").read_text().split() if w.startswith(("avx", "amx"))})
    print(f"machine: {cpu_name()}, {os.cpu_count()} cpus, threads {args.threads}, flags {' '.join(flags)}; "
          f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}")
    print(f"shape: 8 layers, hidden 512, 8 / 4 heads of 64, vocab 8192; FP32; batch 1, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy, median of {args.rounds} rounds in a process per artifact, "
          f"{args.repeats} repeats in turn")
    against = f" | vs {args.against} | nodes + weights differing (this / {args.against})" if args.against else ""
    print(f"| family | params | MB read per step | fuse-gqa | kv-cache | fuse-moe | decode tok/s | vs llama | "
          f"per byte vs llama{against} |")
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.against else ""))
    base = speed["llama"] * built["llama"]["read_bytes"]
    def ref(f: str) -> str:
        if not args.against:
            return ""
        if f + "@ref" not in speed:
            return " | (no rule) | -"
        from collections import Counter

        a, r = (Counter(map(repr, graph_signature(artifacts[x]))) for x in (f, f + "@ref"))
        new, old = sum((a - r).values()), sum((r - a).values())
        paired = statistics.median(a / b for a, b in zip(repeats[f], repeats[f + "@ref"]))  # back-to-back pairs
        return f" | {paired:.3f}x | " + ("identical" if not new + old else f"{new} / {old} differ")

    for f in families:
        b = built[f]
        cov = lambda c: f"{c['fused']}/{c['expected']}" if c else "-"  # noqa: E731
        print(f"| {f} | {b['params'] / 1e6:.1f}M | {b['read_bytes'] / 1e6:.0f} | {cov(b['fuse_gqa'])} | "
              f"{cov(b['kv_cache'])} | {cov(b['fuse_moe']) if b['fuse_moe'] and b['fuse_moe']['expected'] else '-'} | "
              f"{speed[f]:.1f} | {speed[f] / speed['llama']:.2f}x | "
              f"{speed[f] * b['read_bytes'] / base:.2f}x{ref(f)} |")
    for f in real:
        print(f"| {f} (real weights) | - | - | - | - | - | {speed[f]:.1f} | - | -{ref(f)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
