"""The generation loop: prefill, then one token per step through the backend's cache.

Backend-agnostic (numpy only). Where the backend keeps a row per prompt, each at its own length (``slot_cache``:
ONNX Runtime's in-place GroupQueryAttention cache, the one continuous batching runs), every prompt of a batch runs
in its own row exactly as it would alone (``row_steps``); elsewhere (TensorRT's growing cache, older graphs) the
prompts are left-padded into one batch (``steps``). Either way this module picks tokens (``sampling``), handles stop
tokens and padding of finished rows the way Hugging Face's ``generate`` does, and checks everything a caller can get
wrong before the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError
from kiln.runtimes.sampling import Sampling, choose

PREFILL_TOKENS = 256  # rows x longest prompt of one batched prefill (logits of every position: 50 MB at 49k vocab)


@dataclass
class Prompt:
    ids: np.ndarray  # (batch, prompt) int64, left-padded
    mask: np.ndarray  # (batch, prompt) int64


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> Prompt:
    """Token lists of any lengths -> (batch, longest) ids and mask; decoders pad left, encoders right."""
    if not rows or any(len(r) == 0 for r in rows):
        raise InputError("every prompt needs at least one token; drop empty prompts")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, span] = r
        mask[i, span] = 1
    return Prompt(ids, mask)


def as_prompt(input_ids: Any, attention_mask: Any | None, pad_id: int) -> Prompt:
    """Arrays (batch, prompt) with an optional mask, or a list of token lists of different lengths."""
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, np.ndarray)):
        if attention_mask is not None:
            raise InputError("give attention_mask only with a padded (batch, prompt) array, not with lists of ids")
        return pad_rows([list(map(int, r)) for r in input_ids], pad_id, "left")
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


def as_source(input_ids: Any, attention_mask: Any | None, pad_id: int) -> Prompt:
    """Encoder-decoder sources: a (batch, source) array with its mask, or token lists (right-padded here)."""
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, np.ndarray)):
        return pad_rows([list(map(int, r)) for r in input_ids], pad_id, "right")
    ids = np.asarray(input_ids, dtype=np.int64)
    ids = ids[None] if ids.ndim == 1 else ids
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int64)
    return Prompt(ids, mask)


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


def check_request(kv: dict[str, Any], prompt_len: int, max_new_tokens: int, sampling: Sampling, max_model: int) -> None:
    """Everything about a generation request that can be wrong, checked before the first step."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens {max_new_tokens} must be at least 1")
    sampling.check()
    check_capacity(kv, prompt_len, max_new_tokens, max_model)


def decode(seqs: np.ndarray, advance: Callable[[np.ndarray | None], np.ndarray], close: Callable[[], None],
           max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int], pad_id: int,
           seed: int | None) -> Iterator[np.ndarray]:
    """The token loop both decoders and encoder-decoders share. ``advance(None)`` gives the first
    next-token logits (batch, vocab), ``advance(tokens)`` those after feeding the chosen tokens.
    Yields the tokens so far after each step; stops at ``max_new_tokens`` or when every row produced a
    stop token; finished rows get ``pad_id`` (as Hugging Face's ``generate`` does)."""
    rng = np.random.default_rng(seed)
    stop = np.asarray(list(stop_ids), dtype=np.int64)
    finished = np.zeros(seqs.shape[0], dtype=bool)
    try:
        logits = advance(None)
        for step in range(max_new_tokens):
            nxt = np.where(finished, pad_id, choose(logits, seqs, sampling, rng))
            seqs = np.concatenate([seqs, nxt[:, None]], 1)
            if stop.size:
                finished |= np.isin(nxt, stop)
            yield seqs
            if finished.all() or step == max_new_tokens - 1:
                break
            logits = advance(nxt)
    finally:
        close()


def steps(runtime: Any, manifest_data: dict[str, Any], prompt: Prompt, max_new_tokens: int, sampling: Sampling,
          stop_ids: Sequence[int], pad_id: int, seed: int | None) -> Iterator[np.ndarray]:
    """Decoder-only generation: prefill the prompt, then one token per step through the cache runner.
    Yields the tokens so far (batch, prompt + generated)."""
    kv = manifest_data.get("kv_cache")
    recompute = not kv and bool((manifest_data.get("generation") or {}).get("recompute"))
    if not (kv or recompute) or manifest_data["model"]["task"] != "causal-lm":
        raise ArtifactError("this artifact cannot generate: it is not a causal-lm decoder compiled with a KV cache; "
                            "compile a *ForCausalLM checkpoint with kiln compile")
    max_model = int(manifest_data["model"]["max_sequence_length"])
    check_request(kv or {"capacity": max_model}, prompt.ids.shape[1], max_new_tokens, sampling, max_model)
    runner = runtime.recompute_runner(prompt.ids.shape[0], manifest_data["generation"].get("logits_to_keep")) \
        if recompute else \
        runtime.cache_runner(kv, prompt.ids.shape[0], prompt.ids.shape[1] + max_new_tokens)
    mask = prompt.mask

    def advance(tokens: np.ndarray | None) -> np.ndarray:
        nonlocal mask
        if tokens is None:
            return runner.step(prompt.ids, mask)[:, -1]
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], 1)
        return runner.step(tokens[:, None], mask)[:, -1]

    return decode(prompt.ids, advance, runner.close, max_new_tokens, sampling, stop_ids, pad_id, seed)


def runs_rows(runtime: Any, manifest_data: dict[str, Any]) -> bool:
    """Whether this artifact's prompts decode each in its own row of the backend's slot cache (``RowRunner``), as
    continuous batching runs them: a causal LM whose backend keeps a row per prompt at its own length. ``Model.generate``
    and the canary ask the same question, so the canary checks the path generate takes."""
    kv = manifest_data.get("kv_cache")
    return bool(kv) and manifest_data["model"]["task"] == "causal-lm" and runtime.keeps_rows(kv)


def row_policy(manifest_data: dict[str, Any], canary: Any) -> tuple[int, bool]:
    """How a decoder's rows run here: (rows every decode step runs, whether prompts of different lengths share a
    prefill). ONNX Runtime's MatMulNBits computes one row (M = 1) with another kernel than several rows, which can
    round differently (docs/verification.md); a quantized graph re-rounds its activations to int8 in every layer, so
    that rounding can move its tokens. An FP32 artifact, or a quantized one whose canary showed on this machine that
    one row decodes as it does beside others (``canary.rows_agree``), decodes a lone row alone; any other quantized
    artifact decodes at least two rows (an idle one beside a lone row), so a prompt's tokens do not depend on what
    runs beside it. Quantized artifacts join prompts of one length only: their padding rows cost as much as real
    ones in MatMulNBits."""
    quantized = str(manifest_data.get("precision", "")).startswith(("int8", "int4"))
    one_row = not quantized or (canary is not None and canary.rows_agree is True)
    return (1 if one_row else 2), not quantized


def joins(group: Sequence[int], length: int, mixed: bool) -> bool:
    """Whether a prompt of ``length`` tokens joins a batched prefill of prompts of lengths ``group`` (right-padded
    into consecutive rows, each row attending to its own tokens only): at most ``PREFILL_TOKENS`` rows x longest
    prompt, prompts of one length unless ``mixed``, and a one-token prompt always alone (its prefill alone is one
    row, M = 1, as it is when it runs alone)."""
    return ((len(group) + 1) * max(length, *group) <= PREFILL_TOKENS and min(length, group[0]) >= 2
            and (mixed or length == group[0]))


class RowRunner:
    """Prompts in rows of the backend's slot cache (``runtime.slot_cache``), each at its own length, as continuous
    batching runs them: ``first()`` prefills each prompt from position 0 of its own row (consecutive prompts together
    where ``joins`` allows) and gives each prompt's last logits (rows, vocab); ``step(tokens)`` feeds one token per
    row, every row at once (at least ``min_rows``: idle rows beside a lone one, see ``row_policy``)."""

    def __init__(self, runtime: Any, kv: dict[str, Any], rows: Sequence[np.ndarray], new_tokens: int,
                 min_rows: int = 1, mixed: bool = True) -> None:
        self.rows = [np.asarray(r, np.int64) for r in rows]
        self.lengths = np.asarray([len(r) for r in self.rows], np.int64)
        self.count = max(len(self.rows), min_rows)
        self.mixed = mixed
        self.cache = runtime.slot_cache(kv, self.count, int(self.lengths.max()) + new_tokens, pooled=True)

    def first(self) -> np.ndarray:
        groups: list[list[int]] = [[0]]
        for i in range(1, len(self.rows)):
            if joins([len(self.rows[j]) for j in groups[-1]], len(self.rows[i]), self.mixed):
                groups[-1].append(i)
            else:
                groups.append([i])
        return np.concatenate([self.cache.prefill(g[0], [self.rows[j] for j in g]) for g in groups])

    def step(self, tokens: np.ndarray) -> np.ndarray:
        fed = np.zeros(self.count, np.int64)  # an idle row: token 0 written at position 0, never read back
        at = np.zeros(self.count, np.int64)
        fed[:len(self.rows)], at[:len(self.rows)] = np.asarray(tokens).reshape(-1), self.lengths
        self.lengths = self.lengths + 1
        return self.cache.decode(fed, at)[:len(self.rows)]

    def close(self) -> None:
        self.cache.close()


def unpadded(prompt: Prompt) -> list[np.ndarray]:
    """Each row's real tokens (the mask's 1s) of a padded prompt array."""
    real = prompt.mask.astype(bool)
    return [prompt.ids[i, real[i]] for i in range(real.shape[0])]


def row_steps(runtime: Any, manifest_data: dict[str, Any], prompt: Prompt, max_new_tokens: int, sampling: Sampling,
              stop_ids: Sequence[int], pad_id: int, seed: int | None, min_rows: int = 1,
              mixed: bool = True) -> Iterator[np.ndarray]:
    """Decoder-only generation with a row of the cache per prompt (``RowRunner``): a prompt's tokens are those it
    gets alone, whatever else is in the batch and however it is padded. Yields the tokens so far as ``steps`` does:
    the left-padded prompt array, then the generated tokens."""
    kv = manifest_data["kv_cache"]
    rows = unpadded(prompt)
    check_request(kv, max(len(r) for r in rows), max_new_tokens, sampling,
                  int(manifest_data["model"]["max_sequence_length"]))
    runner = RowRunner(runtime, kv, rows, max_new_tokens, min_rows, mixed)

    def advance(tokens: np.ndarray | None) -> np.ndarray:
        return runner.first() if tokens is None else runner.step(tokens)

    return decode(prompt.ids, advance, runner.close, max_new_tokens, sampling, stop_ids, pad_id, seed)


def seq2seq_steps(start_runner: Callable[[np.ndarray, np.ndarray], Any], manifest_data: dict[str, Any], source: Prompt,
                  max_new_tokens: int, sampling: Sampling, stop_ids: Sequence[int], pad_id: int,
                  seed: int | None) -> Iterator[np.ndarray]:
    """Encoder-decoder generation: ``start_runner(ids, mask)`` encodes the (right-padded) source once;
    yields the decoder tokens so far (batch, 1 + generated), starting with the decoder start token."""
    check_request(manifest_data["kv_cache"], 1, max_new_tokens, sampling, int(manifest_data["model"]["max_sequence_length"]))
    start = int(manifest_data["generation"]["decoder_start_token_id"])
    seqs = np.full((source.ids.shape[0], 1), start, np.int64)
    runner = start_runner(source.ids, source.mask)

    def advance(tokens: np.ndarray | None) -> np.ndarray:
        return runner.step(seqs[:, -1:] if tokens is None else tokens[:, None])[:, -1]

    return decode(seqs, advance, runner.close, max_new_tokens, sampling, stop_ids, pad_id, seed)


def stream_text(decode: Callable[[list[int]], str], tokens: list[int]) -> tuple[str, int]:
    """Decode all generated tokens; hold back a trailing partial UTF-8 character (U+FFFD)."""
    text = decode(tokens)
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    return text, end
