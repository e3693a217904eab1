"""The accuracy budget: which weights go up a precision tier so that a measured accuracy drop holds.

``--max-drop METRIC=VALUE``, measured against the FP32 graph on calibration text:
- ``cosine=V`` (encoders): every text's pooled output keeps cosine >= V;
- ``ppl=P`` (decoders): perplexity rises by at most P percent;
- ``top1=A`` (decoders): the next-token argmax agrees on at least a fraction A of positions;
- ``kl=K`` (decoders): the mean KL divergence of next-token distributions is at most K.
Tiers: INT8 weights go to FP32; INT4 weights go to INT8 first, then to FP32.
Procedure:
1. quantize everything; if the calibration split meets the budget with a quarter of the allowed drop
   to spare, that is the choice;
2. otherwise measure each weight's sensitivity (quantize it alone, record the metric) and rank the weights, most
   sensitive first. INT8: the first k ranked weights go FP32, for the smallest k that meets the budget on
   calibration with that margin. INT4: the smallest k ranked weights go INT8; if even all-INT8 misses, the
   smallest j go FP32 with the rest INT8, then as few of the rest stay INT8 as still meet it (the others back to
   INT4). Each smallest k is found by bisection (a few measurements, not one per weight: the drop shrinks as
   weights go up a tier);
3. measure the chosen graph once on the held-out split (texts never used above) and record it.
If even the FP32-heavy end of the search misses, or only all weights in FP32 meet it, the compile fails and
says how close it got. Texts are split by a hash of their content (``kiln.compiler.corpus.split``), so the
split does not depend on file order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from kiln.compiler.options import parse_max_drop
from kiln.compiler.verify import metrics
from kiln.errors import KilnError, UsageError
from kiln.passes.quantize_int8 import candidates

log = logging.getLogger(__name__)


class AccuracyBudgetError(KilnError):
    """No choice of precision per weight meets the requested accuracy drop."""


@dataclass(frozen=True)
class Budget:
    metric: str
    value: float

    def drop(self, measured: float) -> float:
        """How far from lossless a measurement is, in the budget's units (0 = identical to FP32)."""
        return 1.0 - measured if self.metric in ("cosine", "top1") else measured

    @property
    def limit(self) -> float:
        return self.drop(self.value)

    def holds(self, measured: float) -> bool:
        return self.drop(measured) <= self.limit + 1e-12

    def measure(self, ref: list[np.ndarray], got: list[np.ndarray], feeds: list[dict[str, np.ndarray]]) -> float:
        if self.metric == "cosine":
            return metrics.min_cosine(np.concatenate(ref), np.concatenate(got))
        return next_token_metrics(ref, got, feeds)[self.metric]


LABELS = {"cosine": "minimum cosine", "ppl": "perplexity increase (%)", "top1": "top-1 agreement", "kl": "mean KL"}


def parse_budget(text: str, kind: str | None = None) -> Budget:
    """``--max-drop`` (checked in ``kiln.compiler.options``) as the budget the search holds."""
    return Budget(*parse_max_drop(text, kind))


def next_token_metrics(ref: list[np.ndarray], got: list[np.ndarray], feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Perplexity increase (%), top-1 agreement and mean KL(FP32 || quantized) over the real next-token positions.

    ``ref``/``got``: logits (batch, seq, vocab) per feed; a position counts when it and the next token are not padding."""
    terms = []
    for r, g, f in zip(ref, got, feeds):
        mask = f["attention_mask"].astype(bool)
        valid = mask[:, :-1] & mask[:, 1:]
        terms.append(metrics.next_token_terms(r[:, :-1][valid], g[:, :-1][valid], f["input_ids"][:, 1:][valid]))
    summary = metrics.next_token_summary(metrics.concat_terms(terms))
    if summary is None:
        raise UsageError("the calibration text gives no next-token positions; give texts of at least two tokens")
    return {"ppl": summary["ppl_increase_pct"], "top1": summary["top1_agreement"], "kl": summary["kl_mean"]}


Run = Callable[[onnx.ModelProto, list[dict[str, np.ndarray]]], list[np.ndarray]]
Quantized = Callable[[Sequence[str], Sequence[str]], onnx.ModelProto]
"""``quantized(keep_fp32, promote)``: the graph with ``keep_fp32`` in FP32 and ``promote`` one tier up (INT8)."""


def search(fp32: onnx.ModelProto, quantized: Quantized, run: Run,
           cal: list[dict[str, np.ndarray]], held: list[dict[str, np.ndarray]], budget: Budget,
           say: Callable[[str], None], quantizable: Callable[[onnx.ModelProto], list[str]] = lambda m: list(candidates(m)),
           tiers: int = 1, units: Sequence[Sequence[str]] | None = None, sensitivity_feeds: int | None = None
           ) -> dict[str, Any]:
    """Choose each weight's tier. ``quantized(keep, promote)`` builds the quantized graph; ``run(model, feeds)``
    returns the compared output per feed (pooled rows, or logits); ``quantizable`` lists the weights the quantizer
    can take (default: the weight MatMuls); ``tiers``: 1 (INT8 -> FP32) or 2 (INT4 -> INT8 -> FP32);
    ``units``: groups of weights ranked together (INT4: one Transformer layer's weights, the lm_head; default one
    weight each); ``sensitivity_feeds``: rank on the first so many calibration batches (the candidates are measured
    on all). Sensitivity: one tier (INT8 -> FP32) the drop with the unit alone quantized; two tiers the gain of
    promoting the unit alone to INT8 from all-INT4 (graphs mostly INT4: fast to build and run)."""
    if tiers not in (1, 2):
        raise ValueError(f"tiers is 1 or 2, not {tiers}")
    names = quantizable(fp32)
    ref_cal, ref_held = run(fp32, cal), run(fp32, held)
    rank_cal = cal[:sensitivity_feeds] if sensitivity_feeds else cal
    ref_rank = ref_cal[:len(rank_cal)]
    groups = [list(u) for u in units] if units is not None else [[n] for n in names]
    if sorted(n for u in groups for n in u) != sorted(names):
        raise ValueError("budget units must cover every quantizable weight once")

    def measured(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], ref: list[np.ndarray]) -> float:
        return budget.measure(ref, run(model, feeds), feeds)

    # aim past the budget on calibration (a quarter of the allowed drop to spare), so held-out text holds it too
    target = 0.75 * budget.limit
    values: dict[tuple[tuple[str, ...], tuple[str, ...]], float] = {}

    def meets(keep: Sequence[str], promote: Sequence[str]) -> bool:
        key = (tuple(sorted(keep)), tuple(sorted(promote)))
        if key not in values:
            values[key] = measured(quantized(*key), cal, ref_cal)
            if values.keys() - {((), ())}:
                up = f"{len(key[1])} INT8, " if tiers == 2 else ""
                say(f"budget: {up}{len(key[0])} FP32 -> calibration {budget.metric} {values[key]:.5g}")
        return budget.drop(values[key]) <= target

    def first(candidate: Callable[[int], tuple[list[str], list[str]]], lo: int, hi: int) -> int:
        """Bisection: the smallest c in (lo, hi] whose candidate meets the target (lo misses; hi is the fallback)."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if meets(*candidate(mid)) else (mid, hi)
        return hi

    def ranked(score: Callable[[list[str]], float], label: str) -> tuple[list[str], dict[str, float]]:
        """Units by ``score`` (measured on ``rank_cal``), highest first; the weights in that order."""
        say(f"budget: {label} of {len(groups)} unit(s), {len(names)} weights, on "
            f"{sum(len(f['input_ids']) for f in rank_cal)} calibration texts")
        t0, step, sens = time.perf_counter(), max(1, len(groups) // 10), {}
        for i, unit in enumerate(groups, 1):
            sens.update(dict.fromkeys(unit, score(unit)))
            if i % step == 0 or i == len(groups):
                say(f"budget: {label} {i}/{len(groups)}, {time.perf_counter() - t0:.0f}s")
        return [n for u in sorted(groups, key=lambda u: -sens[u[0]]) for n in u], sens

    def rank_drop(keep: list[str], promote: list[str]) -> float:
        return budget.drop(measured(quantized(keep, promote), rank_cal, ref_rank))

    sens: dict[str, float] = {}
    sens_fp32: dict[str, float] = {}
    order: list[str] = []
    keep, promote = [], []
    if not meets(keep, promote) and names:  # only then is it worth ranking the weights
        n = len(names)
        if tiers == 1:  # sensitivity: the drop with the unit alone quantized, the rest FP32
            order, sens = ranked(lambda u: rank_drop([x for x in names if x not in u], []), "sensitivity")
            keep = order[:first(lambda c: (order[:c], []), 0, n)]
        else:  # sensitivity: what promoting the unit alone to INT8 gains, from all-INT4
            base = rank_drop([], [])
            order, sens = ranked(lambda u: base - rank_drop([], u), "INT8 gain")
            promote = order[:first(lambda c: ([], order[:c]), 0, n)]
            if not meets(keep, promote):  # all-INT8 misses: rank again, by what FP32 gains from all-INT8
                base = rank_drop([], names)
                order32, by_name = ranked(lambda u: base - rank_drop(u, [x for x in names if x not in u]), "FP32 gain")
                sens_fp32 = {x: by_name[x] for x in order32}
                j = first(lambda c: (order32[:c], order32[c:]), 0, n)
                keep = order32[:j]
                rest = [x for x in order if x not in keep]
                promote = rest
                if j < n:  # then as few INT8 among the rest as still meet it (the others back to INT4)
                    k = 0 if meets(keep, []) else first(lambda c: (keep, rest[:c]), 0, len(rest))
                    promote = rest[:k]
        meets(keep, promote)
    cal_value = values[(tuple(sorted(keep)), tuple(sorted(promote)))]
    model = quantized(keep, promote)
    held_value = measured(model, held, ref_held)
    m = budget.metric
    result = {"metric": m, "budget": budget.value, "weights": len(names), "kept_fp32": keep,
              **({"promoted_int8": promote} if tiers == 2 else {}), "measured_candidates": len(values),
              f"calibration_{m}": cal_value, f"heldout_{m}": held_value,
              "units": len(groups), "sensitivity": {n: float(f"{sens[n]:.6g}") for n in order},
              **({"sensitivity_fp32": {n: float(f"{v:.6g}") for n, v in sens_fp32.items()}} if sens_fp32 else {})}
    if names and len(keep) == len(names) and budget.holds(held_value):
        raise AccuracyBudgetError(
            f"--max-drop {m}={budget.value} is met only with all {len(names)} weights in FP32 (nothing left to quantize); "
            f"loosen the budget or compile --precision fp32")
    if not budget.holds(held_value):
        raise AccuracyBudgetError(
            f"--max-drop {m}={budget.value} not met: with {len(keep)} of {len(names)} weights kept in FP32 the held-out "
            f"{LABELS[m]} is {held_value:.5f} (calibration {cal_value:.5f}); loosen the budget or compile --precision fp32")
    return {"model": model, **result}
