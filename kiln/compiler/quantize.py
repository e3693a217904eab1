"""The INT8 accuracy budget: which weights stay FP32 so that a measured accuracy drop holds.

``--max-drop cosine=0.995`` (encoders): the pooled output of the INT8 graph must keep at least this
cosine similarity with the FP32 graph on every calibration text. Procedure:
1. measure each weight's sensitivity: quantize it alone and record the worst cosine;
2. quantize everything; while the calibration split misses the budget with a quarter of the allowed
   drop to spare, return the most sensitive remaining weight to FP32;
3. measure the chosen graph once on the held-out split (texts never used above) and record it.
If even the FP32-heavy end of the search misses, the compile fails and says how close it got.
Texts are split by a hash of their content, so the split does not depend on file order.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.errors import KilnError, UsageError
from kiln.passes import run_passes
from kiln.passes.graph import Graph
from kiln.passes.quantize_int8 import QuantizeDynamicInt8

log = logging.getLogger(__name__)


class AccuracyBudgetError(KilnError):
    """No choice of FP32 layers meets the requested accuracy drop."""


def parse_budget(text: str) -> tuple[str, float]:
    metric, _, value = text.partition("=")
    if metric != "cosine" or not value:
        raise UsageError(f"--max-drop {text!r}: give cosine=VALUE (minimum pooled-output cosine vs FP32, e.g. cosine=0.995)")
    try:
        v = float(value)
    except ValueError as e:
        raise UsageError(f"--max-drop {text!r}: {value!r} is not a number") from e
    if not 0 < v <= 1:
        raise UsageError(f"--max-drop {text!r}: a cosine must be in (0, 1]")
    return metric, v


def read_texts(path: str | None) -> list[str]:
    """Lines of a text file, or the "text" field of a JSONL file; default: English sentences of the Python docs."""
    if path is None:
        import pydoc_data.topics as topics

        raw = " ".join(topics.topics.values()).replace("\n", " ").split(". ")
        return [t.strip() for t in raw if 40 < len(t.strip()) < 300][:400]
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"calibration file {path} does not exist; give a text file (one text per line) or JSONL")
    lines = [line.strip() for line in p.read_text(errors="replace").splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        try:
            lines = [str(json.loads(line)["text"]) for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"calibration file {path}: every JSONL line needs a \"text\" field ({e})") from e
    if not lines:
        raise UsageError(f"calibration file {path} has 0 usable texts; give at least a few lines of text")
    return lines


def split(texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(calibration, held-out): a text is held out when its hash falls in the last quarter."""
    cal, held = [], []
    for t in texts:
        (held if hashlib.sha256(t.encode()).digest()[0] >= 192 else cal).append(t)
    if not cal or not held:
        cal, held = list(texts[: max(1, 3 * len(texts) // 4)]), list(texts[3 * len(texts) // 4:]) or list(texts)
    return cal, held


def weights(model: onnx.ModelProto) -> list[str]:
    g = Graph(model)
    return [n.input[1] for n in g.g.node if n.op_type == "MatMul" and g.constant(n.input[1]) is not None
            and g.constant(n.input[1]).ndim == 2 and g.constant(n.input[1]).size >= 1024]


def search(fp32: onnx.ModelProto, run: Callable[[onnx.ModelProto, list[dict[str, np.ndarray]]], np.ndarray],
           cal: list[dict[str, np.ndarray]], held: list[dict[str, np.ndarray]], min_cosine: float,
           say: Callable[[str], None]) -> dict[str, Any]:
    """Choose the FP32 weights; ``run(model, feeds) -> pooled outputs (rows, features)``."""

    def quantized(keep: Sequence[str]) -> onnx.ModelProto:
        return run_passes(fp32, [QuantizeDynamicInt8(keep_fp32=tuple(keep))])[0]

    def worst(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], ref: np.ndarray) -> float:
        got = run(model, feeds)
        return float(np.min((got * ref).sum(1) / np.maximum(np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1), 1e-30)))

    names = weights(fp32)
    ref_cal, ref_held = run(fp32, cal), run(fp32, held)
    say(f"int8 budget: sensitivity of {len(names)} weights on {sum(len(f['input_ids']) for f in cal)} calibration texts")
    sens = {}
    for n in names:
        sens[n] = 1.0 - worst(quantized([x for x in names if x != n]), cal, ref_cal)
    order = sorted(names, key=lambda n: -sens[n])
    # aim past the budget on calibration (a quarter of the allowed drop to spare), so held-out text holds it too
    target = 1.0 - 0.75 * (1.0 - min_cosine)
    keep: list[str] = []
    cal_cos = worst(quantized(keep), cal, ref_cal)
    while cal_cos < target and len(keep) < len(order):
        keep.append(order[len(keep)])
        cal_cos = worst(quantized(keep), cal, ref_cal)
    model = quantized(keep)
    held_cos = worst(model, held, ref_held)
    result = {"metric": "cosine", "budget": min_cosine, "weights": len(names), "kept_fp32": keep,
              "calibration_cosine_min": cal_cos, "heldout_cosine_min": held_cos,
              "sensitivity": {n: round(sens[n], 6) for n in order}}
    if held_cos < min_cosine:
        raise AccuracyBudgetError(
            f"--max-drop cosine={min_cosine} not met: with {len(keep)} of {len(names)} weights kept in FP32 the held-out "
            f"minimum cosine is {held_cos:.5f} (calibration {cal_cos:.5f}); loosen the budget or compile --precision fp32")
    return {"model": model, **result}
