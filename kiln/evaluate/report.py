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
from kiln.compiler.verify.generation import greedy_config
from kiln.errors import UsageError
from kiln.evaluate import tasks
from kiln.evaluate.options import ReportOptions
from kiln.runtimes.base import prepare_feeds

log = logging.getLogger(__name__)

SCHEMA = "kiln-report"
REPORT_SCHEMA_VERSION = 2
"""2: one entry per artifact under ``artifacts`` (a comparison), the thresholds and each entry's verdict; 1 (one
artifact, its fields at the top level) is still read by ``kiln gate``."""
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 16
LATENCY_ROUNDS = 5

Progress = Callable[[str], None]


class Reference:
    """The reference checkpoint, run once per text whatever the number of artifacts: eager outputs, hidden states
    and greedy continuations are computed on first use and kept."""

    def __init__(self, ckpt: Any) -> None:
        self.ckpt = ckpt
        self.eager = EagerRunner(ckpt)
        self._outputs: dict[tuple[int, ...], dict[str, np.ndarray]] = {}
        self._hidden: dict[tuple[int, ...], list[np.ndarray]] = {}
        self._greedy: dict[tuple[tuple[int, ...], int], np.ndarray] = {}
        self._seq2seq: dict[tuple[tuple[int, ...], int], tuple[np.ndarray, np.ndarray]] = {}

    def outputs(self, ids: list[int], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        key = tuple(ids)
        if key not in self._outputs:
            self._outputs[key] = self.eager.run({k: v for k, v in feeds.items() if k in self.eager.input_names})
        return self._outputs[key]

    def hidden(self, ids: list[int]) -> list[np.ndarray]:
        """Each layer's output (``hidden_states[1:]``); encoder-decoders: the encoder's."""
        import torch

        key = tuple(ids)
        if key not in self._hidden:
            module = self.ckpt.model.get_encoder() if self.ckpt.kind == "seq2seq" else self.ckpt.model
            with torch.inference_mode():
                hs = module(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            self._hidden[key] = [h.float().numpy().reshape(-1) for h in hs[1:]]
        return self._hidden[key]

    def seq2seq(self, source: list[int], steps: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
        """Hugging Face greedy generation from one source text: the tokens (decoder start first) and each step's
        logits (steps, vocab), no end-of-sequence stop so every artifact is compared over the same steps."""
        import torch

        key = (tuple(source), steps)
        if key not in self._seq2seq:
            mask = torch.ones(1, len(source), dtype=torch.long)
            with torch.inference_mode(), greedy_config(self.ckpt.model, steps, pad) as config:
                out = self.ckpt.model.generate(input_ids=torch.tensor([source]), attention_mask=mask,
                                               generation_config=config)
            self._seq2seq[key] = (out.sequences[0].numpy(), np.stack([x[0].float().numpy() for x in out.logits]))
        return self._seq2seq[key]

    def greedy(self, prompt: list[int], new: int, pad: int) -> np.ndarray:
        import torch

        key = (tuple(prompt), new)
        if key not in self._greedy:
            with torch.inference_mode(), greedy_config(self.ckpt.model, new, pad) as config:
                out = self.ckpt.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                               generation_config=config)
            self._greedy[key] = out.sequences[0][len(prompt):].numpy()
        return self._greedy[key]


class ReferenceScorer:
    """The reference checkpoint as a task scorer (``kiln.evaluate.tasks.Scorer``): the same token ids as the
    artifact's, greedy without a stop (the continuation is cut at a stop token afterwards, alike for both)."""

    def __init__(self, ref: Reference, pad: int) -> None:
        self.ref = ref
        self.pad = pad

    def classify(self, ids: list[int]) -> np.ndarray:
        out = self.ref.outputs(ids, make_feeds(*tasks.row_feeds(ids).values(), self.ref.eager.input_names))
        return np.asarray(out["logits"] if "logits" in out else next(iter(out.values())))[0]

    def logits(self, ids: list[int]) -> np.ndarray:
        return np.asarray(self.ref.outputs(ids, tasks.row_feeds(ids))["logits"][0])

    def generate(self, ids: list[int], new: int) -> list[int]:
        if self.ref.ckpt.kind == "seq2seq":
            return [int(t) for t in self.ref.seq2seq(ids, new, self.pad)[0][1:]]
        return [int(t) for t in self.ref.greedy(ids, new, self.pad)]


def report(artifacts: str | Path | list[str | Path], reference: str | Path, data: str | Path | None, out: str | Path,
           options: ReportOptions | None = None, progress: Progress | None = None,
           config: str | Path | None = None) -> dict[str, Any]:
    """Measure each of ``artifacts`` (compiled from ``reference``) on ``data`` (None: English sentences of the Python
    docs) and on the labelled sets of ``options.evals``, the reference run once and latency timed in alternating
    rounds; judge each against the gate thresholds (``config``, ./kiln.toml, ./pyproject.toml) and write
    report.json/.md/.html into ``out``."""
    o = options or ReportOptions()
    paths = [Path(a) for a in ([artifacts] if isinstance(artifacts, (str, Path)) else artifacts)]
    if not paths:
        raise UsageError("kiln report needs at least one artifact")
    if len({p.resolve() for p in paths}) != len(paths):
        raise UsageError("the same artifact is given twice; list each artifact once")
    if o.max_texts < 1 or o.max_tokens < 2:
        raise UsageError("--max-texts must be at least 1 and --max-tokens at least 2")
    say = progress or (lambda msg: log.info(msg))
    from kiln.evaluate import render

    thresholds = _thresholds(config)
    ckpt = load_checkpoint(reference)
    models = []
    try:
        for p in paths:
            # measured whatever its canary says (a report exists to measure a bad artifact); the canary's verdict
            # is recorded beside the numbers
            models.append(kr.load(p, backend=o.backend, threads=o.threads, check=False))
            _check_pair(models[-1], p, ckpt, reference, models[0], paths[0])
        sets = [tasks.read_eval(path, o.eval_task, o.eval_examples) for path in o.evals]
        for s in sets:
            s.max_new_tokens, s.chat = o.eval_new_tokens, o.eval_chat
            for p, model in zip(paths, models):
                tasks.check_task(s, model.manifest.data, p)
        texts = read_texts(None if data is None else str(data), role="--data")[:o.max_texts]
        limit = min(o.max_tokens, min(m.max_sequence_length for m in models))
        rows = [r for r in (models[0].text_encoder.encode_ids(t)[:limit] for t in texts) if len(r) >= 2]
        if not rows:
            raise UsageError(f"--data {data} has no text of two or more tokens for {paths[0]}'s tokenizer; give real text")
        say(f"report: {len(paths)} artifact(s), {len(rows)} texts, {sum(map(len, rows))} tokens from "
            f"{data or 'the built-in texts'}" + (f"; {len(sets)} evaluation set(s)" if sets else ""))
        ref = Reference(ckpt)
        entries = []
        errors: list[dict[str, list[np.ndarray]]] = []
        with torch_threads(o.threads):
            text = tasks.text_of(models[0])
            seq2seq = ckpt.kind == "seq2seq"
            pad = int((models[0].manifest.data.get("generation") or {}).get("pad_token_id", 0))
            scored = []
            for s in sets:
                say(f"report: {s.path.name}: {s.task}, {len(s.rows)} examples, the reference")
                scored.append(tasks.run_set(ReferenceScorer(ref, pad), s, text, seq2seq))
            for p, model in zip(paths, models):
                say(f"report: {p}")
                errs: dict[str, list[np.ndarray]] = {}
                entries.append(measure(p, model, ref, rows, errs, o.threads))
                entries[-1]["canary"] = canary_verdict(model, o.threads, say)
                if sets:
                    scorer = tasks.ArtifactScorer(model)
                    entries[-1]["tasks"] = [tasks.compare(tasks.run_set(scorer, s, text, seq2seq), r, s)
                                            for s, r in zip(sets, scored)]
                errors.append(errs)
        say(f"report: latency, {LATENCY_ROUNDS} alternating rounds")
        for entry, lat in zip(entries, latency_rounds(models, rows, o.latency_s)):
            entry["latency"] = lat
    finally:
        for m in models:
            m.close()
    base = entries[0]["latency"]["p50_ms"]
    for entry in entries:
        entry["speedup_vs_first"] = base / entry["latency"]["p50_ms"]
        entry["verdict"] = verdict(entry, thresholds)
    result: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": REPORT_SCHEMA_VERSION, "reference": str(Path(reference).absolute()),
        "data": {"path": "the Python docs' English sentences (built in)" if data is None else str(Path(data).absolute()),
                 "texts": len(rows), "tokens": int(sum(map(len, rows)))},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "thresholds": thresholds,
        "speedup_baseline": entries[0]["artifact"], "artifacts": entries,
    }
    render.write(result, errors, Path(out))
    say(f"report: wrote {Path(out) / 'report.json'}, report.md, report.html")
    return result


def canary_verdict(model: kr.Model, threads: int | None, say: Progress) -> dict[str, Any] | None:
    """The artifact's canary on this machine (None: it carries none): passed, and the entries that failed."""
    result = kr.canary.check(model, threads)
    if result is None:
        return None
    failed = [e["name"] for e in result.entries if not e["passed"]]
    if result.refused:
        say(f"report: {model.manifest.root} fails its canary here ({', '.join(failed)}): `kiln.runtimes.load` "
            "refuses it on this machine; measured anyway")
    return {"passed": result.passed, "failed": failed, "machine": result.machine}


def _thresholds(config: str | Path | None) -> dict[str, float]:
    """The gate's thresholds where there are any (no thresholds: verdicts are absent, never a pass)."""
    from kiln.evaluate import gate

    try:
        return gate.load_thresholds(config, {})
    except gate.GateInputError as e:
        if config is None and "no thresholds" in str(e):
            return {}
        raise


def _check_pair(model: kr.Model, path: Path, ckpt: Any, reference: str | Path, first: kr.Model, first_path: Path) -> None:
    kind = model.manifest.data["model"]["kind"]
    if kind != first.manifest.data["model"]["kind"]:
        raise UsageError(f"{path} is a {kind} artifact but {first_path} is not; compare artifacts of one reference")
    if ckpt.kind != kind:
        raise UsageError(f"--reference {reference} is a {ckpt.kind} checkpoint but {path} is a {kind} artifact; "
                         "give the checkpoint the artifact was compiled from")
    a, b = (m.manifest.data["model"].get("source", {}).get("sha256") for m in (first, model))
    if a and b and a != b:
        raise UsageError(f"{path} and {first_path} were compiled from different checkpoints (source sha256 differs); "
                         "compare artifacts of one reference")


def measure(path: Path, model: kr.Model, ref: Reference, rows: list[list[int]], errors: dict[str, list[np.ndarray]],
            threads: int | None) -> dict[str, Any]:
    """One artifact's entry: accuracy against the reference, outputs' errors, per-layer error (latency added later)."""
    kind = model.manifest.data["model"]["kind"]
    entry: dict[str, Any] = {
        "artifact": str(path.absolute()), "name": path.name,
        "model": {k: model.manifest.data["model"].get(k) for k in ("architecture", "kind", "task")}
        | {"precision": model.manifest.data.get("precision"), "target": model.manifest.data.get("target")},
        "size_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "engines" not in f.parts),
        "measured_on": {"backend": model.backend["name"], "device": "cuda" if "cuda" in model.backend["name"] else "cpu",
                        "threads": threads, "requested": model.backend["requested"], "skipped": model.backend["skipped"]},
    }
    if kind == "seq2seq":
        entry |= seq2seq_metrics(model, ref, rows, errors)
    elif kind == "decoder":
        entry |= decoder_metrics(model, ref, rows, errors)
        rate = greedy_match_rate(model, ref, rows)
        if rate is not None:  # absent when the cache has no room for a continuation
            entry["metrics"]["greedy_match_rate"] = rate
    else:
        entry |= encoder_metrics(model, ref, rows, errors)
    entry["outputs"] = {name: metrics.error_stats(np.concatenate(v)) for name, v in errors.items()}
    # encoder-decoders: the encoder's layers
    entry["layers"] = layer_errors(path, model, ref, rows[:8], threads, "encoder" if kind == "seq2seq" else "model")
    pruning = model.manifest.data.get("pruning")
    if pruning:  # against the original checkpoint, each layer's error is what pruning (and precision) cost there
        entry["pruning"] = prune.summary(pruning)  # the manifest's record; its cost is what compile measured
        if "cost" in entry["pruning"]:
            entry["pruning"]["compile_cost"] = entry["pruning"].pop("cost")
        kept = {r["layer"] + 1: r for r in pruning.get("layers", [])}  # hidden_states[i] is layer i-1's output
        for r in entry["layers"]:
            if r["layer"] in kept:
                r |= {"heads": kept[r["layer"]]["heads"], "ffn": kept[r["layer"]]["ffn"]}
    return entry


def verdict(entry: dict[str, Any], thresholds: dict[str, float]) -> dict[str, Any]:
    """Pass/fail of one entry against the thresholds that apply to its kind (None: no thresholds apply)."""
    from kiln.evaluate import gate

    applicable = {k: v for k, v in thresholds.items()
                  if k != "gate_on" and k != "max_latency_regression_pct" and gate.applies(k, entry)}
    if applicable and "gate_on" in thresholds:
        applicable["gate_on"] = thresholds["gate_on"]
    checks = gate.evaluate(entry, applicable) if applicable else []
    failing = [c.name for c in checks if not c.passed]
    return {"passed": (not failing) if checks else None, "failing": failing,
            "checks": [{"threshold": c.name, "metric": gate.THRESHOLDS[c.name][0], "label": c.label,
                        "limit": c.threshold, "value": c.value, "passed": c.passed} for c in checks]}


def decoder_metrics(model: kr.Model, reference: Reference, rows: list[list[int]],
                    errors: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    terms: list[dict[str, np.ndarray]] = []
    for ids in rows:
        feeds = tasks.row_feeds(ids)
        got = model.run(feeds)["logits"][0].astype(np.float64)
        ref = reference.outputs(ids, feeds)["logits"][0].astype(np.float64)
        errors.setdefault("logits", []).append(np.abs(got - ref).ravel())
        terms.append(metrics.next_token_terms(ref[:-1], got[:-1], np.asarray(ids[1:])))
    summary = metrics.next_token_summary(metrics.concat_terms(terms))
    longest = max(len(t["kl"]) for t in terms)
    per_position = [float(np.mean([t["kl"][i] for t in terms if len(t["kl"]) > i])) for i in range(longest)]
    return {"metrics": summary, "kl_per_position": per_position}


def greedy_match_rate(model: kr.Model, reference: Reference, rows: list[list[int]]) -> float | None:
    """Mean fraction of GREEDY_TOKENS greedy tokens that match Hugging Face ``generate`` before the first
    difference; None when the KV cache has no room for a single new token after the prompts."""
    prompts = [r[:16] for r in rows[:GREEDY_PROMPTS]]
    capacity = model.manifest.data.get("kv_cache", {}).get("capacity", model.max_sequence_length)
    new = max(0, min(GREEDY_TOKENS, capacity - max(map(len, prompts))))
    if new == 0:
        return None
    pad = model.manifest.data.get("generation", {}).get("pad_token_id", 0)
    rates = []
    for p in prompts:
        got = model.generate([p], max_new_tokens=new, stop_token_ids=[])[0][len(p):]
        ref = reference.greedy(p, new, pad)
        same = np.cumprod(got[:len(ref)] == ref[:len(got)])
        rates.append(float(same.sum()) / new)
    return float(np.mean(rates))


def seq2seq_metrics(model: kr.Model, reference: Reference, rows: list[list[int]],
                    errors: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    """Encoder-decoders, per source text: the decoder fed Hugging Face's greedy tokens step by step (teacher forced)
    against its step logits (top-1 agreement, KL, row cosine), then the artifact's own greedy tokens against
    Hugging Face ``generate`` (the fraction matching before the first difference)."""
    pad = int(model.manifest.data.get("generation", {}).get("pad_token_id", 0))
    steps = GREEDY_TOKENS
    agree, kls, cosines, matches = [], [], [], []
    kl_steps: list[list[float]] = [[] for _ in range(steps)]
    for src in rows[:GREEDY_PROMPTS]:
        ids, mask = np.asarray([src], np.int64), np.ones((1, len(src)), np.int64)
        tokens, ref_logits = reference.seq2seq(src, steps, pad)
        runner = model.seq2seq_runner(ids, mask)
        try:
            got = np.stack([runner.step(tokens[None, t:t + 1])[0, -1] for t in range(steps)]).astype(np.float64)
        finally:
            runner.close()
        r = ref_logits.astype(np.float64)
        errors.setdefault("logits", []).append(np.abs(got - r).ravel())
        terms = metrics.next_token_terms(r, got, tokens[1:])
        agree += list(terms["agree"])
        kl = terms["kl"]
        kls += list(kl)
        for t, v in enumerate(kl):
            kl_steps[t].append(float(v))
        cosines.append(float(metrics.row_cosines(r, got).min()))
        own = model.generate(ids, mask, max_new_tokens=steps, stop_token_ids=[], pad_token_id=pad)[0, 1:]
        matches.append(float(np.cumprod(own[:steps] == tokens[1:1 + len(own)]).sum()) / steps)
    return {"metrics": {"top1_agreement": float(np.mean(agree)), "kl_mean": float(np.mean(kls)),
                        "kl_p99": float(np.percentile(kls, 99)), "step_cosine_min": float(min(cosines)),
                        "greedy_match_rate": float(np.mean(matches)), "steps": steps, "texts": len(matches)},
            "kl_per_position": [float(np.mean(v)) for v in kl_steps]}


def encoder_metrics(model: kr.Model, reference: Reference, rows: list[list[int]],
                    errors: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    cos = []
    for ids in rows:
        feeds = make_feeds(*[np.asarray(x) for x in tasks.row_feeds(ids).values()], reference.eager.input_names)
        got = model.run({k: v for k, v in feeds.items() if k in model.input_names})
        ref = reference.outputs(ids, feeds)
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


NORMS = ("RMSNormalization", "SimplifiedLayerNormalization", "LayerNormalization", "SkipSimplifiedLayerNormalization",
         "SkipLayerNormalization")


def layer_errors(root: Path, model: kr.Model, reference: Reference, rows: list[list[int]],
                 threads: int | None = None, graph: str = "model") -> list[dict[str, Any]]:
    """Where the error enters: each layer's output (Hugging Face ``hidden_states``) against the artifact
    tensor that carries it. The graph's sums and norms are exposed as outputs and each hidden state is
    matched to the closest one by value (names do not survive export and fusion); the relative error
    of that tensor is the layer's, averaged over the texts. ``graph``: encoder-decoders' "encoder", whose
    inputs are the artifact's own; where its norms are decomposed (T5's RMS norm ends in a Mul by its weight)
    the products are candidates too."""
    import onnx

    proto = onnx.load(str(root / model.manifest.data["graphs"][graph]))
    kinds = ("Add", *NORMS) + (() if any(n.op_type in NORMS for n in proto.graph.node) else ("Mul",))
    from kiln.passes.pin_norms import value_types

    types = value_types(proto)  # shape arithmetic adds int64s: only FP32 activations are candidates
    names = [o for n in proto.graph.node if n.op_type in kinds for o in n.output[:4]
             if o and types.get(o, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT]
    sess = graphrun.session(graphrun.expose(proto, names), threads)
    wanted = {i.name for i in sess.get_inputs()}
    per_layer: dict[int, list[tuple[str, float]]] = {}
    for ids in rows:
        feeds = tasks.row_feeds(ids)
        # the runtime's own filling of optional inputs (token types, an empty KV cache)
        full = prepare_feeds(model.manifest.inputs, feeds, model.max_sequence_length)
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: v for k, v in full.items() if k in wanted})))
        for layer, ref in enumerate(reference.hidden(ids), 1):
            best = min(((n, float(np.linalg.norm(v.reshape(-1) - ref) / max(np.linalg.norm(ref), 1e-30)))
                        for n, v in got.items() if n in names and v.size == ref.size), key=lambda x: x[1], default=None)
            if best is not None:
                per_layer.setdefault(layer, []).append(best)
    return [{"layer": layer, "tensor": found[0][0], "relative_error": float(np.mean([e for _, e in found]))}
            for layer, found in sorted(per_layer.items())]


def latency_rounds(models: list[kr.Model], rows: list[list[int]], budget_s: float) -> list[dict[str, Any]]:
    """Each artifact's latency at batch 1 on the longest text, timed in LATENCY_ROUNDS alternating rounds (as
    ``kiln bench`` does) so machine drift hits every artifact alike: warm-up, then each round gives every artifact
    an equal share of ``budget_s`` (at least 3 runs)."""
    feeds = tasks.row_feeds(max(rows, key=len))
    seq2seq = "decoder" in models[0].runtimes

    def once(m: kr.Model) -> None:
        if seq2seq:  # what a request costs: the encoder and GREEDY_TOKENS cached decoder steps
            m.generate(feeds["input_ids"], feeds["attention_mask"], max_new_tokens=GREEDY_TOKENS, stop_token_ids=[])
        else:
            m.run(feeds)

    for m in models:
        for _ in range(3):
            once(m)
    samples: list[list[float]] = [[] for _ in models]
    share = budget_s / (LATENCY_ROUNDS * len(models))
    for _ in range(LATENCY_ROUNDS):
        for m, got in zip(models, samples):
            start = time.perf_counter()
            runs = 0
            while runs < 3 or (time.perf_counter() - start < share and runs < 400):
                t = time.perf_counter()
                once(m)
                got.append((time.perf_counter() - t) * 1e3)
                runs += 1
    out = []
    for got in samples:
        s = np.asarray(got)
        out.append({"shape": list(feeds["input_ids"].shape), "runs": len(got), "rounds": LATENCY_ROUNDS,
                    "what": f"encoder + {GREEDY_TOKENS} greedy decoder steps" if seq2seq else "one forward pass",
                    "p50_ms": float(np.percentile(s, 50)), "p90_ms": float(np.percentile(s, 90)),
                    "p99_ms": float(np.percentile(s, 99)), "mean_ms": float(s.mean()),
                    "samples_ms": [round(x, 4) for x in got]})
    return out
