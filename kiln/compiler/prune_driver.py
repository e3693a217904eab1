"""``--prune`` run on a loaded checkpoint: calibration text read and split, the ratio chosen under ``--max-drop``
(``--prune auto``), the eager model pruned (``kiln.compiler.prune``), and what it cost against the original on
held-out text and in latency. The pruned checkpoint then compiles like any other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.compiler import options as options_lib
from kiln.compiler import trace
from kiln.compiler.facts import model_facts
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import ModelFacts
from kiln.compiler.verify import cases as case_lib
from kiln.compiler.verify.parity import median_latency_ms
from kiln.errors import UsageError

Progress = Callable[[str], None]


def prune_checkpoint(ckpt: Checkpoint, options: CompileOptions, say: Progress) -> Checkpoint:
    """``--prune``: the eager model loses heads and FFN channels chosen on calibration text (the artifact is then
    verified against the pruned model); the cost against the original is measured on held-out text."""
    import copy
    from dataclasses import replace

    from kiln.compiler import corpus
    from kiln.compiler import prune as prune_lib

    spec = options_lib.parse_prune(options.prune, options.prune_method, options.prune_layers)
    if ckpt.kind == "seq2seq" or ckpt.codebook is not None:
        raise UsageError(f"--prune: {ckpt.path} is {'an encoder-decoder' if ckpt.kind == 'seq2seq' else 'already quantized'}"
                         "; kiln prunes encoder-only and decoder-only FP32 checkpoints")
    facts = model_facts(ckpt)
    cal, held = corpus.split(corpus.read_texts(options.calibration))
    feeds = prune_lib.torch_feeds(ckpt, cal[:64]) if ckpt.tokenizer is not None and spec.method != "magnitude" else []
    if spec.method != "magnitude" and not feeds:
        raise UsageError(f"--prune-method {spec.method} reads calibration text through the tokenizer; {ckpt.path} "
                         "has none (use --prune-method magnitude)")
    original = copy.deepcopy(ckpt.model) if ckpt.tokenizer is not None else None  # the cost needs text
    auto = None
    if spec.auto:
        if original is None:
            raise UsageError(f"--prune auto measures --max-drop on text through the tokenizer; {ckpt.path} has none")
        from kiln.compiler.quantize.budget import parse_budget

        budget = parse_budget(options.max_drop, ckpt.kind)
        spec, auto = auto_ratio(original, facts, spec, budget, prune_lib.torch_feeds(ckpt, cal[:64]), feeds, say)
    record = prune_lib.prune(ckpt.model, facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_size, spec,
                             feeds, say, kv_cache=facts.kind == "decoder")
    if original is not None:
        record["cost"] = prune_lib.cost(original, ckpt.model, prune_lib.torch_feeds(ckpt, held[:64]), ckpt.kind)
        say(f"prune cost on {record['cost']['texts']} held-out texts vs the original: "
            + ", ".join(f"{k} {v:.4g}" for k, v in record["cost"].items() if k != "texts"))
    if auto is not None:
        from kiln.compiler.quantize.budget import AccuracyBudgetError

        auto["heldout"] = record["cost"][prune_lib.COST_KEYS[budget.metric]]
        record["auto"] = auto
        if not budget.holds(auto["heldout"]):
            raise AccuracyBudgetError(
                f"--prune auto --max-drop {options.max_drop}: heads {auto['heads']:.3g} / FFN {auto['ffn']:.3g} met it on calibration "
                f"({auto['calibration']:.5g}) but not on held-out text ({auto['heldout']:.5g}); loosen the budget")
    if original is not None:  # the speed side of the cost: the original eager model, timed as verification times
        inputs = [s.name for s in trace.io_specs(ckpt)[0]]
        feeds = case_lib.latency_feeds(ckpt, inputs, options.latency_shape, options.seed)
        record["original_eager_ms"] = median_latency_ms(trace.EagerRunner(replace(ckpt, model=original)), feeds,
                                                        budget_s=options.latency_budget_s / 2)
    del original
    return replace(ckpt, pruning=record)


AUTO_STEPS = 32
"""``--prune auto``'s resolution: FFN ratios in steps of 1/32."""
AUTO_MARGIN = 0.5
"""Calibration must meet half the allowed drop: pruning's worst case moves more between splits than INT8's (MiniLM
FFN 1/16: calibration min cosine 0.9878, held-out 0.9778; the INT8 budget's three-quarters let that through)."""


def auto_ratio(original: Any, facts: ModelFacts, spec: Any, budget: Any, cal: list[dict[str, Any]],
               stats_feeds: list[dict[str, Any]], say: Progress) -> tuple[Any, dict[str, Any]]:
    """``--prune auto``: the largest ratio whose cost on the calibration split meets ``--max-drop`` with half of the
    allowed drop to spare (``AUTO_MARGIN``), by bisection over ``AUTO_STEPS`` steps: step k removes k/AUTO_STEPS of the FFN
    channels and the same fraction of heads rounded down to what a layer can lose (per KV group for grouped-query
    models, else per head), so the first steps prune FFN channels only."""
    import copy
    from dataclasses import replace

    from kiln.compiler import prune as prune_lib
    from kiln.compiler.quantize.budget import AccuracyBudgetError

    group = facts.num_heads // facts.num_kv_heads
    levels = group if group > 1 else facts.num_heads
    values: dict[int, float] = {}

    def ratios(k: int) -> tuple[float, float]:
        return (k * levels // AUTO_STEPS) / levels, k / AUTO_STEPS

    def meets(k: int) -> bool:
        if k not in values:
            trial = copy.deepcopy(original)
            heads, ffn = ratios(k)
            prune_lib.prune(trial, facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_size,
                            replace(spec, heads=heads, ffn=ffn, auto=False), stats_feeds, lambda m: None,
                            kv_cache=facts.kind == "decoder")
            values[k] = prune_lib.cost(original, trial, cal, facts.kind)[prune_lib.COST_KEYS[budget.metric]]
            say(f"prune auto: heads {heads:.3g}, FFN {ffn:.3g} -> calibration {budget.metric} {values[k]:.5g}")
        return budget.drop(values[k]) <= AUTO_MARGIN * budget.limit

    lo, hi = 0, AUTO_STEPS  # lo meets (nothing pruned); hi would leave nothing
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    if lo == 0:
        raise AccuracyBudgetError(
            f"--prune auto --max-drop {budget.metric}={budget.value}: even the smallest step (1/{AUTO_STEPS} of the "
            f"FFN channels) measures {budget.metric} {values[1]:.5g} on calibration text; loosen the budget or give --prune ratios")
    heads, ffn = ratios(lo)
    return (replace(spec, heads=heads, ffn=ffn, auto=False),
            {"metric": budget.metric, "budget": budget.value, "heads": heads, "ffn": ffn, "calibration": values[lo],
             "candidates": len(values)})
