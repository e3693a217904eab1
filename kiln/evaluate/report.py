"""``kiln report``: how far an artifact drifted from its reference checkpoint, on the user's text.

Both run the same tokenised texts (one text per row, so no padding enters the numbers):
- decoders: perplexity of each and its change, next-token top-1 agreement, mean and p99 KL
  divergence of the next-token distributions (also per position), and the greedy-continuation
  match rate (artifact generation vs Hugging Face ``generate``);
- encoders: cosine of the pooled embedding (or the first output, mean-pooled) per text;
- every output: max / mean / p99 absolute error and a histogram of the errors;
- the artifact's latency distribution (p50/p90/p99) at one shape, for release-to-release comparison.
``report.json`` (versioned) is what ``kiln gate`` reads; ``report.md`` and ``report.html`` (plots
embedded, no network) are for people.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kiln.runtimes as kr
from kiln.compiler import graphrun, prune
from kiln.compiler.corpus import read_texts
from kiln.compiler.load import load_checkpoint
from kiln.compiler.scoped import torch_threads
from kiln.compiler.trace import EagerRunner
from kiln.compiler.verify import metrics
from kiln.compiler.verify.cases import make_feeds
from kiln.errors import UsageError
from kiln.evaluate.options import ReportOptions
from kiln.runtimes.base import prepare_feeds

log = logging.getLogger(__name__)

SCHEMA = "kiln-report"
SCHEMA_VERSION = 1
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 16

Progress = Callable[[str], None]


def report(artifact: str | Path, reference: str | Path, data: str | Path, out: str | Path,
           options: ReportOptions | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Measure ``artifact`` against ``reference`` on ``data`` and write report.json/.md/.html into ``out``."""
    o = options or ReportOptions()
    if o.max_texts < 1 or o.max_tokens < 2:
        raise UsageError("--max-texts must be at least 1 and --max-tokens at least 2")
    say = progress or (lambda msg: log.info(msg))
    from kiln.evaluate import render

    model = kr.load(artifact, backend=o.backend, threads=o.threads)
    ckpt = load_checkpoint(reference)
    kind = model.manifest.data["model"]["kind"]
    if kind not in ("encoder", "decoder"):
        raise UsageError(f"kiln report measures encoder and decoder artifacts; {artifact} is {kind}")
    if ckpt.kind != kind:
        raise UsageError(f"--reference {reference} is a {ckpt.kind} checkpoint but {artifact} is a {kind} artifact; "
                         "give the checkpoint the artifact was compiled from")
    texts = read_texts(str(data), role="--data")[:o.max_texts]
    limit = min(o.max_tokens, model.max_sequence_length)
    rows = [r for r in (model.text_encoder.encode_ids(t)[:limit] for t in texts) if len(r) >= 2]
    if not rows:
        raise UsageError(f"--data {data} has no text of two or more tokens for {artifact}'s tokenizer; give real text")
    say(f"report: {len(rows)} texts, {sum(map(len, rows))} tokens from {data}")
    eager = EagerRunner(ckpt)
    result: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "artifact": str(Path(artifact).absolute()), "reference": str(Path(reference).absolute()),
        "data": {"path": str(Path(data).absolute()), "texts": len(rows), "tokens": int(sum(map(len, rows)))},
        "model": {k: model.manifest.data["model"].get(k) for k in ("architecture", "kind", "task")}
        | {"precision": model.manifest.data.get("precision"), "target": model.manifest.data.get("target")},
        "measured_on": {"backend": model.backend["name"], "device": "cuda" if "cuda" in model.backend["name"] else "cpu",
                        "threads": o.threads, "requested": o.backend, "skipped": model.backend["skipped"]},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    errors: dict[str, list[np.ndarray]] = {}
    with torch_threads(o.threads):
        if kind == "decoder":
            result |= decoder_metrics(model, eager, rows, errors)
            rate = greedy_match_rate(model, ckpt, rows)
            if rate is not None:  # absent when the cache has no room for a continuation
                result["metrics"]["greedy_match_rate"] = rate
        else:
            result |= encoder_metrics(model, eager, rows, errors)
        result["outputs"] = {name: metrics.error_stats(np.concatenate(v)) for name, v in errors.items()}
        say("report: per-layer error")
        result["layers"] = layer_errors(Path(artifact), model, ckpt, rows[:8], o.threads)
    pruning = model.manifest.data.get("pruning")
    if pruning:  # against the original checkpoint, each layer's error is what pruning (and precision) cost there
        result["pruning"] = prune.summary(pruning)  # the manifest's record; its cost is what compile measured
        if "cost" in result["pruning"]:
            result["pruning"]["compile_cost"] = result["pruning"].pop("cost")
        kept = {r["layer"] + 1: r for r in pruning.get("layers", [])}  # hidden_states[i] is layer i-1's output
        for r in result["layers"]:
            if r["layer"] in kept:
                r |= {"heads": kept[r["layer"]]["heads"], "ffn": kept[r["layer"]]["ffn"]}
    say("report: latency distribution")
    result["latency"] = latency_distribution(model, rows, o.latency_s)
    render.write(result, errors, Path(out))
    say(f"report: wrote {Path(out) / 'report.json'}, report.md, report.html")
    return result


def _feeds(ids: list[int]) -> dict[str, np.ndarray]:
    arr = np.asarray([ids], np.int64)
    return {"input_ids": arr, "attention_mask": np.ones_like(arr)}


def decoder_metrics(model: kr.Model, eager: EagerRunner, rows: list[list[int]],
                    errors: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    terms: list[dict[str, np.ndarray]] = []
    for ids in rows:
        feeds = _feeds(ids)
        got = model.run(feeds)["logits"][0].astype(np.float64)
        ref = eager.run({k: v for k, v in feeds.items() if k in eager.input_names})["logits"][0].astype(np.float64)
        errors.setdefault("logits", []).append(np.abs(got - ref).ravel())
        terms.append(metrics.next_token_terms(ref[:-1], got[:-1], np.asarray(ids[1:])))
    summary = metrics.next_token_summary(metrics.concat_terms(terms))
    longest = max(len(t["kl"]) for t in terms)
    per_position = [float(np.mean([t["kl"][i] for t in terms if len(t["kl"]) > i])) for i in range(longest)]
    return {"metrics": summary, "kl_per_position": per_position}


def greedy_match_rate(model: kr.Model, ckpt: Any, rows: list[list[int]]) -> float | None:
    """Mean fraction of GREEDY_TOKENS greedy tokens that match Hugging Face ``generate`` before the first
    difference; None when the KV cache has no room for a single new token after the prompts."""
    import torch

    prompts = [r[:16] for r in rows[:GREEDY_PROMPTS]]
    capacity = model.manifest.data.get("kv_cache", {}).get("capacity", model.max_sequence_length)
    new = max(0, min(GREEDY_TOKENS, capacity - max(map(len, prompts))))
    if new == 0:
        return None
    pad = model.manifest.data.get("generation", {}).get("pad_token_id", 0)
    rates = []
    for p in prompts:
        got = model.generate([p], max_new_tokens=new, stop_token_ids=[])[0][len(p):]
        with torch.inference_mode():
            ref = ckpt.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)[0][len(p):]
        ref = ref.numpy()
        same = np.cumprod(got[:len(ref)] == ref[:len(got)])
        rates.append(float(same.sum()) / new)
    return float(np.mean(rates))


def encoder_metrics(model: kr.Model, eager: EagerRunner, rows: list[list[int]],
                    errors: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    cos = []
    for ids in rows:
        feeds = make_feeds(*[np.asarray(x) for x in _feeds(ids).values()], eager.input_names)
        got = model.run({k: v for k, v in feeds.items() if k in model.input_names})
        ref = eager.run(feeds)
        for name in ref:
            if name in got:
                errors.setdefault(name, []).append(np.abs(got[name].astype(np.float64) - ref[name]).ravel())
        name = "sentence_embedding" if "sentence_embedding" in ref else next(iter(ref))
        a, b = got[name].astype(np.float64), ref[name].astype(np.float64)
        if a.ndim == 3:
            a, b = a.mean(1), b.mean(1)
        cos.append(float(metrics.row_cosines(b.reshape(1, -1), a.reshape(1, -1))[0]))
    return {"metrics": {"cosine_min": min(cos), "cosine_mean": float(np.mean(cos)), "cosine_p1": float(np.percentile(cos, 1))},
            "cosine_per_text": cos}


def layer_errors(root: Path, model: kr.Model, ckpt: Any, rows: list[list[int]],
                 threads: int | None = None) -> list[dict[str, Any]]:
    """Where the error enters: each layer's output (Hugging Face ``hidden_states``) against the artifact
    tensor that carries it. The graph's sums and norms are exposed as outputs and each hidden state is
    matched to the closest one by value (names do not survive export and fusion); the relative error
    of that tensor is the layer's, averaged over the texts."""
    import onnx
    import torch

    graph = onnx.load(str(root / model.manifest.data["graphs"]["model"]))
    names = [o for n in graph.graph.node if n.op_type in ("Add", "RMSNormalization", "SimplifiedLayerNormalization",
                                                           "LayerNormalization", "SkipSimplifiedLayerNormalization",
                                                           "SkipLayerNormalization") for o in n.output[:4] if o]
    sess = graphrun.session(graphrun.expose(graph, names), threads)
    wanted = {i.name for i in sess.get_inputs()}
    per_layer: dict[int, list[tuple[str, float]]] = {}
    for ids in rows:
        feeds = _feeds(ids)
        # the runtime's own filling of optional inputs (token types, an empty KV cache)
        full = prepare_feeds(model.manifest.inputs, feeds, model.max_sequence_length)
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: v for k, v in full.items() if k in wanted})))
        with torch.inference_mode():
            hidden = ckpt.model(input_ids=torch.from_numpy(feeds["input_ids"]), output_hidden_states=True).hidden_states
        for layer, h in enumerate(hidden[1:], 1):
            ref = h.float().numpy().reshape(-1)
            best = min(((n, float(np.linalg.norm(v.reshape(-1) - ref) / max(np.linalg.norm(ref), 1e-30)))
                        for n, v in got.items() if n in names and v.size == ref.size), key=lambda x: x[1], default=None)
            if best is not None:
                per_layer.setdefault(layer, []).append(best)
    return [{"layer": layer, "tensor": found[0][0], "relative_error": float(np.mean([e for _, e in found]))}
            for layer, found in sorted(per_layer.items())]


def latency_distribution(model: kr.Model, rows: list[list[int]], budget_s: float) -> dict[str, Any]:
    """Artifact latency at batch 1 on the longest text: warm-up, then as many runs as fit the budget (at least 10)."""
    feeds = _feeds(max(rows, key=len))
    for _ in range(3):
        model.run(feeds)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 10 or (time.perf_counter() - start < budget_s and len(samples) < 2000):
        t = time.perf_counter()
        model.run(feeds)
        samples.append((time.perf_counter() - t) * 1e3)
    s = np.asarray(samples)
    return {"shape": list(feeds["input_ids"].shape), "runs": len(samples), "p50_ms": float(np.percentile(s, 50)),
            "p90_ms": float(np.percentile(s, 90)), "p99_ms": float(np.percentile(s, 99)), "mean_ms": float(s.mean()),
            "samples_ms": [round(x, 4) for x in samples]}
