"""Verification inputs: real text through the checkpoint's tokenizer, random token ids, generation prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kiln.runtimes.generation import pad_rows

if TYPE_CHECKING:
    from kiln.compiler.load import Checkpoint

Feeds = dict[str, np.ndarray]


@dataclass
class Case:
    """One verification input: its feeds and where they came from."""
    name: str
    feeds: Feeds
    source: str  # "text" | "random"


SAMPLE_TEXTS = (
    "The cat sat on the mat.",
    "Deployment artifacts must match the model they were compiled from, or the release stops.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
)
LONG_TEXT = (
    "A compiler for neural networks reads a trained model, rewrites its graph into faster operations "
    "and checks, on real inputs and on random ones, that every output still agrees with the original. "
)


def pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    padded = pad_rows(rows, pad_id, side)
    return padded.ids, padded.mask


def make_feeds(ids: np.ndarray, mask: np.ndarray, input_names: list[str]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in input_names:
        feeds["token_type_ids"] = np.zeros_like(ids)
    return feeds


def text_cases(ckpt: Checkpoint, input_names: list[str]) -> list[Case]:
    tok = ckpt.tokenizer
    if tok is None:
        return []
    limit = min(ckpt.max_length, 128)
    long = (LONG_TEXT * 20)
    rows = [tok(t, add_special_tokens=True, truncation=True, max_length=limit)["input_ids"] for t in (*SAMPLE_TEXTS, long)]
    pad_id, side = ckpt.pad_token_id, ckpt.padding_side
    cases = [Case(f"text[{i}]", make_feeds(*pad([r], pad_id, side), input_names), "text") for i, r in enumerate(rows)]
    ids, mask = pad(rows, pad_id, side)
    cases.append(Case(f"text padded batch {len(rows)}", make_feeds(ids, mask, input_names), "text"))
    return cases


def random_cases(ckpt: Checkpoint, input_names: list[str], longest: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    vocab = ckpt.vocab_size
    longest = max(2, min(longest, ckpt.max_length))
    side = ckpt.padding_side
    cases = []
    for batch, seq in ((1, 1), (2, min(17, longest)), (3, longest)):
        ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
        mask = np.ones_like(ids)
        if batch > 1:  # one shorter row exercises padding at every shape with batch > 1
            short = max(1, seq // 2)
            if side == "left":
                mask[1, : seq - short] = 0
            else:
                mask[1, short:] = 0
        cases.append(Case(f"random {batch}x{seq}", make_feeds(ids, mask, input_names), "random"))
    return cases


def latency_feeds(ckpt: Checkpoint, input_names: list[str], shape: tuple[int, int], seed: int) -> dict[str, np.ndarray]:
    batch, seq = shape[0], min(shape[1], ckpt.max_length)
    ids = np.random.default_rng(seed).integers(0, ckpt.vocab_size, size=(batch, seq), dtype=np.int64)
    return make_feeds(ids, np.ones_like(ids), input_names)


def generation_prompts(ckpt: Checkpoint, seed: int, length: int = 24, low: int = 0) -> list[list[int]]:
    """Three prompts of different lengths: the sample texts, or random ids without a tokenizer."""
    tok = ckpt.tokenizer
    if tok is not None:
        rows = [tok(t, add_special_tokens=True)["input_ids"][:length] for t in SAMPLE_TEXTS]
        if all(rows):
            return rows
    rng = np.random.default_rng(seed)
    return [rng.integers(low, ckpt.vocab_size, n).tolist() for n in (9, 4, 14)]


def seq2seq_sources(ckpt: Checkpoint, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three source texts of different lengths, right-padded (encoders pad right); ids from 3 up avoid
    the usual special tokens when there is no tokenizer."""
    return pad(generation_prompts(ckpt, seed, length=32, low=3), ckpt.pad_token_id, "right")
