"""The quantization driver (INT8, INT4 and the solvers behind it): builds a recipe's calibrated stages
(SmoothQuant, outlier splitting, the quantizer) from calibration text run through the graph each receives, runs
AWQ's scales and GPTQ's solver on the eager model for INT4, and runs the accuracy-budget search around the
quantizer.

The passes only see the statistics and choices (they never run a model); this module runs ONNX
Runtime on the intermediate graphs. Every INT8 compile calibrates (default text: Python docs
sentences) so that outlier channels can be split off; only dynamic INT8 of a checkpoint without a
tokenizer goes without, with a warning (``needs_data`` says when calibration is required).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.compiler import corpus
from kiln.compiler.layerwise import LayerStream
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import AWQ_METHODS, SOLVED_METHODS, CompileOptions
from kiln.compiler.pipeline import STAGES, ModelFacts, StageData, build_pass, precision_mode
from kiln.compiler.quantize import awq, gptq
from kiln.compiler.quantize import budget as budget_lib
from kiln.compiler.quantize.calibrate import GraphRunner, text_batches
from kiln.errors import CheckpointError, UsageError
from kiln.passes import run_passes
from kiln.passes.calibration import Statistics, ranges
from kiln.passes.quantize_int8 import candidates, weights
from kiln.passes.codes import PROMOTED, Codebook
from kiln.passes.quantize_nbits import weights as blockwise_weights

GPTQ_BATCH = 8
SENSITIVITY_BATCHES = 1
"""INT4 budgets rank the layers on the first calibration batch (16 texts); the candidates are measured on all."""
DECODER_TEXTS = 96
"""Decoders keep every calibration batch's FP32 logits in memory for the budget: cap the texts."""

Progress = Callable[[str], None]


def needs_data(options: CompileOptions) -> bool:
    """Whether this compile cannot go without calibration text (the dynamic INT8 quantizer and INT4 RTN can)."""
    if options.precision == "int4" and options.quant_method in SOLVED_METHODS + AWQ_METHODS:
        return True
    return precision_mode(options) == "int8-static" or bool(
        options.smoothquant is not None or options.max_drop or options.calibration)


class QuantDriver:
    """One per compile: reads and splits the calibration text once, measures each graph it is handed. ``options``
    as the compile resolved them (``options.int4_defaults`` applied)."""

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
        self.awq_info: dict[str, Any] = {}
        self._fake: Any = None
        self.kept_columns: set[str] = set()
        self.promoted_columns: set[str] = set()
        """Column keys of the weights an INT4 budget kept FP32 / promoted to INT8 (the fake-quantized reference too)."""
        self.fp32_columns: set[str] = set()
        """INT4: first-column keys of the weights the quantized graph still multiplies in FP32 (routers, which the pass
        keeps FP32 by what their logits feed): ``fake_quantized`` keeps them FP32 too."""
        self.quantized_columns: set[str] = set()
        """INT4: keys of the weights the pass quantized (MatMul weights before it, minus those still FP32 after):
        ``fake_quantized`` rounds the ones a model holds outside its Linears (stacked experts read one matrix at a
        time) by them."""
        self.embedding_tables: list[list[Any]] | None = None
        """INT4: the tables the pass quantized, ``[name, rows, columns]`` each (every table read at the token ids it
        recognised: the token embedding, a per-layer embedding beside it; a lookup it does not recognise, or a table
        not a whole number of blocks wide, stays FP32): ``fake_quantized`` and ``codes_transform`` round exactly
        these (``rounded_tables``). None before the pass ran: the token embedding, as the precision's rules say."""
        self.named: dict[str, Any] = {}
        """The solver's codes by module name (``kiln export-gptq`` writes them)."""
        self._solved: dict[str, str] = {}
        """Streamed GPTQ: the codebook key of each solved weight, by the shell's parameter name."""
        self._scratch: Any = None
        """Streamed GPTQ: the TemporaryDirectory its codebook lives in (``close`` removes it)."""
        if ckpt.tokenizer is None:
            if needs_data(options):
                raise UsageError(f"calibration reads text through the checkpoint's tokenizer; {ckpt.path} has none "
                                 "(compile --precision int8 without --static/--smoothquant/--max-drop/--calibration, "
                                 "or --precision int4 --quant-method rtn)")
            if options.precision != "int4":  # round-to-nearest INT4 reads no text
                say(f"warning: {ckpt.path} has no tokenizer to read calibration text; dynamic INT8 without outlier "
                    "splitting")
            return
        source = options.calibration or "(default Python docs sentences)"
        cal_texts, held_texts = corpus.split(corpus.read_texts(options.calibration))
        if facts.kind == "decoder":
            cal_texts, held_texts = cal_texts[:DECODER_TEXTS], held_texts[:DECODER_TEXTS // 2]
        self.cal = text_batches(ckpt, cal_texts, source)
        self.held = text_batches(ckpt, held_texts, source)
        self.info = {"texts": len(cal_texts), "heldout_texts": len(held_texts),
                     "tokens": int(sum(f["attention_mask"].sum() for f in self.cal)), "source": source}

    def close(self) -> None:
        """Remove the scratch codebook of a streamed GPTQ (at the end of the compile)."""
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def statistics(self, model: onnx.ModelProto) -> Statistics:
        """Statistics of every quantizable MatMul's input, measured once per graph."""
        if self._stats is None or self._stats[0] is not model:
            if self.ckpt.streamed:
                self._stats = (model, self._streamed_statistics(model))
            else:
                acts = sorted(set(candidates(model).values()))
                self.say(f"calibrate: statistics of {len(acts)} activations on {self.info['tokens']} calibration tokens")
                self._stats = (model, self.run_graph.statistics(model, acts, self.cal))
        return self._stats[1]

    def _streamed_statistics(self, model: onnx.ModelProto) -> Statistics:
        """A streamed checkpoint's activation statistics without the FP32 graph in a session (4.4 GB of weights at
        1.1B): the model runs layer by layer from the checkpoint (``layerwise``) over the calibration feeds, each
        Linear's input channels' largest magnitude over the real tokens recorded under its weight's first column,
        and each graph MatMul finds its activation's statistics by its weight's first column (a packed Q/K/V by Q's).
        Channel maxima only: what outlier splitting reads (the static quantizer's ranges are not streamed)."""
        import torch

        from kiln.compiler import trace
        from kiln.passes.calibration import TensorStats
        from kiln.passes.graph import Graph
        from kiln.passes.quantize_int8 import matmul_weight
        from kiln.passes.codes import weight_key

        stream = LayerStream(self.ckpt, self.say)
        module = trace.graph_module(self.ckpt)
        names = [s.name for s in trace.io_specs(self.ckpt)[0]]
        absmax: dict[str, np.ndarray] = {}
        mask: list[Any] = [None]

        def observe(linear: Any, args: tuple) -> None:
            x = args[0].detach()
            keep = mask[0]
            real = keep is not None and tuple(x.shape[:2]) == tuple(keep.shape)
            rows = x[keep] if real else x.reshape(-1, x.shape[-1])
            ch = rows.abs().amax(0).float().numpy() if rows.numel() else None
            if ch is None:
                return
            key = weight_key(linear.weight.detach().numpy().T[:, :1])
            absmax[key] = ch if key not in absmax else np.maximum(absmax[key], ch)

        def call(f: dict) -> Callable[[], Any]:
            def run() -> Any:
                mask[0] = torch.from_numpy(f["attention_mask"].astype(bool))
                return module(*[torch.from_numpy(f[n]) for n in names if n in f])
            return run

        linears = [m for m in stream.shell.modules() if isinstance(m, torch.nn.Linear)]
        hooks = [m.register_forward_pre_hook(observe) for m in linears]
        self.say(f"calibrate: input channels of every Linear on {self.info['tokens']} calibration tokens, layer by "
                 "layer from the checkpoint")
        try:
            calls = [call(f) for f in self.cal]
            with stream.session():
                states = stream.capture(calls)
                masks = [torch.from_numpy(f["attention_mask"].astype(bool)) for f in self.cal]

                def use_mask(j: int) -> None:
                    mask[0] = masks[j]

                for _, layer in stream.layers_filled("calibrate", len(states)):
                    stream.apply(layer, states, before=use_mask)
                stream.finish(calls, states)
        finally:
            for h in hooks:
                h.remove()
        stats = Statistics()
        g = Graph(model)
        for node in g.g.node:
            w = matmul_weight(g, node, 1024)
            found = absmax.get(weight_key(w[:, :1])) if w is not None else None
            if found is not None and found.shape == (w.shape[0],):
                stats[node.input[0]] = TensorStats(channel_absmax=found)
        self.say(f"calibrate: statistics of {len(stats)} activations")
        return stats

    def run(self, name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
        """Build stage ``name`` from measurements of ``model`` and apply it."""
        stage = STAGES[name]
        if self.cal is None:  # no text: the quantizer alone, from the weights
            if not stage.quantizer:
                return model, [{"name": name, "modified": False, "stats": {},
                                "skipped": [{"where": "graph", "why": "no calibration text (the checkpoint has no tokenizer)"}]}]
            data = StageData(given=self.ckpt.codebook)
            before = self._matmul_weights(model)
            return self._int4_record(*run_passes(model, [build_pass(name, self.facts, self.options, data)],
                                                 progress=self.say), before)
        data = StageData()
        if self.options.precision == "int4":
            if self.ckpt.codebook is not None:
                data.given = self.ckpt.codebook
            elif self.options.quant_method in SOLVED_METHODS:
                data.given = self.solve_gptq()
        if not stage.quantizer or name == "quantize-qdq":
            stats = self.statistics(model)
            data.channel_absmax = {n: s.channel_absmax for n, s in stats.items()}
            if name == "quantize-qdq":
                data.ranges = ranges(stats, self.options.calibration_method)
        result: dict[str, Any] = {}
        if stage.quantizer and self.budget is not None:
            result = self._search(name, model, data)
            data.keep_fp32 = tuple(result["kept_fp32"])
            data.promote_int8 = tuple(result.get("promoted_int8", ()))
        before = self._matmul_weights(model) if stage.quantizer else set()
        out, record = run_passes(model, [build_pass(name, self.facts, self.options, data)], progress=self.say)
        if stage.quantizer:
            record[0]["calibration"] = dict(self.info, **({"method": self.options.calibration_method}
                                                         if data.ranges is not None else {}))
            if result:
                record[0]["budget"] = {k: v for k, v in result.items() if k != "model"}
            return self._int4_record(out, record, before)
        return out, record

    def _matmul_weights(self, model: onnx.ModelProto) -> set[str]:
        """INT4, a checkpoint in memory with matrices outside its Linears (``stacked_params``): the keys of every weight
        a MatMul of ``model`` reads as a constant (the quantizer's candidates); else nothing (nothing to find by key;
        a streamed one's reference is made tensor by tensor, ``codes_transform``)."""
        wanted = self.options.precision == "int4" and not self.ckpt.streamed and next(stacked_params(self.ckpt.model), None) is not None
        return fp32_weight_columns(model) if wanted else set()

    def _int4_record(self, out: onnx.ModelProto, record: list[dict[str, Any]],
                     before: set[str]) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
        """A quantizer's record, with what the manifest says about INT4 (imported codes checked to be all used);
        ``before``: the MatMul weights' keys of the graph it was handed."""
        if self.options.precision == "int4":
            self._check_imported(record[0]["stats"])
            record[0]["int4"] = self.int4_settings(record[0]["stats"])
            self.fp32_columns = fp32_weight_columns(out)
            self.quantized_columns = before - self.fp32_columns
            self.embedding_tables = list(record[0]["stats"].get("embedding_tables") or [])
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
                "act_order": o.act_order and o.quant_method in SOLVED_METHODS, "mixed_bits": bool(o.mixed_bits),
                "symmetric": not o.asym, "grid": stats.get("grid"), "lm_head": stats.get("head"),
                "embedding": stats.get("embedding") or "fp32", "accuracy_level": o.accuracy_level,
                "gptq": self.gptq_info or None, **({"awq": self.awq_info} if self.awq_info else {})}

    def fake_quantized(self) -> Any:
        """The eager model with every weight the INT4 artifact quantizes replaced by what its codes dequantize to
        (GPTQ's solution, round-to-nearest, or an imported checkpoint's; the lm_head and embedding table on the
        pass's grids): the artifact must compute this function up to the kernel's activation rounding."""
        import copy

        import torch

        from kiln.passes.codes import rtn, weight_key

        o = self.options
        rules = build_pass("quantize-nbits", self.facts, o)  # the grid, head and table precision the artifact got
        grid = rules.grid
        model = self._fake
        if model is None:
            model = copy.deepcopy(self.ckpt.model)
            if self.ckpt.codebook is None:  # round-to-nearest: every Linear but the head on the pass's grid, as the
                # graph does (a prediction head's transform before the vocabulary projection included); what the graph
                # still multiplies in FP32 is put back below
                out_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
                for m in (m for m in model.modules() if m is not out_head):
                    if gptq.is_linear(m):
                        conv = not isinstance(m, torch.nn.Linear)
                        w_kn = m.weight.detach().numpy() if conv else m.weight.detach().numpy().T
                        deq = rtn(w_kn, rules.bits, rules.block_size, grid).dequantize()
                        with torch.no_grad():
                            m.weight.copy_(torch.from_numpy(deq if conv else np.ascontiguousarray(deq.T)))

        def tier(w_kn: np.ndarray) -> int | None:
            """The budget's choice for a weight, by its first column: 0 (FP32), 8 (promoted) or None (not moved)."""
            key = weight_key(w_kn[:, :1])
            return 0 if key in self.kept_columns else PROMOTED[0] if key in self.promoted_columns else None

        original = dict(self.ckpt.model.named_modules())
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        with torch.no_grad():  # what the graph still multiplies in FP32 (a router) is FP32 here too
            for name, m in model.named_modules():
                if gptq.is_linear(m) and m is not out_emb and name in original and self.fp32_columns:
                    w0 = original[name].weight.detach()
                    w_kn = w0.numpy() if not isinstance(m, torch.nn.Linear) else w0.numpy().T
                    if weight_key(np.ascontiguousarray(w_kn[:, :1])) in self.fp32_columns:
                        m.weight.copy_(w0)
        with torch.no_grad():
            for name, m in model.named_modules():  # the blocks' Linears (the lm_head below: it may be tied)
                if gptq.is_linear(m) and m is not out_emb and name in original and (self.kept_columns or self.promoted_columns):
                    conv = not isinstance(m, torch.nn.Linear)
                    w0 = original[name].weight.detach()
                    w_kn = w0.numpy() if conv else w0.numpy().T
                    bits = tier(w_kn)
                    if bits == 0:
                        m.weight.copy_(w0)
                    elif bits:  # the pass's promotion: round-to-nearest at PROMOTED
                        deq = rtn(w_kn, *PROMOTED, grid).dequantize()
                        m.weight.copy_(torch.from_numpy(deq if conv else np.ascontiguousarray(deq.T)))
        if self.ckpt.codebook is None and self.quantized_columns:
            self._round_stacked(model, rules, tier)
        head, block = rules.head_bits, rules.head_block_size
        in_emb = model.get_input_embeddings()
        with torch.no_grad():
            if out_emb is not None:
                head_kn = self.ckpt.model.get_output_embeddings().weight.detach().numpy().T
                moved = tier(head_kn)
                head, block = (head, block) if moved is None or rules.head_bits == 0 else (moved, PROMOTED[1])
                codes = self._codebook if self._codebook is not None else self.ckpt.codebook
                solved = moved is None and codes is not None and codes.find(head_kn) is not None
                if out_emb.weight is in_emb.weight:  # tied: the graph quantizes the head and the table separately
                    out_emb.weight = torch.nn.Parameter(in_emb.weight.detach().clone(), requires_grad=False)
                if not solved:  # else the model already holds what the solver's head codes dequantize to
                    w = rtn(head_kn, head, block, grid).dequantize() if head else head_kn
                    out_emb.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
            for table in self.rounded_tables(model) if rules.embedding_bits and rules.form == "matmulnbits" else []:
                e = table.weight.detach().numpy()
                table.weight.copy_(torch.from_numpy(
                    rtn(e.T, rules.embedding_bits, rules.head_block_size, "signed").dequantize().T.copy()))
        self._fake = None
        return model

    def rounded_tables(self, model: Any) -> list[Any]:
        """The embedding modules of ``model`` whose tables the artifact reads quantized: each table the pass
        quantized, found by its parameter name (the traced wrapper's ``model.`` prefix dropped) or, for a table the
        exporter renamed (a tied one), the embedding module of its shape; before the pass, the token embedding."""
        import torch

        if self.embedding_tables is None:
            return [model.get_input_embeddings()]
        named = {f"{n}.weight": m for n, m in model.named_modules(remove_duplicate=False)
                 if isinstance(m, torch.nn.Embedding)}
        out: list[Any] = []
        for name, rows, cols in self.embedding_tables:
            key = next((k for k in (name, name.removeprefix("model.")) if k in named), None)
            found = [named[key]] if key else [m for m in named.values() if tuple(m.weight.shape) == (rows, cols)]
            out += [m for m in found if tuple(m.weight.shape) == (rows, cols) and all(m is not o for o in out)]
        return out

    def _round_stacked(self, model: Any, rules: Any, tier: Callable[[np.ndarray], int | None]) -> None:
        """Round-to-nearest, in place, the matrices of ``model``'s parameters outside its Linears that the graph
        multiplied and the pass quantized (a (experts, out, in) stack whose forward reads ``weight[e]``: each
        expert's matrix found by its key, in either orientation); parameters that Linears view (transformers'
        experts through kiln's dense implementation), the embedding and the head are left to the rest."""
        import torch

        from kiln.passes.codes import rtn, weight_key

        with torch.no_grad():
            for p in stacked_params(model):
                for mat in (p.unsqueeze(0) if p.dim() == 2 else p):
                    for kn, back in ((mat.T, True), (mat, False)):  # F.linear reads it transposed, bmm as is
                        w = np.ascontiguousarray(kn.detach().numpy())
                        if weight_key(w[:, :1]) not in self.quantized_columns:
                            continue
                        bits = tier(w)
                        if bits != 0:
                            deq = rtn(w, bits or rules.bits, PROMOTED[1] if bits else rules.block_size,
                                      rules.grid).dequantize()
                            mat.copy_(torch.from_numpy(np.ascontiguousarray(deq.T if back else deq)))
                        break

    def codes_transform(self) -> Callable[[str, Any], Any]:
        """``fake_quantized`` for a streamed checkpoint, one tensor at a time: (the shell's parameter name, FP32
        value) -> what the artifact's codes dequantize to (GPTQ's codes read back from its codebook; an imported
        checkpoint's Linears as read, already dequantized from its codes; else round-to-nearest on the pass's grids:
        the blocks' Linears, the head and the embedding table as ``fake_quantized`` treats them; anything else
        unchanged)."""
        import torch

        from kiln.compiler import lazy
        from kiln.passes.codes import rtn

        rules = build_pass("quantize-nbits", self.facts, self.options)
        shell = self.ckpt.model
        _, stack = lazy.layer_stack(shell)
        linears = {f"{n}.weight" for n, m in shell.named_modules() if n.startswith(stack + ".") and gptq.is_linear(m)}
        conv = {f"{n}.weight" for n, m in shell.named_modules()
                if f"{n}.weight" in linears and not isinstance(m, torch.nn.Linear)}
        out_emb = shell.get_output_embeddings() if hasattr(shell, "get_output_embeddings") else None
        params = [n for n, _ in shell.named_parameters(remove_duplicate=False) if n.endswith(".weight")]
        heads = {n for n in params if out_emb is not None and shell.get_submodule(n[:-7]) is out_emb}
        rounded = self.rounded_tables(shell)
        tables = {n for n in params if any(shell.get_submodule(n[:-7]) is t for t in rounded)}

        solved = self._solved

        def transform(name: str, value: Any) -> Any:
            if name in solved:  # GPTQ's codes, as solved from this very tensor
                deq = self._codebook.get(solved[name]).dequantize()
                return torch.from_numpy(deq if name in conv else np.ascontiguousarray(deq.T))
            if name in linears and self.ckpt.codebook is not None:  # imported: read as what its codes dequantize to
                return value
            if name in linears:
                w_kn = value.numpy() if name in conv else value.numpy().T
                deq = rtn(w_kn, rules.bits, rules.block_size, rules.grid).dequantize()
                return torch.from_numpy(deq if name in conv else np.ascontiguousarray(deq.T))
            if name in heads:
                if not rules.head_bits:
                    return value
                deq = rtn(value.numpy().T, rules.head_bits, rules.head_block_size, rules.grid).dequantize()
                return torch.from_numpy(np.ascontiguousarray(deq.T))
            if name in tables and rules.embedding_bits and rules.form == "matmulnbits":
                deq = rtn(value.numpy().T, rules.embedding_bits, rules.head_block_size, "signed").dequantize()
                return torch.from_numpy(np.ascontiguousarray(deq.T))
            return value

        return transform

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

    def _solver_windows(self) -> tuple[list[dict], int, int, str]:
        """The calibration split as the solvers' model inputs: (batches, count, window, what they are)."""
        o = self.options
        window = min(o.gptq_window, self.ckpt.max_length)
        texts = corpus.split(corpus.read_texts(o.calibration))[0]
        if self.facts.kind == "encoder":
            batches, n = self._encoder_feeds(texts, window)
        else:
            batches, n = self._decoder_windows(texts, window)
        return batches, n, window, f"{n} texts" if self.facts.kind == "encoder" else f"{n} windows of {window} tokens"

    def _settings(self) -> gptq.Settings:
        o = self.options
        return gptq.Settings(bits=4, group_size=o.group_size, grid="asym" if o.asym else
                             "positive" if o.target == "tensorrt" else "signed", act_order=o.act_order,
                             more_bits=8 if o.mixed_bits else 0)

    def awq(self) -> None:
        """AWQ's scales on the eager model before it is traced (``kiln.compiler.quantize.awq``): the model is
        modified in place and keeps computing the same function; the rounding comes later (the pass, or GPTQ)."""
        batches, n, _, what = self._solver_windows()
        settings = self._settings()
        self.say(f"awq: {what}, group {settings.group_size or 'per-row'}, {settings.grid} grid")
        summary = awq.scale_model(self.ckpt.model, batches, self.facts.num_layers, settings, self.say)
        self.awq_info = {"windows": n, "source": self.options.calibration or "(default Python docs sentences)",
                         "exponents": awq.GRID, "tokens_per_group": awq.TOKENS, **summary}

    def solve_gptq(self) -> Codebook:
        """GPTQ on a copy of the eager model (the original stays FP32 for verification), on windows of the
        calibration text; cached for the compile (one codebook per model)."""
        if self._codebook is not None:
            return self._codebook
        import copy

        o = self.options
        batches, n, window, what = self._solver_windows()
        settings = self._settings()
        head = build_pass("quantize-nbits", self.facts, o).head_bits == settings.bits  # --lm-head int4: solved too
        t0 = time.perf_counter()
        compute = None
        if self.ckpt.streamed:
            compute = gptq.calibration_dtype()
            self.say(f"gptq (streamed, one layer in memory at a time, calibration forward in "
                     f"{str(compute).removeprefix('torch.')}): {what}, group {o.group_size or 'per-row'}, "
                     f"{'act-order, ' if settings.act_order else ''}{settings.grid} grid")
            self._scratch = tempfile.TemporaryDirectory(prefix="kiln-gptq-")
            self._codebook = Codebook(Path(self._scratch.name))
            stream = LayerStream(self.ckpt, self.say)
            self._solved = gptq.quantize_streamed(stream, batches, settings, self._codebook, self.say, head=head,
                                                  compute=compute)
        else:
            self.say(f"gptq: {what}, group {o.group_size or 'per-row'}, "
                     f"{'act-order, ' if settings.act_order else ''}{settings.grid} grid")
            model = copy.deepcopy(self.ckpt.model)
            self._codebook = gptq.quantize_model(model, batches, self.facts.num_layers, settings, self.say,
                                                 named=self.named, head=head)
            self._fake = model  # the solver's weights: what the artifact's codes stand for (verification's second reference)
        self.gptq_info = {"windows": n, "window_tokens": window if self.facts.kind != "encoder" else "one text each",
                          "source": o.calibration or "(default Python docs sentences)",
                          "linears": len(self._codebook), "seconds": round(time.perf_counter() - t0, 1),
                          "damp": settings.damp, "mse_scale_search": settings.mse}
        if compute is not None:
            self.gptq_info.update(streamed=True, calibration_dtype=str(compute).removeprefix("torch."))
        return self._codebook

    def _layers(self, names: list[str]) -> list[list[str]] | None:
        """INT4's budget units: the weights (in graph order) of each Transformer layer, and the lm_head on its own;
        one weight each when the count does not divide into layers."""
        n_layers = self.facts.num_layers
        for extra in (0, 1):
            per, rest = divmod(len(names) - extra, n_layers)
            if per and not rest:
                layers = [names[i * per:(i + 1) * per] for i in range(n_layers)]
                return layers + ([names[-1:]] if extra else [])
        return None

    def _search(self, name: str, fp32: onnx.ModelProto, data: StageData) -> dict[str, Any]:
        def quantized(keep: Sequence[str], promote: Sequence[str]) -> onnx.ModelProto:
            trial = StageData(data.channel_absmax, data.ranges, tuple(keep), given=data.given, promote_int8=tuple(promote))
            return run_passes(fp32, [build_pass(name, self.facts, self.options, trial)])[0]

        quantizable = {"quantize-int8": weights, "quantize-nbits": blockwise_weights}.get(name, lambda m: list(candidates(m)))
        int4 = self.options.precision == "int4"
        result = budget_lib.search(fp32, quantized, self.run_graph, self.cal, self.held, self.budget, self.say, quantizable,
                                   tiers=2 if int4 else 1, units=self._layers(quantizable(fp32)) if int4 else None,
                                   sensitivity_feeds=SENSITIVITY_BATCHES if int4 else None)
        # the fake-quantized reference gives these weights the same precision (every column, packed or not)
        from kiln.passes.graph import Graph
        from kiln.passes.codes import weight_key
        from kiln.passes.quantize_nbits import blockwise_weight

        g = Graph(fp32)
        for names, columns in ((result["kept_fp32"], self.kept_columns), (result.get("promoted_int8", ()), self.promoted_columns)):
            for node in g.g.node:
                if node.op_type == "MatMul" and node.input[1] in names:
                    w = blockwise_weight(g, node, 0)
                    columns |= {weight_key(w[:, c:c + 1]) for c in range(w.shape[1])}
        m = self.budget.metric
        promoted = f"{len(result['promoted_int8'])} promoted to INT8, " if int4 else ""
        self.say(f"{self.options.precision} budget: {promoted}{len(result['kept_fp32'])} of {result['weights']} weights "
                 f"kept FP32; held-out {m} {result[f'heldout_{m}']:.5f} (budget {self.budget.value})")
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
    if "int4" in q:
        i4 = q["int4"]
        out["int4"] = {"method": i4["method"], "group_size": i4["group_size"], "act_order": i4["act_order"],
                       "lm_head": i4["lm_head"], "embedding": i4["embedding"], "from_solver": q["stats"].get("given", 0),
                       "promoted_int8": q["stats"].get("promoted_int8", 0),
                       "more_bits": q["stats"].get("more_bits", 0),
                       "bits_per_weight": q["stats"].get("bits_per_weight")}
    return out


def stacked_params(model: Any) -> Any:
    """The 2-D and 3-D parameters of ``model`` outside its Linears, its embedding and its head, and not viewed by a
    Linear (transformers' experts through kiln's dense implementation): matrices a forward may multiply directly
    (a (experts, out, in) stack read as ``weight[e]``)."""
    skip = {model.get_input_embeddings()}
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        skip.add(model.get_output_embeddings())
    viewed = {m.weight.untyped_storage().data_ptr() for m in model.modules() if gptq.is_linear(m)}
    for module in model.modules():
        if module in skip or gptq.is_linear(module):
            continue
        for p in module.parameters(recurse=False):
            if p.dim() in (2, 3) and p.untyped_storage().data_ptr() not in viewed:
                yield p


def fp32_weight_columns(model: Any) -> set[str]:
    """First-column keys (``codes.weight_key``) of every constant 2-D weight a standard MatMul of ``model``
    still reads."""
    from kiln.passes.graph import Graph
    from kiln.passes.codes import weight_key

    g = Graph(model)
    out = set()
    for node in g.g.node:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and g.is_constant(node.input[1]):
            dims = g.shape_of_constant(node.input[1])
            if dims is not None and len(dims) == 2:
                w = g.constant(node.input[1])
                out.add(weight_key(np.ascontiguousarray(w[:, :1])))
    return out
