"""Numbers formatted for reading, shared by the report pages and ``kiln gate`` (no dependencies: the gate runs in CI
jobs without the compile extras)."""

from __future__ import annotations

from typing import Any

FRACTIONS = ("top1_agreement", "greedy_match_rate")
COSINES = ("cosine_min", "cosine_mean", "cosine_p1")
PERCENTS = ("ppl_increase_pct", "latency_regression_pct")


def pct(v: float) -> str:
    """A signed percentage with 2 decimals: +0.41%, -0.00%."""
    return f"{v:+.2f}%"


def ratio(v: float) -> str:
    return f"{v:.2f}x"


def number(v: float) -> str:
    """Plain where it reads plainly, scientific only where it is small: 0.0123, 3.10e-06, 24.93."""
    if v == 0:
        return "0"
    if abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def metric(key: str, v: Any) -> str:
    """One report metric as a person reads it: percentages signed, agreement rates in %, cosines to 6 places."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return str(v)
    if key in PERCENTS:
        return pct(v)
    if key in FRACTIONS:
        return f"{100 * v:.2f}%"
    if key in COSINES:
        return f"{v:.6f}"
    if isinstance(v, int):
        return str(v)
    return number(v)
