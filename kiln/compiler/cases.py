"""Verification inputs: real text through the checkpoint's tokenizer, and random token ids."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from kiln.compiler.load import Checkpoint
from kiln.compiler.verify import Case
from kiln.runtimes.generation import pad_rows

log = logging.getLogger(__name__)

SAMPLE_TEXTS = (
    "The cat sat on the mat.",
    "Deployment artifacts must match the model they were compiled from, or the release stops.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
)
LONG_TEXT = (
    "A compiler for neural networks reads a trained model, rewrites its graph into faster operations "
    "and checks, on real inputs and on random ones, that every output still agrees with the original. "
)


def load_hf_tokenizer(path: Path) -> Any | None:
    """The checkpoint's fast tokenizer, or None when it ships none kiln can use."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # no tokenizer files, or an unusable slow-only tokenizer
        log.info("no usable tokenizer in %s (%s); verification uses random ids only", path, e)
        return None
    if not getattr(tok, "is_fast", False):
        log.info("tokenizer in %s is not a fast tokenizer; the artifact will not ship one", path)
        return None
    return tok


def padding_side(ckpt: Checkpoint) -> str:
    return "left" if ckpt.kind == "decoder" else "right"


def pad_token_id(ckpt: Checkpoint, tok: Any | None) -> int:
    for value in (getattr(tok, "pad_token_id", None), ckpt.config.pad_token_id, getattr(tok, "eos_token_id", None),
                  ckpt.config.eos_token_id):
        if isinstance(value, int):
            return value
    return 0


def _pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    padded = pad_rows(rows, pad_id, side)
    return padded.ids, padded.mask


def make_feeds(ids: np.ndarray, mask: np.ndarray, input_names: list[str]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in input_names:
        feeds["token_type_ids"] = np.zeros_like(ids)
    return feeds


def text_cases(ckpt: Checkpoint, tok: Any, input_names: list[str]) -> list[Case]:
    limit = min(ckpt.max_length, 128)
    long = (LONG_TEXT * 20)
    rows = [tok(t, add_special_tokens=True, truncation=True, max_length=limit)["input_ids"] for t in (*SAMPLE_TEXTS, long)]
    pad = pad_token_id(ckpt, tok)
    side = padding_side(ckpt)
    cases = [Case(f"text[{i}]", make_feeds(*_pad([r], pad, side), input_names), "text") for i, r in enumerate(rows)]
    ids, mask = _pad(rows, pad, side)
    cases.append(Case(f"text padded batch {len(rows)}", make_feeds(ids, mask, input_names), "text"))
    return cases


def random_cases(ckpt: Checkpoint, input_names: list[str], longest: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    vocab = int(ckpt.config.vocab_size)
    longest = max(2, min(longest, ckpt.max_length))
    side = padding_side(ckpt)
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
    ids = np.random.default_rng(seed).integers(0, int(ckpt.config.vocab_size), size=(batch, seq), dtype=np.int64)
    return make_feeds(ids, np.ones_like(ids), input_names)


def generation_prompts(ckpt: Checkpoint, tok: Any | None, seed: int) -> list[list[int]]:
    """Three prompts of different lengths: the sample texts, or random ids without a tokenizer."""
    if tok is not None:
        rows = [tok(t, add_special_tokens=True)["input_ids"][:24] for t in SAMPLE_TEXTS]
        if all(rows):
            return rows
    rng = np.random.default_rng(seed)
    return [rng.integers(0, int(ckpt.config.vocab_size), n).tolist() for n in (9, 4, 14)]
