"""A loaded artifact: manifest + backend + tokenizer, behind one object an app holds."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.errors import ArtifactError
from kiln.runtimes.artifact import Manifest
from kiln.runtimes.base import Runtime, check_token_ids, cut_blocks, in_blocks, prepare_feeds
from kiln.runtimes.generation import (as_prompt, as_source, row_policy, row_steps, runs_rows, seq2seq_steps, steps,
                                      stream_text)
from kiln.runtimes.sampling import GenerateOptions, Sampling
from kiln.runtimes.tokenizer import TextEncoder


_D = GenerateOptions


class Model:
    """Runs an artifact on numpy feeds; ``encode`` turns text into feeds when it ships a tokenizer."""

    def __init__(self, manifest: Manifest, runtimes: Runtime | dict[str, Runtime]) -> None:
        self.manifest = manifest
        self.runtimes = runtimes if isinstance(runtimes, dict) else {"model": runtimes}
        # single-graph artifacts: the graph; encoder-decoders: the encoder (run() runs it alone)
        self.runtime = self.runtimes.get("model") or self.runtimes["encoder"]
        self._encoder: TextEncoder | None = None
        self.backend: dict[str, Any] = {"name": "onnxruntime-cpu", "requested": "onnxruntime", "skipped": {}}
        """Which backend runs the graphs, what was asked for, and (``auto``) why the others were skipped."""
        self.canary: Any = None
        """The canary's result where ``load`` ran it (``kiln.runtimes.canary.Result``), else None."""

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.manifest.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.manifest.outputs]

    @property
    def max_sequence_length(self) -> int:
        return self.manifest.max_sequence_length

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Validate feeds (names, dtypes, ranks, lengths), fill optional inputs, run the graph (a graph traced for
        lengths in whole blocks: padded to them, outputs cut back)."""
        arrays = prepare_feeds(self.manifest.inputs, feeds, self.max_sequence_length, self.vocab_size)
        blocks = self.manifest.data.get("length_multiple")
        arrays, length = in_blocks(self.manifest.inputs, arrays, blocks)
        return cut_blocks(self.manifest.outputs, self.runtime.run(arrays), blocks, length)

    @property
    def vocab_size(self) -> int | None:
        return self.manifest.data["model"].get("vocab_size")

    def encode(self, texts: str | list[str], truncate: bool = False,
               add_special_tokens: bool | None = None) -> dict[str, np.ndarray]:
        """Tokenize and pad text into feeds this artifact accepts."""
        if isinstance(texts, str):
            texts = [texts]
        feeds = self.text_encoder.encode(list(texts), self.max_sequence_length, truncate=truncate,
                                         add_special_tokens=add_special_tokens)
        return {k: v for k, v in feeds.items() if k in self.input_names}

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt for chat ``messages`` through the artifact's chat template (generation prompt added)."""
        return self.text_encoder.chat(messages)

    @property
    def text_encoder(self) -> TextEncoder:
        if self._encoder is None:
            spec = self.manifest.tokenizer
            if not spec:
                raise ArtifactError(
                    f"artifact {self.manifest.root} has no tokenizer; feed token ids to run() instead of text"
                )
            self._encoder = TextEncoder(self.manifest.root, spec)
        return self._encoder

    # --- generation (causal-lm artifacts compiled with a KV cache) ---------------------------------
    def _generation(self, stop_token_ids: Sequence[int] | None, pad_token_id: int | None, **sampling: Any) -> tuple[Sampling, list[int], int]:
        gen = self.manifest.data.get("generation") or {}
        stop = list(gen.get("eos_token_ids", [])) if stop_token_ids is None else list(stop_token_ids)
        pad = pad_token_id if pad_token_id is not None else int(gen.get("pad_token_id", 0))
        return Sampling(**sampling), stop, pad

    def generate(self, input_ids: Any, attention_mask: Any | None = None, max_new_tokens: int = _D.max_new_tokens,
                 do_sample: bool = _D.do_sample, temperature: float = _D.temperature, top_k: int = _D.top_k,
                 top_p: float = _D.top_p, repetition_penalty: float = _D.repetition_penalty, stop_token_ids: Sequence[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None) -> np.ndarray:
        """Token ids (batch, prompt + new). ``input_ids``: a left-padded (batch, prompt) array with its
        ``attention_mask``, or a list of token lists of any lengths (left-padded here). Stops at
        ``max_new_tokens`` or when every row produced a stop token (default: the model's eos ids). On ONNX Runtime
        each prompt decodes in its own row of the cache, as continuous batching runs it: its tokens are those it
        gets alone, whatever else is in the batch (``generation.row_steps``)."""
        sampling, stop, pad = self._generation(stop_token_ids, pad_token_id, do_sample=do_sample,
                                               temperature=temperature, top_k=top_k, top_p=top_p,
                                               repetition_penalty=repetition_penalty)
        seqs = None
        for seqs in self._steps(input_ids, attention_mask, max_new_tokens, sampling, stop, pad, seed):
            pass
        return seqs

    def _steps(self, input_ids: Any, attention_mask: Any | None, max_new_tokens: int, sampling: Sampling,
               stop: list[int], pad: int, seed: int | None) -> Iterator[np.ndarray]:
        if "decoder" in self.runtimes:
            return seq2seq_steps(self.seq2seq_runner, self.manifest.data, as_source(input_ids, attention_mask, pad),
                                 max_new_tokens, sampling, stop, pad, seed)
        prompt = as_prompt(input_ids, attention_mask, pad)
        check_token_ids("input_ids", prompt.ids[prompt.mask.astype(bool)], self.vocab_size)
        data = self.manifest.data
        if runs_rows(self.runtime, data):
            min_rows, mixed = row_policy(data, self.canary)
            return row_steps(self.runtime, data, prompt, max_new_tokens, sampling, stop, pad, seed, min_rows, mixed)
        return steps(self.runtime, data, prompt, max_new_tokens, sampling, stop, pad, seed)

    def seq2seq_runner(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        """Encoder-decoders: run the encoder once; the runner steps the decoder over its cache."""
        cross, mask = self.run_encoder(input_ids, attention_mask)
        return self.runtimes["decoder"].seq2seq_runner(self.manifest.data["kv_cache"], cross, mask)

    def run_encoder(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Encoder-decoders: the encoder's cross keys/values for a source, and the mask the decoder reads them
        under (the source padded to whole blocks where the graph takes lengths in blocks)."""
        feeds = prepare_feeds(self.manifest.inputs, {"input_ids": input_ids, "attention_mask": attention_mask},
                              self.max_sequence_length)
        feeds, _ = in_blocks(self.manifest.inputs, feeds, self.manifest.data.get("length_multiple"))
        return self.runtimes["encoder"].run(feeds), feeds["attention_mask"]

    def stream(self, prompt: str, max_new_tokens: int = _D.max_new_tokens, do_sample: bool = _D.do_sample,
               temperature: float = _D.temperature, top_k: int = _D.top_k, top_p: float = _D.top_p,
               repetition_penalty: float = _D.repetition_penalty,
               stop_token_ids: Sequence[int] | None = None, seed: int | None = None,
               chat: bool = False, info: dict[str, Any] | None = None) -> Iterator[str]:
        """Generate from one text prompt, yielding text as it is produced (partial characters held back).
        ``chat``: the prompt was rendered by the chat template, which writes its own special tokens. ``info``,
        when given, is filled as tokens come: prompt_tokens, completion_tokens, finish_reason (stop | length)."""
        sampling, stop, pad = self._generation(stop_token_ids, None, do_sample=do_sample,
                                               temperature=temperature, top_k=top_k, top_p=top_p,
                                               repetition_penalty=repetition_penalty)
        feeds = self.encode([prompt], add_special_tokens=False if chat else None)
        start = 1 if "decoder" in self.runtimes else feeds["input_ids"].shape[1]
        emitted, text = 0, ""
        info = {} if info is None else info
        info.update(prompt_tokens=int(feeds["input_ids"].shape[1]), completion_tokens=0, finish_reason="length")
        for seqs in self._steps(feeds["input_ids"], feeds["attention_mask"], max_new_tokens, sampling, stop, pad, seed):
            produced = [int(t) for t in seqs[0, start:]]
            new = [t for t in produced if t not in stop]
            info.update(completion_tokens=len(produced), finish_reason="stop" if len(new) < len(produced) else "length")
            text, ready = stream_text(self.text_encoder.decode, new)
            if ready > emitted:
                yield text[emitted:ready]
                emitted = ready
        if emitted < len(text):  # a trailing partial character at the very end
            yield text[emitted:]

    def close(self) -> None:
        for runtime in self.runtimes.values():
            runtime.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
