"""The numbers every consumer reports: compile-time parity, the INT8 budget, ``kiln report`` and the
generation check all compute their cosines, next-token terms and error statistics here.

A metric with nothing to measure is ``None`` (absent), never a perfect score: top-1 agreement over
zero decisive positions, a cosine over zero rows or an error over zero elements says nothing.
"""

from __future__ import annotations

import numpy as np

from kiln.runtimes.sampling import log_softmax  # the one home of it: the runtime, the report and lm-eval use it


def row_cosines(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of two (rows, features) arrays; a pair of zero rows counts as identical."""
    r, g = ref.astype(np.float64), got.astype(np.float64)
    norms = np.linalg.norm(r, axis=-1) * np.linalg.norm(g, axis=-1)
    both_zero = (np.abs(r).max(-1) == 0) & (np.abs(g).max(-1) == 0)
    cos = (r * g).sum(-1) / np.maximum(norms, 1e-300)
    return np.where(both_zero, 1.0, cos)


def centered(rows: np.ndarray) -> np.ndarray:
    """Each row minus its mean (logits: the softmax is unchanged by a shift)."""
    return rows - rows.mean(-1, keepdims=True)


def min_cosine(ref: np.ndarray, got: np.ndarray) -> float | None:
    """The worst row's cosine; None when there are no rows."""
    if len(ref) == 0:
        return None
    return float(row_cosines(ref, got).min())


def top1(ref: np.ndarray, got: np.ndarray, atol: float) -> dict[str, float | int | None]:
    """Argmax agreement of (rows, classes) logits over the rows where the reference is decisive (its best
    two differ by more than ``atol``; elsewhere either answer is right). ``agreement`` is None when no row
    is decisive."""
    top = np.sort(ref, axis=-1)
    decisive = (top[:, -1] - top[:, -2]) > atol
    agree = ref.argmax(-1) == got.argmax(-1)
    return {"agreement": float(agree[decisive].mean()) if decisive.any() else None,
            "agreement_all": float(agree.mean()) if len(agree) else None,
            "decisive": int(decisive.sum()), "ties_excluded": int((~decisive).sum())}


def top1_counts(ref: np.ndarray, got: np.ndarray, atol: float) -> dict[str, int]:
    """``top1``'s counts, to be summed over chunks of rows: decisive rows, agreeing decisive rows, agreeing rows."""
    top = np.partition(ref, (-2, -1), axis=-1)[:, -2:] if ref.shape[-1] > 1 else np.sort(ref, axis=-1)
    decisive = (top[:, -1] - top[:, -2]) > atol
    agree = ref.argmax(-1) == got.argmax(-1)
    return {"decisive": int(decisive.sum()), "agree_decisive": int((agree & decisive).sum()), "agree": int(agree.sum())}


def next_token_terms(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per position: negative log-likelihood of the target under each, top-1 agreement, KL(ref || got).

    ``ref``/``got``: logits (positions, vocab) that predict ``targets`` (positions,)."""
    lr, lg = log_softmax(ref), log_softmax(got)
    rows = np.arange(len(targets))
    return {"nll_ref": -lr[rows, targets], "nll_got": -lg[rows, targets],
            "agree": (lr.argmax(-1) == lg.argmax(-1)).astype(np.float64), "kl": (np.exp(lr) * (lr - lg)).sum(-1)}


def concat_terms(terms: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([t[k] for t in terms]) for k in ("nll_ref", "nll_got", "agree", "kl")}


def next_token_summary(t: dict[str, np.ndarray]) -> dict[str, float] | None:
    """Perplexity of both and its increase (%), top-1 agreement, mean and p99 KL; None without positions."""
    n = len(t["kl"])
    if n == 0:
        return None
    ppl_ref, ppl_got = float(np.exp(t["nll_ref"].sum() / n)), float(np.exp(t["nll_got"].sum() / n))
    return {"ppl_reference": ppl_ref, "ppl_artifact": ppl_got,
            # exp(mean nll_got - mean nll_ref): the ratio without overflow when both perplexities are huge
            "ppl_increase_pct": 100.0 * (float(np.exp((t["nll_got"].sum() - t["nll_ref"].sum()) / n)) - 1.0),
            "top1_agreement": float(t["agree"].mean()), "kl_mean": float(t["kl"].mean()),
            "kl_p99": float(np.percentile(t["kl"], 99)), "positions": n}


def error_stats(err: np.ndarray) -> dict[str, float] | None:
    """max / mean / p99 of absolute errors; None when there are none."""
    if err.size == 0:
        return None
    return {"max_abs": float(err.max()), "mean_abs": float(err.mean()), "p99_abs": float(np.percentile(err, 99)),
            "count": int(err.size)}
