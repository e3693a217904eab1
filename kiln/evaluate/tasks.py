"""Task metrics on labelled data: what ``kiln report --eval FILE`` measures, for an artifact and for its reference
checkpoint on the same token ids, with the drop between them and a paired bootstrap interval of it.

An evaluation file is JSONL, one example a line; its fields say the task (or ``--eval-task`` does):

==============================  ===============  ==================================================================
fields                          task             metrics
==============================  ===============  ==================================================================
``text``, ``label``             classification   accuracy, macro-F1 (sequence classifiers; a label is its id or
                                                 its name in the checkpoint's ``id2label``)
``tokens``, ``tags``            token_          entity F1 (micro, exact spans from BIO tags as conlleval reads
                                classification   them) and tag accuracy, a word's tag predicted on its first
                                                 token (token classifiers)
``prompt``, ``choices``,        multiple_choice  accuracy: the choice whose tokens the model gives the highest
``answer``                                       log-likelihood after the prompt and one space, split as
                                                 lm-evaluation-harness splits them (decoders; the answer is an
                                                 index or one of the choices)
``prompt``, ``answer``          exact_match      exact match of the greedy continuation's first line (both
                                                 case-folded, without surrounding quotes, spaces and final
                                                 punctuation)
``source``, ``reference``       translation      BLEU and chrF (sacrebleu, corpus level) of greedy outputs
                                summarization    ROUGE-1/2/L F1 (rouge-score), with ``--eval-task summarization``
``text``                        perplexity       perplexity of the texts (decoders)
==============================  ===============  ==================================================================

This module runs the artifact side through ``kiln.runtimes`` only (numpy, no torch): a scorer is anything with the
three methods of :class:`Scorer`. ``kiln.evaluate.report`` gives the reference checkpoint's scorer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kiln.errors import UsageError
from kiln.runtimes.sampling import log_softmax

TASKS = ("classification", "token_classification", "multiple_choice", "exact_match", "translation", "summarization",
         "perplexity")
MAX_EVAL_BYTES = 64 << 20
MAX_FIELD_CHARS = 20_000
MAX_CHOICES = 26
BOOTSTRAP = 1000
"""Paired bootstrap resamples of a drop's interval (200 for corpus metrics, which are recomputed per resample)."""
CORPUS_BOOTSTRAP = 200
CONFIDENCE = 0.95

# metric -> (label, higher is better); the order a report prints them
METRICS: dict[str, tuple[str, bool]] = {
    "accuracy": ("accuracy", True), "f1_macro": ("macro-F1", True), "entity_f1": ("entity F1", True),
    "exact_match": ("exact match", True),
    "bleu": ("BLEU", True), "chrf": ("chrF", True), "rouge1": ("ROUGE-1", True), "rouge2": ("ROUGE-2", True),
    "rouge_l": ("ROUGE-L", True), "perplexity": ("perplexity", False),
}


class Scorer(Protocol):
    """One model as the tasks see it, on token ids of the artifact's tokenizer."""

    def classify(self, ids: list[int]) -> np.ndarray:
        """Class logits (labels,) of one text; token classifiers: (len(ids), labels)."""

    def logits(self, ids: list[int]) -> np.ndarray:
        """Next-token logits (len(ids), vocab) of one sequence (decoders)."""

    def generate(self, ids: list[int], new: int) -> list[int]:
        """``new`` greedy tokens after ``ids`` (decoders) or from source ``ids`` (encoder-decoders), no stop."""


@dataclass
class EvalSet:
    path: Path
    task: str
    rows: list[dict[str, Any]]
    max_new_tokens: int = 32
    chat: bool = False
    """Prompts (and sources for decoders) go through the model's chat template as one user message."""


@dataclass
class Outcome:
    """One model's per-example results on one set: what the metrics are computed from."""

    task: str
    values: dict[str, np.ndarray] = field(default_factory=dict)  # per-example numbers (correct, nll, ...)
    texts: list[str] = field(default_factory=list)  # generated outputs (translation, summaries, exact match)
    predictions: list[Any] = field(default_factory=list)


def infer_task(keys: set[str]) -> str | None:
    if {"tokens", "tags"} <= keys:
        return "token_classification"
    if {"prompt", "choices", "answer"} <= keys:
        return "multiple_choice"
    if {"prompt", "answer"} <= keys:
        return "exact_match"
    if {"source", "reference"} <= keys:
        return "translation"
    if {"text", "label"} <= keys:
        return "classification"
    if "text" in keys:
        return "perplexity"
    return None


FIELDS = {"classification": ("text", "label"), "token_classification": ("tokens", "tags"), "multiple_choice": ("prompt", "choices", "answer"),
          "exact_match": ("prompt", "answer"), "translation": ("source", "reference"),
          "summarization": ("source", "reference"), "perplexity": ("text",)}


def read_eval(path: str | Path, task: str | None = None, max_examples: int = 1000) -> EvalSet:
    """A JSONL evaluation file, bounded (size, examples, field length) and checked line by line before use."""
    p = Path(path)
    if task is not None and task not in TASKS:
        raise UsageError(f"--eval-task {task} is not one of {', '.join(TASKS)}")
    if not p.is_file():
        raise UsageError(f"--eval {path} does not exist; give a JSONL file, one example a line")
    if p.stat().st_size > MAX_EVAL_BYTES:
        raise UsageError(f"--eval {path} is over {MAX_EVAL_BYTES >> 20} MiB; give a smaller evaluation set")
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        if len(rows) >= max_examples:
            break
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise UsageError(f"--eval {path}:{number} is not a JSON object ({e}); write one JSON object a line") from e
        if not isinstance(row, dict):
            raise UsageError(f"--eval {path}:{number} is not a JSON object; write one JSON object a line")
        if task is None:
            task = infer_task(set(row))
            if task is None:
                raise UsageError(f"--eval {path}:{number} has fields {sorted(row)[:8]}, which name no task; use text+label, "
                                 "prompt+choices+answer, prompt+answer, source+reference or text, or pass --eval-task")
        rows.append(_checked(row, task, f"--eval {path}:{number}"))
    if not rows:
        raise UsageError(f"--eval {path} has no examples; write one JSON object a line")
    return EvalSet(p, task or "perplexity", rows)


def _text(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: \"{key}\" must be a non-empty string")
    if len(value) > MAX_FIELD_CHARS:
        raise UsageError(f"{where}: \"{key}\" is over {MAX_FIELD_CHARS} characters; shorten it")
    return value


def _checked(row: dict[str, Any], task: str, where: str) -> dict[str, Any]:
    missing = [k for k in FIELDS[task] if k not in row]
    if missing:
        raise UsageError(f"{where}: a {task} example needs {', '.join(FIELDS[task])}; \"{missing[0]}\" is missing")
    if task == "classification":
        label = row["label"]
        if isinstance(label, bool) or not isinstance(label, (int, str)) or (isinstance(label, int) and label < 0):
            raise UsageError(f"{where}: \"label\" must be a class id (0, 1, ...) or a label name")
        return {"text": _text(row, "text", where), "label": label}
    if task == "token_classification":
        words, tags = row["tokens"], row["tags"]
        if not isinstance(words, list) or not isinstance(tags, list) or not words or len(words) != len(tags) or \
                len(words) > 512:
            raise UsageError(f"{where}: \"tokens\" and \"tags\" must be lists of the same length (1 to 512 words)")
        if not all(isinstance(w, str) and w and len(w) <= 200 for w in words) or not all(
                isinstance(t, str) and 0 < len(t) <= 64 for t in tags):
            raise UsageError(f"{where}: every word and tag must be a non-empty string (words up to 200 characters)")
        return {"tokens": words, "tags": tags}
    if task == "multiple_choice":
        choices = row["choices"]
        if not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES:
            raise UsageError(f"{where}: \"choices\" must be a list of 2 to {MAX_CHOICES} strings")
        texts = [_text({"c": c}, "c", f"{where} choice {i}") for i, c in enumerate(choices)]
        answer = row["answer"]
        if isinstance(answer, str) and answer in texts:
            answer = texts.index(answer)
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(texts):
            raise UsageError(f"{where}: \"answer\" must be an index into \"choices\" (0 to {len(texts) - 1}) or one of them")
        return {"prompt": _text(row, "prompt", where), "choices": texts, "answer": answer}
    if task == "exact_match":
        return {"prompt": _text(row, "prompt", where), "answer": _text(row, "answer", where)}
    if task in ("translation", "summarization"):
        return {"source": _text(row, "source", where), "reference": _text(row, "reference", where)}
    return {"text": _text(row, "text", where)}


# ---- running one model on a set -----------------------------------------------------------------------------------

def continuation(encode: Callable[[str], list[int]], context: str, cont: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and of its continuation, as lm-evaluation-harness splits them: a context's trailing
    spaces move to the continuation, the whole is tokenised once and the continuation is what follows the context's
    own tokens (so a word is not split differently than the model saw it)."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, cont = context[:-spaces], context[-spaces:] + cont
    whole, ctx = encode(context + cont), encode(context)
    if whole[:len(ctx)] != ctx:  # the join merged across the boundary: tokenise the parts apart
        return ctx, encode(cont)
    return ctx, whole[len(ctx):]


def loglikelihood(scorer: Scorer, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log p(cont | ctx) and whether every continuation token is the greedy one."""
    ids = ctx + cont
    lp = log_softmax(scorer.logits(ids)[len(ctx) - 1:len(ids) - 1])
    picked = lp[np.arange(len(cont)), cont]
    return float(picked.sum()), bool(np.all(lp.argmax(-1) == np.asarray(cont)))


@dataclass
class Text:
    """The artifact's tokenizer and generation facts, shared by both models' runs."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    stop: Sequence[int]
    labels: dict[str, int]  # label name -> class id
    limit: int  # tokens a sequence may hold
    chat: Callable[[str], str] | None = None  # one user message through the chat template, ready for the answer
    framed: Callable[[str], list[int]] | None = None  # with the tokenizer's special tokens ([CLS] .. [SEP], </s>)
    words: Callable[[list[str]], tuple[list[int], list[int | None]]] | None = None  # pre-split words, word of each token

    def cut(self, tokens: Sequence[int]) -> str:
        """Generated tokens up to the first stop token, decoded; its first non-empty line, stripped."""
        out: list[int] = []
        for t in tokens:
            if int(t) in self.stop:
                break
            out.append(int(t))
        lines = [line.strip() for line in self.decode(out).splitlines() if line.strip()]
        return lines[0] if lines else ""

    def inputs(self, text: str) -> list[int]:
        """A classifier's text or an encoder-decoder's source as the model takes it: with the tokenizer's special
        tokens (decoders' prompts and continuations are scored without them, as lm-evaluation-harness does)."""
        return self.framed(text) if self.framed else self.encode(text)

    def prompt(self, s: EvalSet, prompt: str) -> str:
        if not s.chat:
            return prompt
        if self.chat is None:
            raise UsageError(f"--eval-chat: the artifact has no chat template to render {s.path}'s prompts; drop "
                             "--eval-chat")
        return self.chat(prompt)


def normalized(answer: str) -> str:
    """An answer as exact match compares it: case-folded, without surrounding spaces, quotes and final punctuation."""
    return answer.strip().strip("\"'`").rstrip(".!?,;:").strip().casefold()


def run_set(scorer: Scorer, s: EvalSet, text: Text, seq2seq: bool = False) -> Outcome:
    out = Outcome(s.task)
    if s.task == "token_classification":
        if text.words is None:
            raise UsageError(f"--eval {s.path}: this artifact's tokenizer cannot take pre-split words")
        names = {i: n for n, i in text.labels.items()}
        counts, correct, total = [], [], []
        for row in s.rows:
            for tag in row["tags"]:
                if tag not in text.labels:
                    raise UsageError(f"--eval {s.path}: tag {tag!r} is not one of the model's labels "
                                     f"({', '.join(sorted(text.labels)[:8])}); use its id2label names")
            ids, word_of = text.words(row["tokens"])
            if len(ids) > text.limit:
                raise UsageError(f"--eval {s.path}: a sentence of {len(row['tokens'])} words takes {len(ids)} tokens, "
                                 f"more than the model's {text.limit}; split it")
            logits = np.asarray(scorer.classify(ids)).reshape(len(ids), -1)
            first: dict[int, int] = {}
            for t, w in enumerate(word_of):
                if w is not None and w not in first:
                    first[w] = t
            pred = [names.get(int(np.argmax(logits[first[w]])), "O") if w in first else "O"
                    for w in range(len(row["tokens"]))]
            out.predictions.append(pred)
            gold_spans, pred_spans = entities(row["tags"]), entities(pred)
            tp = len(gold_spans & pred_spans)
            counts.append((tp, len(pred_spans) - tp, len(gold_spans) - tp))
            correct.append(sum(p == g for p, g in zip(pred, row["tags"])))
            total.append(len(pred))
        out.values = {"tp_fp_fn": np.asarray(counts, float), "correct": np.asarray(correct, float),
                      "words": np.asarray(total, float)}
    elif s.task == "classification":
        correct, preds, golds = [], [], []
        for row in s.rows:
            pred = int(np.argmax(scorer.classify(text.inputs(row["text"])[:text.limit])))
            gold = label_id(row["label"], text.labels, s.path)
            preds.append(pred)
            golds.append(gold)
            correct.append(float(pred == gold))
        out.values = {"correct": np.asarray(correct), "pred": np.asarray(preds), "gold": np.asarray(golds)}
        out.predictions = preds
    elif s.task == "multiple_choice":
        correct = []
        for row in s.rows:
            scores = []
            prompt = text.prompt(s, row["prompt"])
            for choice in row["choices"]:
                # the choice follows the prompt after one space, lm-evaluation-harness' default target delimiter
                # (a chat template's answer header takes it as it is)
                ctx, cont = continuation(text.encode, prompt, choice if s.chat else " " + choice)
                if not ctx or not cont or len(ctx) + len(cont) > text.limit:
                    raise UsageError(f"--eval {s.path}: a prompt and choice take {len(ctx) + len(cont)} tokens (the "
                                     f"model holds {text.limit}) or tokenise to nothing; shorten the prompt")
                scores.append(loglikelihood(scorer, ctx, cont)[0])
            out.predictions.append(int(np.argmax(scores)))
            correct.append(float(out.predictions[-1] == row["answer"]))
        out.values = {"correct": np.asarray(correct)}
    elif s.task == "exact_match":
        correct = []
        for row in s.rows:
            got = text.cut(scorer.generate(_prompt(text, text.prompt(s, row["prompt"]), s), s.max_new_tokens))
            out.texts.append(got)
            correct.append(float(normalized(got) == normalized(row["answer"])))
        out.values = {"correct": np.asarray(correct)}
    elif s.task in ("translation", "summarization"):
        for row in s.rows:
            ids = text.inputs(row["source"]) if seq2seq else _prompt(text, text.prompt(s, row["source"]), s)
            out.texts.append(text.cut(scorer.generate(ids[:text.limit], s.max_new_tokens)))
        if s.task == "summarization":
            out.values = rouge_rows(out.texts, [r["reference"] for r in s.rows])
    else:
        nll, count = [], []
        for row in s.rows:
            ids = text.encode(row["text"])[:text.limit]
            if len(ids) < 2:
                nll.append(0.0)
                count.append(0.0)
                continue
            lp = log_softmax(scorer.logits(ids)[:-1])
            nll.append(-float(lp[np.arange(len(ids) - 1), ids[1:]].sum()))
            count.append(float(len(ids) - 1))
        if not sum(count):
            raise UsageError(f"--eval {s.path}: no text has two or more tokens; give real text")
        out.values = {"nll": np.asarray(nll), "count": np.asarray(count)}
    return out


def _prompt(text: Text, prompt: str, s: EvalSet) -> list[int]:
    ids = text.encode(prompt)
    if not ids or len(ids) + s.max_new_tokens > text.limit:
        raise UsageError(f"--eval {s.path}: a prompt takes {len(ids)} tokens and {s.max_new_tokens} more are generated; "
                         f"the model holds {text.limit}: shorten the prompt")
    return ids


def entities(tags: Sequence[str]) -> set[tuple[int, int, str]]:
    """(start, end, type) spans of BIO tags as conlleval reads them: B-X starts an entity, I-X continues one of type X
    and starts one after anything else; O and unprefixed tags are outside."""
    spans: set[tuple[int, int, str]] = set()
    start, kind = None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, name = tag.partition("-") if "-" in tag else ("O", "", "")
        inside = prefix in ("I", "E") and kind == name and start is not None
        if start is not None and not inside:
            spans.add((start, i, kind or ""))
            start, kind = None, None
        if prefix in ("B", "S") or (prefix in ("I", "E") and not inside):
            start, kind = i, name
    return spans


def label_id(label: int | str, labels: dict[str, int], path: Path) -> int:
    if isinstance(label, int):
        if labels and label not in labels.values():
            raise UsageError(f"--eval {path}: label {label} is not a class of this model (it has {len(labels)}); "
                             "use the checkpoint's class ids")
        return label
    if label not in labels:
        known = ", ".join(sorted(labels)[:8])
        raise UsageError(f"--eval {path}: label {label!r} is not one of the model's labels ({known}); use its id2label "
                         "names or class ids")
    return labels[label]


# ---- metrics and intervals ----------------------------------------------------------------------------------------

def f1_macro(pred: np.ndarray, gold: np.ndarray) -> float:
    """Mean F1 over the classes that occur in the gold labels or the predictions."""
    scores = []
    for c in np.union1d(pred, gold):
        tp = float(np.sum((pred == c) & (gold == c)))
        fp, fn = float(np.sum((pred == c) & (gold != c))), float(np.sum((pred != c) & (gold == c)))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(scores))


def rouge_rows(hyps: list[str], refs: list[str]) -> dict[str, np.ndarray]:
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:
        raise UsageError("ROUGE needs rouge-score: pip install 'kiln[eval]'") from e
    sc = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rows = [sc.score(r, h) for h, r in zip(hyps, refs)]
    return {"rouge1": np.asarray([100 * r["rouge1"].fmeasure for r in rows]),
            "rouge2": np.asarray([100 * r["rouge2"].fmeasure for r in rows]),
            "rouge_l": np.asarray([100 * r["rougeL"].fmeasure for r in rows])}


def _sacrebleu() -> Any:
    try:
        import sacrebleu
    except ImportError as e:
        raise UsageError("BLEU and chrF need sacrebleu: pip install 'kiln[eval]'") from e
    return sacrebleu


def metric_values(out: Outcome, s: EvalSet, idx: np.ndarray) -> dict[str, float]:
    """The set's metrics over the examples ``idx`` (all of them, or a bootstrap resample)."""
    v = out.values
    if s.task == "token_classification":
        tp, fp, fn = v["tp_fp_fn"][idx].sum(0)
        # no entity in the gold tags or the predictions: nothing to measure (NaN; absent from the report)
        return {"entity_f1": float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else math.nan,
                "accuracy": float(v["correct"][idx].sum() / max(v["words"][idx].sum(), 1.0))}
    if s.task == "classification":
        return {"accuracy": float(v["correct"][idx].mean()), "f1_macro": f1_macro(v["pred"][idx], v["gold"][idx])}
    if s.task == "multiple_choice":
        return {"accuracy": float(v["correct"][idx].mean())}
    if s.task == "exact_match":
        return {"exact_match": float(v["correct"][idx].mean())}
    if s.task == "translation":
        sb = _sacrebleu()
        hyps, refs = [out.texts[i] for i in idx], [[s.rows[i]["reference"] for i in idx]]
        return {"bleu": float(sb.corpus_bleu(hyps, refs).score), "chrf": float(sb.corpus_chrf(hyps, refs).score)}
    if s.task == "summarization":
        return {k: float(v[k][idx].mean()) for k in ("rouge1", "rouge2", "rouge_l")}
    return {"perplexity": float(math.exp(v["nll"][idx].sum() / max(v["count"][idx].sum(), 1.0)))}


def compare(art: Outcome, ref: Outcome, s: EvalSet, seed: int = 0) -> dict[str, Any]:
    """The artifact's metrics beside the reference's, each drop (reference - artifact where higher is better;
    artifact - reference for perplexity) in absolute and relative terms, and paired bootstrap intervals
    (``CONFIDENCE``) of the artifact's value and of the drop: both models resampled on the same examples."""
    n = len(s.rows)
    everything = np.arange(n)
    value, reference = metric_values(art, s, everything), metric_values(ref, s, everything)
    rounds = CORPUS_BOOTSTRAP if s.task == "translation" else BOOTSTRAP
    rng = np.random.default_rng(seed)
    value = {k: v for k, v in value.items() if math.isfinite(v) and math.isfinite(reference[k])}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in value}
    for _ in range(rounds):
        idx = rng.integers(0, n, n)
        a, r = metric_values(art, s, idx), metric_values(ref, s, idx)
        for k in value:
            samples[k].append((a[k], _drop(k, a[k], r[k])))
    lo, hi = 100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2
    metrics = {}
    for k in value:
        got = np.asarray(samples[k])
        got = got[np.isfinite(got).all(1)]  # a resample may hold no entity at all
        drop = _drop(k, value[k], reference[k])
        metrics[k] = {"value": value[k], "reference": reference[k], "drop": drop,
                      "drop_pct": 100.0 * drop / abs(reference[k]) if reference[k] else None,
                      "interval": [float(np.percentile(got[:, 0], lo)), float(np.percentile(got[:, 0], hi))],
                      "drop_interval": [float(np.percentile(got[:, 1], lo)), float(np.percentile(got[:, 1], hi))],
                      "higher_is_better": METRICS[k][1]}
    entry: dict[str, Any] = {"data": str(s.path.absolute()), "name": s.path.name, "task": s.task, "examples": n,
                             "bootstrap": {"resamples": rounds, "confidence": CONFIDENCE, "seed": seed},
                             "metrics": metrics}
    if art.texts:
        entry["samples"] = [{"output": a, "reference_output": b} for a, b in zip(art.texts[:5], ref.texts[:5])]
    return entry


def _drop(metric: str, value: float, reference: float) -> float:
    return reference - value if METRICS[metric][1] else value - reference


# ---- the artifact's side (kiln.runtimes, no torch) -----------------------------------------------------------------

def row_feeds(ids: list[int]) -> dict[str, np.ndarray]:
    """One unpadded row: its ids and an all-ones mask."""
    arr = np.asarray([ids], np.int64)
    return {"input_ids": arr, "attention_mask": np.ones_like(arr)}


class ArtifactScorer:
    """A loaded artifact as a :class:`Scorer`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.kind = model.manifest.data["model"]["kind"]
        self.pad = int((model.manifest.data.get("generation") or {}).get("pad_token_id", 0))

    def classify(self, ids: list[int]) -> np.ndarray:
        got = self.model.run(row_feeds(ids))
        name = "logits" if "logits" in got else next(iter(got))
        return np.asarray(got[name])[0]

    def logits(self, ids: list[int]) -> np.ndarray:
        return np.asarray(self.model.run(row_feeds(ids))["logits"][0])

    def generate(self, ids: list[int], new: int) -> list[int]:
        if self.kind == "seq2seq":
            f = row_feeds(ids)
            out = self.model.generate(f["input_ids"], f["attention_mask"], max_new_tokens=new, stop_token_ids=[],
                                      pad_token_id=self.pad)
            return [int(t) for t in out[0, 1:]]
        out = self.model.generate([ids], max_new_tokens=new, stop_token_ids=[], pad_token_id=self.pad)
        return [int(t) for t in out[0][len(ids):]]


def text_of(model: Any) -> Text:
    """The tokenizer, stop tokens, labels and length limit of a loaded artifact."""
    data = model.manifest.data
    labels = {str(v): int(k) for k, v in (data["model"].get("labels") or {}).items()}
    cache = (data.get("kv_cache") or {}).get("capacity")
    enc = model.text_encoder
    chat = (lambda prompt: model.chat_prompt([{"role": "user", "content": prompt}])) if enc.has_chat_template else None
    limit = int(min(model.max_sequence_length, cache or model.max_sequence_length))

    def framed(text: str) -> list[int]:
        return [int(t) for t in enc.encode([text], limit, truncate=True)["input_ids"][0]]

    return Text(enc.encode_ids, lambda ids: enc.decode(ids), [int(t) for t in (data.get("generation") or {}).get(
        "eos_token_ids", [])], labels, limit, chat, framed, enc.encode_words)


def check_task(s: EvalSet, data: dict[str, Any], path: Path) -> None:
    """Refuse a set the artifact cannot answer, naming both (``data``: the artifact's manifest)."""
    kind = data["model"]["kind"]
    wants = {"classification": ("encoder",), "token_classification": ("encoder",), "multiple_choice": ("decoder",), "perplexity": ("decoder",),
             "exact_match": ("decoder", "seq2seq"), "translation": ("decoder", "seq2seq"),
             "summarization": ("decoder", "seq2seq")}[s.task]
    if kind not in wants:
        raise UsageError(f"--eval {s.path} is a {s.task} set but {path} is a {kind} artifact; {s.task} needs a "
                         f"{' or '.join(wants)} artifact (give the right artifact, or pass --eval-task)")
    if s.task in ("classification", "token_classification") and not data["model"].get("labels"):
        raise UsageError(f"--eval {s.path} is a classification set but {path} has no classification head (no labels); "
                         "compile the checkpoint with its sequence-classification head")
