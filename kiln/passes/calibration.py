"""Activation statistics for static INT8 and SmoothQuant, and the three ways to turn them into a range.

The compiler runs the FP32 graph on calibration text with the tensors of interest exposed as
outputs and hands every batch to ``Statistics.observe``; passes receive the finished
statistics (they never run a model themselves). Per tensor we keep the min, the max, the absolute
maximum of each channel (last axis, for SmoothQuant) and a histogram of |x| whose range grows as
larger values arrive (old counts are re-binned into the wider bins).

Range methods, each a small pure function of one tensor's statistics:
- ``minmax``: the observed min and max (every outlier kept, resolution lost to it);
- ``percentile``: clip |x| at the given percentile of the histogram;
- ``entropy``: the clip threshold whose 128-level quantized histogram has the least KL divergence
  from the original (TensorRT's calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BINS = 2048
METHODS = ("minmax", "percentile", "entropy")


@dataclass
class TensorStats:
    lo: float = float("inf")
    hi: float = float("-inf")
    channel_absmax: np.ndarray | None = None
    hist: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.float64))
    top: float = 0.0
    """The histogram covers |x| in [0, top]."""

    def observe(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32)
        if x.size == 0:
            return
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        ch = np.abs(x.reshape(-1, x.shape[-1])).max(0) if x.ndim else np.abs(x).reshape(1)
        self.channel_absmax = ch if self.channel_absmax is None or self.channel_absmax.shape != ch.shape \
            else np.maximum(self.channel_absmax, ch)
        a = np.abs(x).ravel()
        amax = float(a.max())
        if amax > self.top:
            self._widen(amax)
        if self.top > 0:
            self.hist += np.histogram(a, bins=BINS, range=(0.0, self.top))[0]

    def _widen(self, top: float) -> None:
        """Re-bin the counts so far into BINS bins over [0, top] (each old bin moves whole, by its centre)."""
        if self.top > 0 and self.hist.any():
            centres = (np.arange(BINS) + 0.5) * (self.top / BINS)
            idx = np.minimum((centres / top * BINS).astype(np.int64), BINS - 1)
            wider = np.zeros(BINS, np.float64)
            np.add.at(wider, idx, self.hist)
            self.hist = wider
        self.top = top


class Statistics(dict):
    """tensor name -> TensorStats, filled batch by batch."""

    def observe(self, outputs: dict[str, np.ndarray]) -> None:
        for name, value in outputs.items():
            self.setdefault(name, TensorStats()).observe(value)


def minmax(s: TensorStats) -> tuple[float, float]:
    return s.lo, s.hi


def percentile(s: TensorStats, pct: float = 99.99) -> tuple[float, float]:
    """Clip at the |x| below which ``pct`` percent of the observed values lie (signs kept)."""
    cdf = np.cumsum(s.hist) / max(s.hist.sum(), 1.0)
    t = (int(np.searchsorted(cdf, pct / 100.0)) + 1) * s.top / BINS
    return max(s.lo, -t), min(s.hi, t)


def entropy(s: TensorStats, levels: int = 128, stride: int = 4) -> tuple[float, float]:
    """The clip threshold minimising KL(P || Q) between |x|'s histogram P and its ``levels``-level version Q."""
    hist = s.hist
    if not hist.any():
        return minmax(s)
    best, best_kl = BINS, np.inf
    for i in range(levels, BINS + 1, stride):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # what the clip saturates lands in the last kept bin
        sizes = np.full(levels, i // levels) + (np.arange(levels) < i % levels)  # np.array_split's chunks
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        used = hist[:i] > 0
        per_level = np.add.reduceat(hist[:i], starts) / np.maximum(np.add.reduceat(used.astype(np.float64), starts), 1)
        q = np.where(used, np.repeat(per_level, sizes), 0.0)  # each level spread over its non-empty bins
        mask = p > 0
        q = np.where(mask & (q == 0), 1e-4, q)  # a kept bin Q cannot represent: heavily penalised, not infinite
        kl = float((p[mask] / p.sum() * np.log((p[mask] / p.sum()) / (q[mask] / q.sum()))).sum())
        if kl < best_kl:
            best, best_kl = i, kl
    t = best * s.top / BINS
    return max(s.lo, -t), min(s.hi, t)


def ranges(stats: Statistics, method: str = "minmax", pct: float = 99.99) -> dict[str, tuple[float, float]]:
    if method not in METHODS:
        raise ValueError(f"calibration method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    fn = {"minmax": minmax, "percentile": lambda s: percentile(s, pct), "entropy": entropy}[method]
    return {name: fn(s) for name, s in stats.items() if np.isfinite(s.lo)}
