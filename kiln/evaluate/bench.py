"""``kiln bench``: latency and throughput of an artifact, optionally side by side with its eager
checkpoint or another artifact, alternating so that machine drift hits every system alike.

Per batch size x sequence length: p50/p90/p99 latency of a full forward pass (for decoders: the
prefill; for encoder-decoders: the encoder over the source) and throughput; for both also decode
tokens/s (greedy steps through the KV cache, the prefill subtracted); ratios against the first system. Each system gets a warm-up, then timed runs
in ``rounds`` alternating rounds until its share of ``budget_s`` is spent (at least 3 runs a round).
Peak resident memory is the process's (every system shares it); artifact size is on disk.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kiln.runtimes as kr
from kiln.errors import UsageError
from kiln.evaluate.options import BenchOptions

Progress = Callable[[str], None]
DECODE_TOKENS = 16


class System:
    """One thing to time: ``forward(ids, mask)`` and, for decoders, ``generate(ids, new_tokens)``."""

    def __init__(self, name: str, forward: Callable, generate: Callable | None, size_bytes: int | None) -> None:
        self.name, self.forward, self.generate, self.size_bytes = name, forward, generate, size_bytes


def artifact_system(path: str | Path, threads: int | None, backend: str = "onnxruntime") -> tuple[System, kr.Model]:
    model = kr.load(path, backend=backend, threads=threads, session_config={"session.intra_op.allow_spinning": "0"})
    decoder = "kv_cache" in model.manifest.data
    seq2seq = "encoder" in model.runtimes

    def forward(ids: np.ndarray, mask: np.ndarray) -> Any:
        if seq2seq:  # the encoder pass: what a request costs before its first decoder step
            return model.run_encoder(ids, mask)[0]
        return model.run({"input_ids": ids, "attention_mask": mask})

    def generate(ids: np.ndarray, new: int) -> Any:
        return model.generate(ids, np.ones_like(ids), max_new_tokens=new, stop_token_ids=[])

    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return System("artifact", forward, generate if decoder else None, size), model


def eager_system(path: str | Path, decoder: bool) -> System:
    import torch

    from kiln.compiler.load import load_checkpoint

    ckpt = load_checkpoint(path)

    def forward(ids: np.ndarray, mask: np.ndarray) -> Any:
        with torch.inference_mode():
            if ckpt.kind == "seq2seq":
                return ckpt.model.get_encoder()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
            return ckpt.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))

    def generate(ids: np.ndarray, new: int) -> Any:
        with torch.inference_mode():
            return ckpt.model.generate(torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                                       max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    return System("eager", forward, generate if decoder else None, None)


def _timed(fn: Callable[[], Any], seconds: float, at_least: int) -> list[float]:
    out: list[float] = []
    start = time.perf_counter()
    while len(out) < at_least or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _stats(samples: list[float]) -> dict[str, float]:
    s = np.asarray(samples)
    return {"p50_ms": float(np.percentile(s, 50)), "p90_ms": float(np.percentile(s, 90)),
            "p99_ms": float(np.percentile(s, 99)), "runs": len(samples)}


def bench(artifact: str | Path, eager: str | Path | None = None, compare: str | Path | None = None,
          options: BenchOptions | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Time ``artifact`` (and ``eager`` / ``compare`` beside it); torch's threads are set for the eager
    system only while bench runs."""
    o = options or BenchOptions()
    if o.budget_s <= 0 or o.rounds < 1:
        raise UsageError("--budget-seconds must be positive and --rounds at least 1")
    if eager is None:
        return _bench(artifact, None, compare, o, progress)
    from kiln.compiler.scoped import torch_threads

    with torch_threads(o.threads):
        return _bench(artifact, eager, compare, o, progress)


def _bench(artifact: str | Path, eager: str | Path | None, compare: str | Path | None, o: BenchOptions,
           progress: Progress | None) -> dict[str, Any]:
    say = progress or (lambda msg: None)
    batch_sizes, seq_lens, budget_s, rounds, threads = list(o.batch_sizes), list(o.seq_lens), o.budget_s, o.rounds, o.threads
    if not batch_sizes or min(batch_sizes) < 1 or not seq_lens or min(seq_lens) < 1:
        raise UsageError("--batch-size and --seq-len take positive integers, e.g. --batch-size 1 8 --seq-len 128")
    main_system, model = artifact_system(artifact, threads, o.backend)
    decoder = main_system.generate is not None
    systems = [main_system]
    if compare is not None:
        other = artifact_system(compare, threads, o.backend)[0]
        other.name = "compare"
        systems.append(other)
    if eager is not None:
        systems.append(eager_system(eager, decoder))
    limit = model.max_sequence_length
    capacity = model.manifest.data.get("kv_cache", {}).get("capacity", limit)
    vocab = int(model.manifest.data["model"].get("vocab_size") or 1000)
    seq2seq = model.manifest.data["model"]["kind"] == "seq2seq"
    if o.concurrent and (not decoder or seq2seq):
        raise UsageError(f"--concurrent drives generation requests: {artifact} is not a decoder-only artifact")
    if seq2seq and capacity <= DECODE_TOKENS:
        raise UsageError(f"{artifact}'s decoder cache holds {capacity} positions; bench needs {DECODE_TOKENS + 1}: "
                         f"recompile with a larger --max-length")
    # decoders: prompt and new tokens share the cache; encoder-decoders: the source is the encoder's alone
    room = min(limit, capacity - DECODE_TOKENS) if decoder and not seq2seq else limit
    too_long = [s for s in seq_lens if s > room]
    if too_long:
        raise UsageError(f"--seq-len {too_long[0]} does not fit {artifact} (at most {room}"
                         f"{' with ' + str(DECODE_TOKENS) + ' decode tokens' if decoder and not seq2seq else ''}); "
                         "give a shorter length")
    rng = np.random.default_rng(0)
    results = []
    for batch in batch_sizes if not o.concurrent else []:
        for seq in seq_lens:
            ids = rng.integers(min(5, vocab - 1), vocab, size=(batch, seq), dtype=np.int64)
            mask = np.ones_like(ids)
            say(f"bench: batch {batch} x seq {seq}: {', '.join(s.name for s in systems)}")
            entry: dict[str, Any] = {"batch": batch, "seq_len": seq, "systems": {}}
            samples: dict[str, dict[str, list[float]]] = {s.name: {"forward": [], "generate": []} for s in systems}
            for s in systems:  # warm-up
                for _ in range(2):
                    s.forward(ids, mask)
                if decoder:
                    s.generate(ids, 2)
            share = budget_s / rounds / (2 if decoder else 1)
            for r in range(rounds):
                order = systems[r % len(systems):] + systems[:r % len(systems)]
                for s in order:
                    samples[s.name]["forward"] += _timed(lambda: s.forward(ids, mask), share, 3)
                    if decoder:
                        samples[s.name]["generate"] += _timed(lambda: s.generate(ids, DECODE_TOKENS), share, 1)
            for s in systems:
                fwd = _stats(samples[s.name]["forward"])
                row: dict[str, Any] = {"latency": fwd, "sequences_per_s": 1e3 * batch / fwd["p50_ms"],
                                       "tokens_per_s": 1e3 * batch * seq / fwd["p50_ms"]}
                if decoder:
                    gen = float(np.percentile(samples[s.name]["generate"], 50))
                    row["prefill_tokens_per_s"] = row.pop("tokens_per_s")
                    row["decode_tokens_per_s"] = 1e3 * batch * DECODE_TOKENS / max(gen - fwd["p50_ms"], 1e-6)
                entry["systems"][s.name] = row
            first = entry["systems"][systems[0].name]
            for s in systems[1:]:
                other = entry["systems"][s.name]
                first.setdefault("speedup_vs", {})[s.name] = other["latency"]["p50_ms"] / first["latency"]["p50_ms"]
            results.append(entry)
    return {"schema": "kiln-bench", "schema_version": 1, "artifact": str(Path(artifact).absolute()),
            "compare": str(Path(compare).absolute()) if compare else None, "eager": str(Path(eager).absolute()) if eager else None,
            "kind": model.manifest.data["model"]["kind"], "precision": model.manifest.data.get("precision"),
            "threads": threads, "budget_s": budget_s, "rounds": rounds, "backend": model.backend,
            "artifact_size_mb": main_system.size_bytes / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if sys.platform != "darwin"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "results": results,
            **({"concurrent": concurrent(model, o.concurrent, seq_lens, o.new_tokens, vocab, say)} if o.concurrent
               else {})}


def concurrent(model: kr.Model, clients: tuple[int, ...], seq_lens: list[int], new_tokens: int, vocab: int,
               say: Progress) -> list[dict[str, Any]]:
    """N synthetic requests at once through continuous batching (``kiln.runtimes.scheduler``), for each N: random
    prompts of each ``seq_lens`` length, ``new_tokens`` greedy tokens each (no stop token). Aggregate generated
    tokens/s over the wall time, time to first token and inter-token latency percentiles, mean decode batch."""
    from kiln.runtimes.scheduler import Scheduler

    if min(clients) < 1 or new_tokens < 1:
        raise UsageError("--concurrent takes positive client counts and --new-tokens at least 1")
    rng = np.random.default_rng(0)
    out = []
    with Scheduler(model, slots=max(clients), queue_limit=max(clients),
                   positions=max(seq_lens) + new_tokens) as s:
        s.submit(rng.integers(min(5, vocab - 1), vocab, seq_lens[0]).tolist(), max_new_tokens=4,
                 stop_token_ids=[]).result()  # warm-up
        for seq in seq_lens:
            for n in clients:
                say(f"bench: {n} concurrent requests, prompt {seq}, {new_tokens} new tokens each")
                st = s.stats
                st.ttft, st.itl, st.batch_sizes = [], [], []
                t = time.perf_counter()
                streams = [s.submit(rng.integers(min(5, vocab - 1), vocab, seq).tolist(), max_new_tokens=new_tokens,
                                    stop_token_ids=[]) for _ in range(n)]
                tokens = sum(len(x.result()) for x in streams)
                wall = time.perf_counter() - t
                pc = lambda v, q: 1e3 * float(np.percentile(v, q)) if v else None  # noqa: E731
                out.append({"clients": n, "seq_len": seq, "new_tokens": new_tokens, "tokens": tokens, "wall_s": wall,
                            "tokens_per_s": tokens / wall, "ttft_p50_ms": pc(st.ttft, 50),
                            "ttft_p99_ms": pc(st.ttft, 99), "itl_p50_ms": pc(st.itl, 50), "itl_p99_ms": pc(st.itl, 99),
                            "mean_decode_batch": float(np.mean(st.batch_sizes)) if st.batch_sizes else None})
    one = next((r["tokens_per_s"] for r in out if r["clients"] == 1), None)
    for r in out:
        if one:
            r["vs_one_client"] = r["tokens_per_s"] / one
    return out


def table(result: dict[str, Any]) -> str:
    decoder = result["kind"] in ("decoder", "seq2seq")
    head = f"{'batch':>5} {'seq':>5} {'system':<9} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} " + \
        (f"{'prefill tok/s':>14} {'decode tok/s':>13}" if decoder else f"{'seq/s':>9} {'tok/s':>10}") + f" {'artifact speed-up':>18}"
    lines = [f"{result['artifact']} ({result['kind']}, {result['precision']}): {result['artifact_size_mb']:.1f} MB on disk, "
             f"peak RSS {result['peak_rss_mb']:.0f} MB, backend {(result.get('backend') or {}).get('name', 'onnxruntime-cpu')}"]
    lines += [f"  {role}: {result[role]}" for role in ("compare", "eager") if result.get(role)]
    if result.get("concurrent"):
        lines.append(f"{'clients':>7} {'prompt':>6} {'new':>4} {'tok/s':>8} {'vs 1':>6} {'TTFT p50':>9} "
                     f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'decode batch':>12}")
        for r in result["concurrent"]:
            f = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
            vs = f"{r['vs_one_client']:.2f}x" if "vs_one_client" in r else "-"
            lines.append(f"{r['clients']:>7} {r['seq_len']:>6} {r['new_tokens']:>4} {r['tokens_per_s']:>8.1f} {vs:>6} "
                         f"{f(r['ttft_p50_ms']):>9} {f(r['ttft_p99_ms']):>9} {f(r['itl_p50_ms']):>8} "
                         f"{f(r['itl_p99_ms']):>8} {f(r['mean_decode_batch']):>12}")
        lines.append("(latencies in ms)")
        return "\n".join(lines)
    lines.append(head)
    for e in result["results"]:
        first = next(iter(e["systems"].values()))
        for name, r in e["systems"].items():
            lat = r["latency"]
            ratio = first.get("speedup_vs", {}).get(name)
            tput = f"{r['prefill_tokens_per_s']:>14.0f} {r['decode_tokens_per_s']:>13.1f}" if decoder else \
                f"{r['sequences_per_s']:>9.1f} {r['tokens_per_s']:>10.0f}"
            lines.append(f"{e['batch']:>5} {e['seq_len']:>5} {name:<9} {lat['p50_ms']:>9.3f} {lat['p90_ms']:>9.3f} "
                         f"{lat['p99_ms']:>9.3f} {tput} {(f'{ratio:.2f}x' if ratio else '-'):>18}")
    return "\n".join(lines)
