"""The INT8 accuracy budget: which weights stay FP32 so that a measured accuracy drop holds.

``--max-drop METRIC=VALUE``, measured against the FP32 graph on calibration text:
- ``cosine=V`` (encoders): every text's pooled output keeps cosine >= V;
- ``ppl=P`` (decoders): perplexity rises by at most P percent;
- ``top1=A`` (decoders): the next-token argmax agrees on at least a fraction A of positions;
- ``kl=K`` (decoders): the mean KL divergence of next-token distributions is at most K.
Procedure:
1. quantize everything; if the calibration split meets the budget with a quarter of the allowed drop
   to spare, that is the choice;
2. otherwise measure each weight's sensitivity (quantize it alone, record the metric) and return the
   most sensitive remaining weight to FP32 until the calibration split meets it with that margin;
3. measure the chosen graph once on the held-out split (texts never used above) and record it.
If even the FP32-heavy end of the search misses, the compile fails and says how close it got.
Texts are split by a hash of their content (``kiln.compiler.corpus.split``), so the split does not depend on file order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from kiln.compiler.verify import metrics
from kiln.errors import KilnError, UsageError
from kiln.passes.quantize_int8 import candidates

log = logging.getLogger(__name__)


class AccuracyBudgetError(KilnError):
    """No choice of FP32 layers meets the requested accuracy drop."""


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


# metric -> (model kind it applies to, what it means)
METRICS = {"cosine": ("encoder", "minimum pooled-output cosine vs FP32, e.g. cosine=0.995"),
           "ppl": ("decoder", "perplexity increase in percent, e.g. ppl=2"),
           "top1": ("decoder", "next-token top-1 agreement with FP32, e.g. top1=0.98"),
           "kl": ("decoder", "mean next-token KL divergence from FP32, e.g. kl=0.01")}


LABELS = {"cosine": "minimum cosine", "ppl": "perplexity increase (%)", "top1": "top-1 agreement", "kl": "mean KL"}


def parse_budget(text: str, kind: str | None = None) -> Budget:
    metric, _, value = text.partition("=")
    if metric not in METRICS or not value:
        choices = "; ".join(f"{m}=VALUE ({kind_}: {what})" for m, (kind_, what) in METRICS.items())
        raise UsageError(f"--max-drop {text!r}: give one of {choices}")
    try:
        v = float(value)
    except ValueError as e:
        raise UsageError(f"--max-drop {text!r}: {value!r} is not a number") from e
    if metric in ("cosine", "top1") and not 0 < v <= 1:
        raise UsageError(f"--max-drop {text!r}: a {metric} must be in (0, 1]")
    if metric in ("ppl", "kl") and not v >= 0:
        raise UsageError(f"--max-drop {text!r}: a {metric} increase cannot be negative")
    if kind is not None and METRICS[metric][0] != kind:
        fits = ", ".join(m for m, (k, _) in METRICS.items() if k == kind) or "none"
        raise UsageError(f"--max-drop {metric} is measured on {METRICS[metric][0]}s; for this {kind} use {fits}")
    return Budget(metric, v)


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


def search(fp32: onnx.ModelProto, quantized: Callable[[Sequence[str]], onnx.ModelProto], run: Run,
           cal: list[dict[str, np.ndarray]], held: list[dict[str, np.ndarray]], budget: Budget,
           say: Callable[[str], None], quantizable: Callable[[onnx.ModelProto], list[str]] = lambda m: list(candidates(m))
           ) -> dict[str, Any]:
    """Choose the FP32 weights. ``quantized(keep)`` builds the INT8 graph keeping ``keep`` in FP32;
    ``run(model, feeds)`` returns the compared output per feed (pooled rows, or logits); ``quantizable``
    lists the weights the quantizer can take (default: the weight MatMuls)."""
    names = quantizable(fp32)
    ref_cal, ref_held = run(fp32, cal), run(fp32, held)

    def measured(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], ref: list[np.ndarray]) -> float:
        return budget.measure(ref, run(model, feeds), feeds)

    # aim past the budget on calibration (a quarter of the allowed drop to spare), so held-out text holds it too
    target = 0.75 * budget.limit
    keep: list[str] = []
    cal_value = measured(quantized(keep), cal, ref_cal)
    sens: dict[str, float] = {}
    order: list[str] = []
    if budget.drop(cal_value) > target:  # only then is it worth ranking the weights
        say(f"int8 budget: sensitivity of {len(names)} weights on {sum(len(f['input_ids']) for f in cal)} calibration texts")
        sens = {n: budget.drop(measured(quantized([x for x in names if x != n]), cal, ref_cal)) for n in names}
        order = sorted(names, key=lambda n: -sens[n])
    while budget.drop(cal_value) > target and len(keep) < len(order):
        keep.append(order[len(keep)])
        cal_value = measured(quantized(keep), cal, ref_cal)
    model = quantized(keep)
    held_value = measured(model, held, ref_held)
    m = budget.metric
    result = {"metric": m, "budget": budget.value, "weights": len(names), "kept_fp32": keep,
              f"calibration_{m}": cal_value, f"heldout_{m}": held_value,
              "sensitivity": {n: round(sens[n], 6) for n in order}}
    if names and len(keep) == len(names) and budget.holds(held_value):
        raise AccuracyBudgetError(
            f"--max-drop {m}={budget.value} is met only with all {len(names)} weights in FP32 (nothing left to quantize); "
            f"loosen the budget or compile --precision fp32")
    if not budget.holds(held_value):
        raise AccuracyBudgetError(
            f"--max-drop {m}={budget.value} not met: with {len(keep)} of {len(names)} weights kept in FP32 the held-out "
            f"{LABELS[m]} is {held_value:.5f} (calibration {cal_value:.5f}); loosen the budget or compile --precision fp32")
    return {"model": model, **result}
