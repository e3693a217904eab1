"""The generation loop: prefill, then one token per step through the backend's cache runner.

Backend-agnostic (numpy only): the backend supplies ``cache_runner`` (ONNX Runtime binds one
in-place KV buffer per layer); this module batches left-padded prompts, picks tokens
(``sampling``), handles stop tokens and padding of finished rows the way Hugging Face's
``generate`` does, and checks everything a caller can get wrong before the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError
from kiln.runtimes.sampling import Sampling, choose


@dataclass
class Prompt:
    ids: np.ndarray  # (batch, prompt) int64, left-padded
    mask: np.ndarray  # (batch, prompt) int64


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> Prompt:
    if not rows or any(len(r) == 0 for r in rows):
        raise InputError("every prompt needs at least one token; drop empty prompts")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return Prompt(ids, mask)


def as_prompt(input_ids: Any, attention_mask: Any | None, pad_id: int) -> Prompt:
    """Arrays (batch, prompt) with an optional mask, or a list of token lists of different lengths."""
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, np.ndarray)):
        if attention_mask is not None:
            raise InputError("give attention_mask only with a padded (batch, prompt) array, not with lists of ids")
        return left_pad([list(map(int, r)) for r in input_ids], pad_id)
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise InputError(f"input_ids must be integer token ids of shape (batch, prompt), got {ids.dtype} {ids.shape}")
    if ids.shape[1] == 0:
        raise InputError("input_ids is empty; give at least one prompt token")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise InputError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}; they must match")
    mask = mask.astype(np.int64)
    real = mask.astype(bool)
    if not real.any(1).all():
        raise InputError(f"prompt row(s) {np.flatnonzero(~real.any(1)).tolist()} have no real token (mask all 0)")
    # left padding only: once a row's mask turns 1 it stays 1
    if (np.diff(mask, axis=1) < 0).any():
        raise InputError("attention_mask is right-padded; generation needs left padding (pad tokens first)")
    return Prompt(ids.astype(np.int64), mask)


def check_capacity(kv: dict[str, Any], prompt_len: int, max_new_tokens: int, max_model: int) -> None:
    need = prompt_len + max_new_tokens
    cap = int(kv["capacity"])
    if need <= cap:
        return
    head = (f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = {need} exceeds the artifact's "
            f"KV-cache capacity {cap}")
    if need > max_model:
        fix = f"the model handles at most {max_model} positions: ask for at most {max(cap - prompt_len, 0)} new tokens"
    else:
        fix = f"ask for at most {max(cap - prompt_len, 0)} new tokens or recompile with --max-length {need}"
    raise InputError(f"{head}; {fix}")


def steps(runtime: Any, manifest_data: dict[str, Any], prompt: Prompt, max_new_tokens: int, sampling: Sampling,
          stop_ids: Sequence[int], pad_id: int, seed: int | None) -> Iterator[np.ndarray]:
    """Yield the tokens so far (batch, prompt + generated) after each new token. Generation stops at
    ``max_new_tokens`` or when every row has produced a stop token; finished rows get ``pad_id``."""
    kv = manifest_data.get("kv_cache")
    if not kv or manifest_data["model"]["task"] != "causal-lm":
        raise ArtifactError("this artifact cannot generate: it is not a causal-lm decoder compiled with a KV cache; "
                            "compile a *ForCausalLM checkpoint with kiln compile (target cpu)")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens {max_new_tokens} must be at least 1")
    sampling.check()
    check_capacity(kv, prompt.ids.shape[1], max_new_tokens, int(manifest_data["model"]["max_sequence_length"]))
    rng = np.random.default_rng(seed)
    stop = np.asarray(list(stop_ids), dtype=np.int64)
    seqs, mask = prompt.ids, prompt.mask
    finished = np.zeros(seqs.shape[0], dtype=bool)
    runner = runtime.cache_runner(kv, seqs.shape[0])
    try:
        logits = runner.step(seqs, mask)[:, -1]
        for step in range(max_new_tokens):
            nxt = choose(logits, seqs, sampling, rng)
            nxt = np.where(finished, pad_id, nxt)
            seqs = np.concatenate([seqs, nxt[:, None]], 1)
            mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], 1)
            if stop.size:
                finished |= np.isin(nxt, stop)
            yield seqs
            if finished.all() or step == max_new_tokens - 1:
                break
            logits = runner.step(nxt[:, None], mask)[:, -1]
    finally:
        runner.close()


def stream_text(decode: Callable[[list[int]], str], tokens: list[int]) -> tuple[str, int]:
    """Decode all generated tokens; hold back a trailing partial UTF-8 character (U+FFFD)."""
    text = decode(tokens)
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    return text, end
