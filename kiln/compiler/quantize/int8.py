"""The INT8 driver: builds a recipe's calibrated stages (SmoothQuant, outlier splitting, the quantizer)
from calibration text run through the graph each receives, and runs the accuracy-budget search around
the quantizer.

The passes only see the statistics and choices (they never run a model); this module runs ONNX
Runtime on the intermediate graphs. Every INT8 compile calibrates (default text: Python docs
sentences) so that outlier channels can be split off; only dynamic INT8 of a checkpoint without a
tokenizer goes without, with a warning (``needs_data`` says when calibration is required).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from kiln.compiler import corpus
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import DEFAULT_LM_HEAD, HEAD_BITS, STAGES, ModelFacts, StageData, build_pass, precision_mode
from kiln.compiler.quantize import budget as budget_lib
from kiln.compiler.quantize import gptq
from kiln.compiler.quantize.calibrate import GraphRunner, text_batches
from kiln.errors import CheckpointError, UsageError
from kiln.passes import run_passes
from kiln.passes.calibration import Statistics, ranges
from kiln.passes.quantize_int8 import candidates, weights
from kiln.passes.quantize_nbits import Codebook
from kiln.passes.quantize_nbits import weights as blockwise_weights

GPTQ_BATCH = 8
DECODER_TEXTS = 96
"""Decoders keep every calibration batch's FP32 logits in memory for the budget: cap the texts."""

Progress = Callable[[str], None]


def needs_data(options: CompileOptions) -> bool:
    """Whether this compile cannot go without calibration text (the dynamic INT8 quantizer and INT4 RTN can)."""
    if options.precision == "int4" and options.quant_method == "gptq":
        return True
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
        self._codebook: Codebook | None = None
        self.gptq_info: dict[str, Any] = {}
        self._fake: Any = None
        self.kept_columns: set[str] = set()
        """Column keys of the weights an INT4 budget kept FP32 (the fake-quantized reference leaves them FP32)."""
        self.named: dict[str, Any] = {}
        """The solver's codes by module name (``kiln export-gptq`` writes them)."""
        if ckpt.tokenizer is None:
            if needs_data(options):
                raise UsageError(f"calibration reads text through the checkpoint's tokenizer; {ckpt.path} has none "
                                 "(compile --precision int8 without --static/--smoothquant/--max-drop/--calibration, "
                                 "or --precision int4 --quant-method rtn)")
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
            data = StageData(given=self.ckpt.codebook)
            out, record = run_passes(model, [build_pass(name, self.facts, self.options, data)], progress=self.say)
            if self.options.precision == "int4":
                self._check_imported(record[0]["stats"])
                record[0]["int4"] = self.int4_settings(record[0]["stats"])
            return out, record
        data = StageData()
        if self.options.precision == "int4":
            if self.ckpt.codebook is not None:
                data.given = self.ckpt.codebook
            elif self.options.quant_method == "gptq":
                data.given = self._gptq()
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
            if self.options.precision == "int4":
                self._check_imported(record[0]["stats"])
                record[0]["int4"] = self.int4_settings(record[0]["stats"])
        return out, record

    def _check_imported(self, stats: dict[str, Any]) -> None:
        """An imported checkpoint's layers all run on its own codes, or the compile stops (never requantized)."""
        info = self.ckpt.imported
        if info is not None and stats.get("rounded"):
            raise CheckpointError(
                f"{self.ckpt.source['path']}: {stats['rounded']} quantized weight(s) could not be lowered with the "
                f"checkpoint's own codes (layers packed together, such as Q/K/V, with different act-order g_idx); "
                "kiln will not requantize them: re-export the checkpoint without desc_act")

    def int4_settings(self, stats: dict[str, Any]) -> dict[str, Any]:
        """What the manifest records about an INT4 compile."""
        o = self.options
        if self.ckpt.imported is not None:
            i = self.ckpt.imported
            return {"method": f"imported {i['format']}", "bits": i["bits"], "group_size": i["group_size"],
                    "act_order": bool(i.get("desc_act")), "symmetric": i["sym"], "grid": "checkpoint's",
                    "lm_head": stats.get("head"), "embedding": stats.get("embedding") or "fp32",
                    "accuracy_level": o.accuracy_level, "gptq": None, "layers_imported": i["layers"]}
        return {"method": o.quant_method, "bits": 4, "group_size": o.group_size or "per-row",
                "act_order": o.act_order and o.quant_method == "gptq",
                "symmetric": not o.asym, "grid": stats.get("grid"), "lm_head": stats.get("head"),
                "embedding": stats.get("embedding") or "fp32", "accuracy_level": o.accuracy_level,
                "gptq": self.gptq_info or None}

    def fake_quantized(self) -> Any:
        """The eager model with every weight the INT4 artifact quantizes replaced by what its codes dequantize to
        (GPTQ's solution, round-to-nearest, or an imported checkpoint's; the lm_head and embedding table on the
        pass's grids): the artifact must compute this function up to the kernel's activation rounding."""
        import copy

        import torch

        from kiln.passes.quantize_nbits import rtn

        o = self.options
        grid = "asym" if o.asym else "positive" if o.target == "tensorrt" else "signed"
        model = self._fake
        if model is None:
            model = copy.deepcopy(self.ckpt.model)
            if self.ckpt.codebook is None:  # round-to-nearest: every Linear of the blocks on the pass's grid
                for block in gptq.transformer_blocks(model, self.facts.num_layers):
                    for m in block.modules():
                        if gptq.is_linear(m):
                            conv = not isinstance(m, torch.nn.Linear)
                            w_kn = m.weight.detach().numpy() if conv else m.weight.detach().numpy().T
                            deq = rtn(w_kn, 4, o.group_size, grid).dequantize()
                            with torch.no_grad():
                                m.weight.copy_(torch.from_numpy(deq if conv else np.ascontiguousarray(deq.T)))
        if self.kept_columns:
            from kiln.passes.quantize_nbits import weight_key

            original = dict(self.ckpt.model.named_modules())
            with torch.no_grad():
                for name, m in model.named_modules():
                    if gptq.is_linear(m) and name in original:
                        w0 = original[name].weight.detach()
                        col = (w0[:, :1] if not isinstance(m, torch.nn.Linear) else w0[:1].T).numpy()
                        if weight_key(col) in self.kept_columns:
                            m.weight.copy_(w0)
        head = HEAD_BITS[o.lm_head or DEFAULT_LM_HEAD]
        block = 32 if head == 8 else o.group_size
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        in_emb = model.get_input_embeddings()
        with torch.no_grad():
            if head and out_emb is not None:
                if out_emb.weight is in_emb.weight:  # tied: the graph quantizes the head and the table separately
                    out_emb.weight = torch.nn.Parameter(in_emb.weight.detach().clone(), requires_grad=False)
                w = out_emb.weight.detach().numpy()
                out_emb.weight.copy_(torch.from_numpy(rtn(w.T, head, block, grid).dequantize().T.copy()))
            if self.facts.kind == "decoder" and head and o.target != "tensorrt":
                e = in_emb.weight.detach().numpy()
                in_emb.weight.copy_(torch.from_numpy(rtn(e.T, head, block, "signed").dequantize().T.copy()))
        self._fake = None
        return model

    def _decoder_windows(self, texts: list[str], window: int) -> tuple[list[dict], int]:
        """Decoders: the texts run together (separated by eos) and cut into windows of ``window`` tokens."""
        import torch

        o, tok = self.options, self.ckpt.tokenizer
        sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
        ids: list[int] = []
        for t in texts:
            ids += tok(t, add_special_tokens=False)["input_ids"] + sep
            if len(ids) >= window * o.gptq_windows:
                break
        n = min(len(ids) // window, o.gptq_windows)
        if n == 0:
            raise UsageError(f"GPTQ calibration text {o.calibration or '(default)'} gives {len(ids)} tokens, fewer than "
                             f"one window of {window}; give more text with --calibration")
        rows = torch.tensor(ids[:n * window], dtype=torch.long).view(n, window)
        return [{"input_ids": rows[i:i + GPTQ_BATCH], "attention_mask": torch.ones_like(rows[i:i + GPTQ_BATCH]),
                 "use_cache": False} for i in range(0, n, GPTQ_BATCH)], n

    def _encoder_feeds(self, texts: list[str], window: int) -> tuple[list[dict], int]:
        """Encoders: each text on its own, with the special tokens the model was trained with, no padding (so no
        padded position enters a Hessian); up to twice ``gptq_windows`` texts."""
        import torch

        tok = self.ckpt.tokenizer
        feeds = []
        for t in texts[:2 * self.options.gptq_windows]:
            ids = torch.tensor([tok(t, truncation=True, max_length=window)["input_ids"]], dtype=torch.long)
            feeds.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return feeds, len(feeds)

    def _gptq(self) -> Codebook:
        """GPTQ on a copy of the eager model (the original stays FP32 for verification), on windows of the
        calibration text; cached for the compile (one codebook per model)."""
        if self._codebook is not None:
            return self._codebook
        import copy

        o = self.options
        window = min(o.gptq_window, self.ckpt.max_length)
        texts = corpus.split(corpus.read_texts(o.calibration))[0]
        if self.facts.kind == "encoder":
            batches, n = self._encoder_feeds(texts, window)
        else:
            batches, n = self._decoder_windows(texts, window)
        settings = gptq.Settings(bits=4, group_size=o.group_size, grid="asym" if o.asym else
                                 "positive" if o.target == "tensorrt" else "signed", act_order=o.act_order)
        what = f"{n} texts" if self.facts.kind == "encoder" else f"{n} windows of {window} tokens"
        self.say(f"gptq: {what}, group {o.group_size or 'per-row'}, "
                 f"{'act-order, ' if settings.act_order else ''}{settings.grid} grid")
        t0 = time.perf_counter()
        model = copy.deepcopy(self.ckpt.model)
        self._codebook = gptq.quantize_model(model, batches, self.facts.num_layers, settings, self.say, named=self.named)
        self._fake = model  # the solver's weights: what the artifact's codes stand for (verification's second reference)
        self.gptq_info = {"windows": n, "window_tokens": window if self.facts.kind != "encoder" else "one text each",
                          "source": o.calibration or "(default Python docs sentences)",
                          "linears": len(self._codebook), "seconds": round(time.perf_counter() - t0, 1),
                          "damp": settings.damp, "mse_scale_search": settings.mse}
        return self._codebook

    def _search(self, name: str, fp32: onnx.ModelProto, data: StageData) -> dict[str, Any]:
        def quantized(keep: Sequence[str]) -> onnx.ModelProto:
            trial = StageData(data.channel_absmax, data.ranges, tuple(keep), given=data.given)
            return run_passes(fp32, [build_pass(name, self.facts, self.options, trial)])[0]

        quantizable = {"quantize-int8": weights, "quantize-nbits": blockwise_weights}.get(name, lambda m: list(candidates(m)))
        result = budget_lib.search(fp32, quantized, self.run_graph, self.cal, self.held, self.budget, self.say, quantizable)
        if result["kept_fp32"]:  # the fake-quantized reference keeps these FP32 as well (every column, packed or not)
            from kiln.passes.graph import Graph
            from kiln.passes.quantize_nbits import blockwise_weight, weight_key

            g = Graph(fp32)
            for node in g.g.node:
                if node.op_type == "MatMul" and node.input[1] in result["kept_fp32"]:
                    w = blockwise_weight(g, node, 0)
                    self.kept_columns |= {weight_key(w[:, c:c + 1]) for c in range(w.shape[1])}
        m = self.budget.metric
        self.say(f"{self.options.precision} budget: {len(result['kept_fp32'])} of {result['weights']} weights kept FP32; held-out {m} "
                 f"{result[f'heldout_{m}']:.5f} (budget {self.budget.value})")
        return result


def check_group_size(ckpt: Checkpoint, options: CompileOptions) -> None:
    """INT4's group size fits every layer: checked once the model is loaded, before anything is traced."""
    g = options.group_size
    smallest = min((gptq.in_features(m) for m in ckpt.model.modules() if gptq.is_linear(m)), default=None)
    if g and smallest is not None and g > smallest:
        raise UsageError(f"--group-size {g} is larger than the smallest layer input ({smallest} features) of "
                         f"{ckpt.path}; give --group-size {1 << (smallest.bit_length() - 1)} or less")


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
    if "int4" in q:
        i4 = q["int4"]
        out["int4"] = {"method": i4["method"], "group_size": i4["group_size"], "act_order": i4["act_order"],
                       "lm_head": i4["lm_head"], "embedding": i4["embedding"], "from_solver": q["stats"].get("given", 0)}
    return out
