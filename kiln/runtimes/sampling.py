"""Next-token choice as small pure numpy functions, applied in Hugging Face's order:
repetition penalty, temperature, top-k, top-p, then greedy argmax or a draw.

Every function takes and returns float logits of shape (batch, vocab); filtered entries are -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import InputError


@dataclass(frozen=True)
class GenerateOptions:
    """The defaults of ``kiln generate``, ``Model.generate`` and ``Model.stream`` (one place for all three)."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = GenerateOptions.do_sample
    temperature: float = GenerateOptions.temperature
    top_k: int = GenerateOptions.top_k
    top_p: float = GenerateOptions.top_p
    repetition_penalty: float = GenerateOptions.repetition_penalty

    def check(self) -> None:
        if self.temperature <= 0:
            raise InputError(f"temperature {self.temperature} must be > 0; use do_sample=False for greedy decoding")
        if self.top_k < 0:
            raise InputError(f"top_k {self.top_k} must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p {self.top_p} must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty {self.repetition_penalty} must be > 0 (1 disables it)")


def repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL-style: divide positive logits of already-seen tokens by ``penalty``, multiply negative ones."""
    if penalty == 1.0:
        return logits
    out = logits.copy()
    rows = np.arange(seen.shape[0])[:, None]
    picked = out[rows, seen]
    out[rows, seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[:, -k][:, None]
    return np.where(logits < kth, -np.inf, logits)


def top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (at least one)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1, kind="stable")
    sorted_logits = np.take_along_axis(logits, order, -1)
    probs = softmax(sorted_logits)
    before = np.cumsum(probs, -1) - probs  # mass of the strictly more likely tokens
    drop_sorted = before >= p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, -1)
    return np.where(drop, -np.inf, logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64 (scores summed over many tokens keep their digits)."""
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def choose(logits: np.ndarray, seen: np.ndarray, s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Next token per row: (batch, vocab) logits and (batch, n) tokens so far -> (batch,) int64."""
    x = repetition_penalty(logits.astype(np.float64), seen, s.repetition_penalty)
    if not s.do_sample:
        return x.argmax(-1).astype(np.int64)
    x = top_p(top_k(x / s.temperature, s.top_k), s.top_p)
    probs = softmax(x)
    u = rng.random((probs.shape[0], 1))
    return np.minimum((np.cumsum(probs, -1) < u).sum(-1), probs.shape[-1] - 1).astype(np.int64)
