"""The interface every backend implements, and the feed checks shared by all of them.

Feeds are validated once here, against the manifest, so every backend reports a wrong name,
dtype, rank or length the same way (the Polygraphy runner does the same for its backends).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError
from kiln.runtimes.artifact import Manifest, TensorSpec, cache_shape

_KINDS = {"int64": "i", "int32": "i", "float32": "f", "float16": "f", "bool": "b"}


class CacheRunner:
    """Runs a decoder graph step by step, keeping its KV cache between steps.

    This default keeps the cache as arrays: each step feeds the past and takes the present back
    (the cache grows by copying). Backends override ``Runtime.cache_runner`` with an in-place one."""

    def __init__(self, runtime: "Runtime", kv: dict, batch: int) -> None:
        self.runtime = runtime
        self.past = {name: np.zeros(cache_shape(kv, name, batch, 0), kv.get("dtype", "float32")) for name in kv["past"]}
        self.present = dict(zip(kv["present"], kv["past"]))
        # graphs with the input: the head runs for the last position only (generation reads no other)
        self.fixed = {kv["logits_to_keep"]: np.array(1, np.int64)} if kv.get("logits_to_keep") else {}

    def _advance(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Run with the cache so far; keep the grown cache; return the logits."""
        out = self.runtime.run({**feeds, **self.fixed, **self.past})
        self.past = {past: out[present] for present, past in self.present.items()}
        return out["logits"]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Feed the new tokens (batch, new) and the mask over past + new; return logits (batch, new, vocab), or
        (batch, 1, vocab) for the last position where the graph takes ``logits_to_keep``."""
        return self._advance({"input_ids": input_ids, "attention_mask": attention_mask})

    def close(self) -> None:
        self.past = {}


class RecomputeRunner:
    """Steps a decoder compiled without a KV cache (its attention runs as traced, and the manifest's ``attention``
    section says why): every step runs the whole sequence so far and returns the new positions' logits. Correct,
    and slower than a cache by the length of the sequence.

    The graph sees each row's real tokens from position 0 with the padding after them (the caller's left-padded
    layout is mapped in and the logits mapped back): a forward that numbers positions from the start of the
    sequence (one that takes no ``position_ids``) would number a left-padded row from its first pad; with the pads
    after the real tokens every row has the positions it has alone, and a causal model never attends to them."""

    def __init__(self, runtime: "Runtime", batch: int, logits_to_keep: str | None = None) -> None:
        self.runtime = runtime
        self.rows: list[np.ndarray] | None = None  # each row's real tokens so far
        self.keep = logits_to_keep

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Feed the new tokens (batch, new) and the mask over all tokens so far; return (batch, new, vocab), or
        (batch, 1, vocab) for each row's last real token where the graph takes ``logits_to_keep``."""
        new = input_ids.shape[1]
        real = attention_mask[:, -new:].astype(bool)
        fresh = [ids[m] for ids, m in zip(input_ids, real)]
        self.rows = fresh if self.rows is None else [np.concatenate([r, f]) for r, f in zip(self.rows, fresh)]
        lengths = np.array([len(r) for r in self.rows], np.int64)
        width = max(int(lengths.max()), 1)
        ids = np.zeros((len(self.rows), width), np.int64)
        for i, r in enumerate(self.rows):
            ids[i, :len(r)] = r
        feeds = {"input_ids": ids, "attention_mask": (np.arange(width) < lengths[:, None]).astype(np.int64)}
        last = np.maximum(lengths - 1, 0)
        rows = np.arange(len(self.rows))
        if self.keep:  # the head runs for the last k positions: enough to reach the shortest row's last token
            keep = width - int(last.min())
            logits = self.runtime.run({**feeds, self.keep: np.array(keep, np.int64)})["logits"]
            return logits[rows, last - (width - keep)][:, None]
        logits = self.runtime.run(feeds)["logits"]
        # the caller's column j holds the row's real token number cumsum(mask)[j] - 1 (pad columns: clamped)
        index = np.maximum(np.cumsum(attention_mask, 1)[:, -new:] - 1, 0)
        return logits[rows[:, None], index]

    def close(self) -> None:
        self.rows = None


class Seq2SeqRunner(CacheRunner):
    """Steps an encoder-decoder's decoder: the cross keys/values (computed once by the encoder) are fed
    unchanged every step, the self-attention cache grows. Backends may override with an IO-bound one."""

    def __init__(self, runtime: "Runtime", kv: dict, cross: dict[str, np.ndarray], mask: np.ndarray) -> None:
        super().__init__(runtime, kv, mask.shape[0])
        self.fixed = {**self.fixed, "encoder_attention_mask": mask, **{n: cross[n] for n in kv["cross"]}}

    def step(self, tokens: np.ndarray) -> np.ndarray:  # type: ignore[override]
        return self._advance({"decoder_input_ids": tokens, **self.fixed})


class Runtime(abc.ABC):
    """A backend that runs one artifact graph: ``load``, then ``run`` any number of times, then ``close``."""

    name: str = ""
    assumed: tuple[dict[str, Any], ...] = ()
    """The graph's assumption outputs (the manifest's ``assumptions`` for it): ``run`` checks and drops them."""
    graph: str = "model"

    def assume(self, manifest: Manifest, graph: str) -> None:
        """Keep ``graph``'s name and its assumption outputs for ``run`` (``check_assumptions``); backends call it
        from ``load``."""
        self.graph, self.assumed = graph, tuple((manifest.data.get("assumptions") or {}).get(graph, ()))

    def cache_runner(self, kv: dict, batch: int, length: int | None = None) -> CacheRunner:
        """A step runner for a decoder with a KV cache (``kv`` is the manifest's ``kv_cache``); ``length``: the
        positions the request needs (prompt + new tokens), None for the artifact's whole capacity."""
        return CacheRunner(self, kv, batch)

    def recompute_runner(self, batch: int, logits_to_keep: str | None = None) -> RecomputeRunner:
        """A step runner for a decoder compiled without a KV cache: each step recomputes the whole sequence."""
        return RecomputeRunner(self, batch, logits_to_keep)

    def seq2seq_runner(self, kv: dict, cross: dict[str, np.ndarray], mask: np.ndarray) -> Seq2SeqRunner:
        """A step runner for an encoder-decoder's decoder graph given the encoder's cross keys/values."""
        return Seq2SeqRunner(self, kv, cross, mask)

    def keeps_rows(self, kv: dict) -> bool:
        """Whether ``slot_cache`` serves this artifact's cache: a row per prompt, each at its own length."""
        return False

    def slot_cache(self, kv: dict, slots: int, positions: int, pooled: bool = False) -> Any:
        """The per-request rows of continuous batching (``kiln.runtimes.scheduler``): a backend whose cache is one
        buffer written in place at each row's own position (ONNX Runtime's GroupQueryAttention)."""
        raise ArtifactError(f"backend {self.name or type(self).__name__} keeps a growing (Concat) KV cache whose rows "
                            "share one length; continuous batching needs ONNX Runtime's in-place cache (backend "
                            "onnxruntime-cpu) and a CPU-compiled artifact")

    @abc.abstractmethod
    def load(self, manifest: Manifest, graph: str = "model") -> None: ...

    @abc.abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on already validated feeds; return every output by name."""

    def close(self) -> None:
        """Release the backend's resources; the runtime cannot run afterwards."""

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TOKEN_INPUTS = ("input_ids", "decoder_input_ids")


def check_assumptions(values: dict[str, np.ndarray], assumed: Sequence[dict[str, Any]],
                      graph: str) -> dict[str, np.ndarray]:
    """``values`` without the graph's assumption outputs (``kiln.compiler.decided``), after checking each holds the
    value the graph was traced for: a different one means this input takes a branch of the model's code that the
    graph does not contain, so its outputs would be wrong."""
    for a in assumed:
        got = values.pop(a["output"], None)
        if got is None:
            raise ArtifactError(f"the {graph} graph has no output {a['output']}, which its manifest's assumptions "
                                "name; compile the artifact again")
        if bool(np.asarray(got).any()) != bool(a["value"]):
            raise InputError(f"this input takes the other branch at {a['where']} (the {graph} graph was compiled for "
                             f"{bool(a['value'])} there, these inputs give {not a['value']}), so the graph cannot "
                             "compute it; feed inputs of the kind it was compiled for (a mask of 0 and 1), or run "
                             "the model in PyTorch")
    return values


def in_blocks(specs: list[TensorSpec], arrays: dict[str, np.ndarray],
              blocks: dict[str, Any] | None) -> tuple[dict[str, np.ndarray], int | None]:
    """Feeds right-padded to whole blocks of the manifest's ``length_multiple`` (a graph traced for lengths in
    blocks): token ids with the model's pad id, every other input (masks, token types) with 0, so the padding is
    masked as the model's own padding would be. Returns the feeds and the length before padding (None: none)."""
    if not blocks:
        return arrays, None
    axis_name, size = blocks["axis"], int(blocks["multiple"])
    length = None
    out = dict(arrays)
    for spec in specs:
        if axis_name not in spec.shape or spec.name not in out:
            continue
        axis = spec.shape.index(axis_name)
        arr = out[spec.name]
        length = arr.shape[axis]
        if length % size:
            widths = [(0, -length % size if i == axis else 0) for i in range(arr.ndim)]
            fill = int(blocks["pad_token_id"]) if spec.name in TOKEN_INPUTS else 0
            out[spec.name] = np.pad(arr, widths, constant_values=fill)
    return out, length


def cut_blocks(specs: list[TensorSpec], values: dict[str, np.ndarray], blocks: dict[str, Any] | None,
               length: int | None) -> dict[str, np.ndarray]:
    """Outputs with the padded axis (``in_blocks``) cut back to the request's ``length``."""
    if not blocks or length is None:
        return values
    for spec in specs:
        if blocks["axis"] in spec.shape and spec.name in values:
            values[spec.name] = np.take(values[spec.name], np.arange(length), axis=spec.shape.index(blocks["axis"]))
    return values


def check_token_ids(name: str, ids: np.ndarray, vocab_size: int | None) -> None:
    """Token ids outside the vocabulary would index past the embedding table inside the graph."""
    if vocab_size is None or ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InputError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size}); "
                         "tokenize with the artifact's tokenizer")


def prepare_feeds(specs: list[TensorSpec], feeds: Mapping[str, object], max_sequence_length: int,
                  vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Check feeds against the graph's inputs (token ids against ``vocab_size`` when given); fill optional ones;
    return arrays of the graph's dtypes."""
    known = {s.name: s for s in specs}
    unknown = sorted(set(feeds) - set(known))
    if unknown:
        raise InputError(f"unknown input(s) {', '.join(unknown)}; this artifact takes {', '.join(known)}")
    arrays: dict[str, np.ndarray] = {}
    for name, value in feeds.items():
        spec = known[name]
        arr = np.asarray(value)
        want = _KINDS[spec.dtype]
        if arr.dtype.kind != want and not (want == "i" and arr.dtype.kind == "u"):
            raise InputError(
                f"input {name} has dtype {arr.dtype}, expected {spec.dtype}; convert it with .astype(np.{spec.dtype})"
            )
        if arr.ndim != len(spec.shape):
            raise InputError(
                f"input {name} has rank {arr.ndim} (shape {arr.shape}), expected rank {len(spec.shape)} "
                f"({', '.join(map(str, spec.shape))}); add or remove the batch axis"
            )
        arrays[name] = arr.astype(spec.dtype, copy=False)
        if name in TOKEN_INPUTS:
            check_token_ids(name, arr, vocab_size)
    missing = [s.name for s in specs if s.name not in arrays and not s.optional]
    if missing:
        raise InputError(f"missing input(s) {', '.join(missing)}; this artifact takes {', '.join(known)}")
    axes = _bind_axes(specs, arrays, max_sequence_length)
    for spec in specs:
        if spec.name not in arrays:
            # "empty": a cache input left out has no past positions; its other axes come from the feeds
            # (a mask left out covers exactly the new tokens).
            shape = tuple((axes.get(d, axes.get("sequence", 0)) if d == "total_sequence" else
                           axes.get(d, 0)) if isinstance(d, str) else d for d in spec.shape)
            if spec.default == "empty":
                shape = tuple(0 if d == "past_sequence" else n for d, n in zip(spec.shape, shape))
            fill = np.ones if spec.default == "ones" else np.zeros
            arrays[spec.name] = fill(shape, dtype=spec.dtype)
    return arrays


def _bind_axes(specs: list[TensorSpec], arrays: dict[str, np.ndarray], max_len: int) -> dict[str, int]:
    axes: dict[str, tuple[int, str]] = {}
    for spec in specs:
        arr = arrays.get(spec.name)
        if arr is None:
            continue
        for i, (dim, size) in enumerate(zip(spec.shape, arr.shape)):
            if isinstance(dim, int):
                if size != dim:
                    raise InputError(f"input {spec.name} has size {size} on axis {i}, expected {dim}")
                continue
            if size < 1:
                raise InputError(f"input {spec.name} has an empty {dim} axis (shape {arr.shape}); give at least one element")
            if dim in axes and axes[dim][0] != size:
                other = axes[dim][1]
                raise InputError(
                    f"input {spec.name} has {dim} size {size} but {other} has {axes[dim][0]}; "
                    f"all inputs must agree on the {dim} axis"
                )
            axes.setdefault(dim, (size, spec.name))
    for name in ("sequence", "total_sequence"):
        seq = axes.get(name)
        if seq is not None and seq[0] > max_len:
            raise InputError(
                f"input {seq[1]} has sequence length {seq[0]}, longer than the model's maximum {max_len}; "
                f"truncate the input to {max_len} tokens"
            )
    return {k: v[0] for k, v in axes.items()}
