"""INT8 at compile time: the FP32 passes, then calibration text through the FP32 graph, SmoothQuant,
outlier channels, activation ranges, the accuracy-budget search, and the quantizer with what they chose.

The passes only see the statistics and choices (they never run a model); this module runs ONNX
Runtime on the intermediate graphs. Every INT8 compile calibrates (default text: Python docs
sentences) so that outlier channels can be split off; only dynamic INT8 of a checkpoint without a
tokenizer goes without, with a warning (``needs_data`` says when calibration is required).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from kiln.compiler import cases as case_lib
from kiln.compiler import quantize
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import ModelFacts
from kiln.compiler.trace import io_specs
from kiln.errors import UsageError
from kiln.passes import Pass, run_passes
from kiln.passes.calibration import Statistics, expose, ranges
from kiln.passes.quantize_int8 import QuantizeDynamicInt8, candidates, weights
from kiln.passes.quantize_qdq import QuantizeStaticQDQ
from kiln.passes.smoothquant import SmoothQuant
from kiln.passes.split_outliers import SplitOutlierChannels

QUANTIZERS = ("quantize-int8", "quantize-qdq")
BATCH = 16
MAX_TOKENS = 128
DECODER_TEXTS = 96
"""Decoders keep every calibration batch's FP32 logits in memory for the budget: cap the texts."""

Progress = Callable[[str], None]


def needs_data(options: CompileOptions) -> bool:
    """Whether this INT8 compile cannot go without calibration text (the dynamic quantizer alone can)."""
    return options.precision == "int8" and bool(options.static or options.smoothquant is not None or options.max_drop
                                                  or options.target == "tensorrt" or options.calibration)


def text_batches(ckpt: Checkpoint, texts: Sequence[str], tok: Any, source: str) -> list[dict[str, np.ndarray]]:
    """Tokenised texts, padded on the model's side in batches. A text needs at least two tokens that are
    neither special nor unknown (one token predicting the next); others are dropped."""
    inputs = [s.name for s in io_specs(ckpt)[0]]
    limit = min(ckpt.max_length, MAX_TOKENS)
    ignore = set(tok.all_special_ids) | ({tok.unk_token_id} if tok.unk_token_id is not None else set())
    rows = [r for r in (tok(t, add_special_tokens=True, truncation=True, max_length=limit)["input_ids"] for t in texts)
            if sum(i not in ignore for i in r) >= 2]
    if not rows:
        raise UsageError(f"calibration text {source} has no usable tokens for {ckpt.path}'s tokenizer ({len(texts)} "
                         "texts, none with two known tokens); give real sentences in the model's language")
    pad, side = case_lib.pad_token_id(ckpt, tok), case_lib.padding_side(ckpt)
    return [case_lib.make_feeds(*case_lib._pad(rows[i:i + BATCH], pad, side), inputs) for i in range(0, len(rows), BATCH)]


class Runner:
    """Runs an intermediate graph on calibration feeds: the compared output (pooled rows or logits),
    or named intermediate values for calibration statistics."""

    def __init__(self, facts: ModelFacts, threads: int | None) -> None:
        import onnxruntime as ort

        self.facts = facts
        self.opts = ort.SessionOptions()
        self.opts.intra_op_num_threads = threads or 0
        self.ort = ort

    def _session(self, model: onnx.ModelProto):
        return self.ort.InferenceSession(model.SerializeToString(), self.opts, providers=["CPUExecutionProvider"])

    def _feeds(self, sess: Any, f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for i in sess.get_inputs():
            if i.name in f:
                out[i.name] = f[i.name]
            elif i.name.startswith("past_key_values."):  # an empty KV cache: the whole text is the prompt
                out[i.name] = np.zeros((len(f["input_ids"]), self.facts.num_kv_heads, 0, self.facts.head_size), np.float32)
        return out

    def __call__(self, model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
        sess = self._session(model)
        names = [o.name for o in sess.get_outputs()]
        rows = []
        for f in feeds:
            out = dict(zip(names, sess.run(None, self._feeds(sess, f))))
            if self.facts.kind == "decoder":
                rows.append(out["logits"])
            elif "sentence_embedding" in out:
                rows.append(out["sentence_embedding"])
            else:
                first = out[names[0]]
                m = f["attention_mask"][..., None]
                rows.append((first * m).sum(1) / m.sum(1) if first.ndim == 3 else first)
        return rows

    def statistics(self, model: onnx.ModelProto, names: Sequence[str], feeds: list[dict[str, np.ndarray]]) -> Statistics:
        sess = self._session(expose(model, names))
        outs = [o.name for o in sess.get_outputs()]
        stats = Statistics()
        for f in feeds:
            got = dict(zip(outs, sess.run(None, self._feeds(sess, f))))
            # padding positions are not the model's data: only real tokens shape the ranges
            keep = f["attention_mask"].astype(bool)
            stats.observe({n: got[n][keep] if got[n].shape[:2] == keep.shape else got[n] for n in names})
        return stats


def quantize_graph(ckpt: Checkpoint, graph: onnx.ModelProto, passes: list[Pass], facts: ModelFacts,
                   options: CompileOptions, say: Progress) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    cut = next(i for i, p in enumerate(passes) if p.name in QUANTIZERS)
    quantizer = passes[cut]
    budget = quantize.parse_budget(options.max_drop, facts.kind) if options.max_drop else None
    tok = case_lib.load_hf_tokenizer(ckpt.path)
    if tok is None and not needs_data(options):
        say(f"warning: {ckpt.path} has no tokenizer to read calibration text; dynamic INT8 without outlier splitting")
        return run_passes(graph, passes, options.disabled_passes, say)
    if tok is None:
        raise UsageError(f"INT8 calibration reads text through the checkpoint's tokenizer; {ckpt.path} has none "
                         "(compile --precision int8 without --static/--smoothquant/--max-drop)")
    source = options.calibration or "(default Python docs sentences)"
    texts = quantize.read_texts(options.calibration)
    cal_texts, held_texts = quantize.split(texts)
    if facts.kind == "decoder":
        cal_texts, held_texts = cal_texts[:DECODER_TEXTS], held_texts[:DECODER_TEXTS // 2]
    cal = text_batches(ckpt, cal_texts, tok, source)
    held = text_batches(ckpt, held_texts, tok, source)
    fp32, record = run_passes(graph, passes[:cut], options.disabled_passes, say)
    run = Runner(facts, options.threads)
    acts = sorted(set(candidates(fp32).values()))
    info: dict[str, Any] = {"texts": len(cal_texts), "heldout_texts": len(held_texts),
                            "tokens": int(sum(f["attention_mask"].sum() for f in cal)), "source": source}
    say(f"calibrate: statistics of {len(acts)} activations on {info['tokens']} calibration tokens")
    stats = run.statistics(fp32, acts, cal)
    if options.smoothquant is not None:
        fp32, smooth = run_passes(fp32, [SmoothQuant({n: s.channel_absmax for n, s in stats.items()}, options.smoothquant)],
                                  options.disabled_passes, say)
        record += smooth
        stats = run.statistics(fp32, sorted(set(candidates(fp32).values())), cal)
    if options.outlier_ratio:
        fp32, split = run_passes(fp32, [SplitOutlierChannels({n: s.channel_absmax for n, s in stats.items()},
                                                             options.outlier_ratio)], options.disabled_passes, say)
        record += split
        if split[0].get("modified"):  # the quantized MatMuls now read the masked activations
            stats = run.statistics(fp32, sorted(set(candidates(fp32).values())), cal)
    act_ranges = None
    if isinstance(quantizer, QuantizeStaticQDQ):
        act_ranges = ranges(stats, options.calibration_method)
        info["method"] = options.calibration_method

    def quantized(keep: Sequence[str]) -> onnx.ModelProto:
        return run_passes(fp32, [make_quantizer(quantizer, act_ranges, tuple(keep))])[0]

    result: dict[str, Any] = {}
    if budget is not None:
        names = (lambda m: weights(m, quantizer.min_elements)) if isinstance(quantizer, QuantizeDynamicInt8) else \
            (lambda m: list(candidates(m, quantizer.min_elements)))
        result = quantize.search(fp32, quantized, run, cal, held, budget, say, names)
        m = budget.metric
        say(f"int8 budget: {len(result['kept_fp32'])} of {result['weights']} weights kept FP32; held-out {m} "
            f"{result[f'heldout_{m}']:.5f} (budget {budget.value})")
    rest = [make_quantizer(quantizer, act_ranges, tuple(result.get("kept_fp32", ()))), *passes[cut + 1:]]
    model, tail = run_passes(fp32, rest, options.disabled_passes, say)
    tail[0]["calibration"] = info
    if result:
        tail[0]["budget"] = {k: v for k, v in result.items() if k != "model"}
    return model, record + tail


def make_quantizer(template: Pass, act_ranges: dict[str, tuple[float, float]] | None, keep: tuple[str, ...]) -> Pass:
    if isinstance(template, QuantizeStaticQDQ):
        return QuantizeStaticQDQ(act_ranges, symmetric=template.symmetric, keep_fp32=keep, min_elements=template.min_elements)
    assert isinstance(template, QuantizeDynamicInt8)
    return QuantizeDynamicInt8(keep_fp32=keep, min_elements=template.min_elements)


def cost_and_gain(record: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any] | None:
    """What INT8 cost (accuracy against eager FP32, and the budget's held-out measurement) next to
    what it bought (speed against eager), for the report and the CLI summary."""
    q = next((p for p in record if p["name"] in QUANTIZERS), None)
    if q is None:
        return None
    outs = report.get("summary", {})
    out = {"pass": q["name"], "quantized": q["stats"].get("quantized", 0), "kept_fp32": q["stats"].get("kept_fp32", 0),
           "cosine_min_vs_eager": min((s["cosine_min"] for s in outs.values()), default=None),
           "top1_vs_eager": min((s["top1_agreement"] for s in outs.values() if "top1_agreement" in s), default=None),
           "speedup_vs_eager": (report.get("latency") or {}).get("speedup")}
    if "calibration" in q:
        out["calibration"] = {k: q["calibration"][k] for k in ("method", "texts", "tokens") if k in q["calibration"]}
    if "budget" in q:
        b = q["budget"]
        out["budget"] = {"metric": b["metric"], "value": b["budget"], "heldout": b[f"heldout_{b['metric']}"]}
    return out
