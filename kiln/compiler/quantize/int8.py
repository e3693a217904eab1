"""The INT8 driver: builds a recipe's calibrated stages (SmoothQuant, outlier splitting, the quantizer)
from calibration text run through the graph each receives, and runs the accuracy-budget search around
the quantizer.

The passes only see the statistics and choices (they never run a model); this module runs ONNX
Runtime on the intermediate graphs. Every INT8 compile calibrates (default text: Python docs
sentences) so that outlier channels can be split off; only dynamic INT8 of a checkpoint without a
tokenizer goes without, with a warning (``needs_data`` says when calibration is required).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnx

from kiln.compiler import corpus
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import STAGES, ModelFacts, StageData, build_pass, precision_mode
from kiln.compiler.quantize import budget as budget_lib
from kiln.compiler.quantize.calibrate import GraphRunner, text_batches
from kiln.errors import UsageError
from kiln.passes import run_passes
from kiln.passes.calibration import Statistics, ranges
from kiln.passes.quantize_int8 import candidates, weights
from kiln.passes.quantize_nbits import weights as blockwise_weights

DECODER_TEXTS = 96
"""Decoders keep every calibration batch's FP32 logits in memory for the budget: cap the texts."""

Progress = Callable[[str], None]


def needs_data(options: CompileOptions) -> bool:
    """Whether this INT8 compile cannot go without calibration text (the dynamic quantizer alone can)."""
    return precision_mode(options) == "int8-static" or bool(
        options.smoothquant is not None or options.max_drop or options.calibration)


class Driver:
    """One per compile: reads and splits the calibration text once, measures each graph it is handed."""

    def __init__(self, ckpt: Checkpoint, facts: ModelFacts, options: CompileOptions, say: Progress) -> None:
        self.ckpt, self.facts, self.options, self.say = ckpt, facts, options, say
        self.budget = budget_lib.parse_budget(options.max_drop, facts.kind) if options.max_drop else None
        self.run_graph = GraphRunner(facts, options.threads)
        self.cal: list[dict] | None = None
        self.held: list[dict] = []
        self.info: dict[str, Any] = {}
        self._stats: tuple[onnx.ModelProto, Statistics] | None = None
        if ckpt.tokenizer is None:
            if needs_data(options):
                raise UsageError(f"INT8 calibration reads text through the checkpoint's tokenizer; {ckpt.path} has none "
                                 "(compile --precision int8 without --static/--smoothquant/--max-drop/--calibration)")
            say(f"warning: {ckpt.path} has no tokenizer to read calibration text; dynamic INT8 without outlier splitting")
            return
        source = options.calibration or "(default Python docs sentences)"
        cal_texts, held_texts = corpus.split(corpus.read_texts(options.calibration))
        if facts.kind == "decoder":
            cal_texts, held_texts = cal_texts[:DECODER_TEXTS], held_texts[:DECODER_TEXTS // 2]
        self.cal = text_batches(ckpt, cal_texts, source)
        self.held = text_batches(ckpt, held_texts, source)
        self.info = {"texts": len(cal_texts), "heldout_texts": len(held_texts),
                     "tokens": int(sum(f["attention_mask"].sum() for f in self.cal)), "source": source}

    def statistics(self, model: onnx.ModelProto) -> Statistics:
        """Statistics of every quantizable MatMul's input, measured once per graph."""
        if self._stats is None or self._stats[0] is not model:
            acts = sorted(set(candidates(model).values()))
            self.say(f"calibrate: statistics of {len(acts)} activations on {self.info['tokens']} calibration tokens")
            self._stats = (model, self.run_graph.statistics(model, acts, self.cal))
        return self._stats[1]

    def run(self, name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
        """Build stage ``name`` from measurements of ``model`` and apply it."""
        stage = STAGES[name]
        if self.cal is None:  # no text: the quantizer alone, from the weights
            if not stage.quantizer:
                return model, [{"name": name, "modified": False, "stats": {},
                                "skipped": [{"where": "graph", "why": "no calibration text (the checkpoint has no tokenizer)"}]}]
            return run_passes(model, [build_pass(name, self.facts, self.options)], progress=self.say)
        data = StageData()
        if not stage.quantizer or name == "quantize-qdq":
            stats = self.statistics(model)
            data.channel_absmax = {n: s.channel_absmax for n, s in stats.items()}
            if name == "quantize-qdq":
                data.ranges = ranges(stats, self.options.calibration_method)
        result: dict[str, Any] = {}
        if stage.quantizer and self.budget is not None:
            result = self._search(name, model, data)
            data.keep_fp32 = tuple(result["kept_fp32"])
        out, record = run_passes(model, [build_pass(name, self.facts, self.options, data)], progress=self.say)
        if stage.quantizer:
            record[0]["calibration"] = dict(self.info, **({"method": self.options.calibration_method}
                                                         if data.ranges is not None else {}))
            if result:
                record[0]["budget"] = {k: v for k, v in result.items() if k != "model"}
        return out, record

    def _search(self, name: str, fp32: onnx.ModelProto, data: StageData) -> dict[str, Any]:
        def quantized(keep: Sequence[str]) -> onnx.ModelProto:
            trial = StageData(data.channel_absmax, data.ranges, tuple(keep))
            return run_passes(fp32, [build_pass(name, self.facts, self.options, trial)])[0]

        quantizable = {"quantize-int8": weights, "quantize-nbits": blockwise_weights}.get(name, lambda m: list(candidates(m)))
        result = budget_lib.search(fp32, quantized, self.run_graph, self.cal, self.held, self.budget, self.say, quantizable)
        m = self.budget.metric
        self.say(f"int8 budget: {len(result['kept_fp32'])} of {result['weights']} weights kept FP32; held-out {m} "
                 f"{result[f'heldout_{m}']:.5f} (budget {self.budget.value})")
        return result


def cost_and_gain(record: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any] | None:
    """What INT8 cost (accuracy against eager FP32, and the budget's held-out measurement) next to
    what it bought (speed against eager), for the report and the CLI summary."""
    q = next((p for p in record if STAGES.get(p["name"]) and STAGES[p["name"]].quantizer), None)
    if q is None:
        return None
    outs = report.get("summary", {})
    cosines = [s["cosine_min"] for s in outs.values() if s.get("cosine_min") is not None]
    top1s = [s["top1_agreement"] for s in outs.values() if s.get("top1_agreement") is not None]
    out = {"pass": q["name"], "quantized": q["stats"].get("quantized", 0), "kept_fp32": q["stats"].get("kept_fp32", 0),
           "cosine_min_vs_eager": min(cosines, default=None), "top1_vs_eager": min(top1s, default=None),
           "speedup_vs_eager": (report.get("latency") or {}).get("speedup")}
    if "calibration" in q:
        out["calibration"] = {k: q["calibration"][k] for k in ("method", "texts", "tokens") if k in q["calibration"]}
    if "budget" in q:
        b = q["budget"]
        out["budget"] = {"metric": b["metric"], "value": b["budget"], "heldout": b[f"heldout_{b['metric']}"]}
    return out
