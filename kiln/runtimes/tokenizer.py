"""Text to feeds with the ``tokenizers`` package alone (no transformers, no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError


MAX_TOKENIZER_BYTES = 256 << 20
MAX_TEMPLATE_BYTES = 1 << 20


def bounded(path: Path, limit: int) -> None:
    """Refuse a tokenizer file or chat template past ``limit`` bytes before it is read (an artifact is untrusted)."""
    size = path.stat().st_size
    if size > limit:
        raise ArtifactError(f"{path} is {size} bytes, more than the {limit >> 20} MiB kiln reads for such a file; "
                            "recompile the artifact")


class TooLong(InputError):
    """A text has more tokens than the model takes: ``tokens`` of at most ``limit``."""

    def __init__(self, message: str, tokens: int, limit: int) -> None:
        super().__init__(message)
        self.tokens, self.limit = tokens, limit


class TextEncoder:
    """Tokenizes a batch of texts and pads it the way the artifact was verified."""

    def __init__(self, root: Path, spec: dict[str, Any]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers is a base dependency
            raise ArtifactError("text input needs the `tokenizers` package; pip install tokenizers") from e
        path = root / spec["file"]
        bounded(path, MAX_TOKENIZER_BYTES)
        self._tok = Tokenizer.from_file(str(path))
        # Checkpoints ship tokenizer.json with their training-time truncation/padding baked in;
        # kiln pads itself and refuses over-long input instead of silently cutting it.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.pad_id = int(spec.get("pad_token_id") or 0)
        self.spec = spec
        self.root = root
        self._template: Any = None
        self._longest: int | None = None
        self.padding_side = spec.get("padding_side", "right")
        self.add_special_tokens = bool(spec.get("add_special_tokens", True))

    def encode(self, texts: list[str], max_length: int, truncate: bool = False,
               add_special_tokens: bool | None = None) -> dict[str, np.ndarray]:
        """``add_special_tokens=False`` for text that carries its own (a rendered chat template)."""
        special = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        encs = self._tok.encode_batch(texts, add_special_tokens=special)
        rows = []
        for text, enc in zip(texts, encs):
            ids, types = list(enc.ids), list(enc.type_ids)
            if not ids:
                raise InputError(f"text {text[:40]!r} has no tokens; give non-empty text")
            if len(ids) > max_length:
                if not truncate:
                    raise TooLong(
                        f"text {text[:40]!r}... is {len(ids)} tokens, longer than the model's maximum {max_length}; "
                        "shorten it or pass truncate=True (--truncate)", len(ids), max_length)
                ids, types = ids[:max_length], types[:max_length]
            rows.append((ids, types))
        width = max(len(ids) for ids, _ in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        type_ids = np.zeros((len(rows), width), dtype=np.int64)
        for i, (ids, types) in enumerate(rows):
            span = slice(width - len(ids), width) if self.padding_side == "left" else slice(0, len(ids))
            input_ids[i, span] = ids
            mask[i, span] = 1
            type_ids[i, span] = types
        return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": type_ids}

    @property
    def longest_token_bytes(self) -> int:
        """UTF-8 bytes of the vocabulary's longest token: a text of B bytes has at least B / (this + 1) tokens
        (the + 1: a word-start marker a token may stand for), so a server refuses a text past its byte bound
        without tokenizing it."""
        if self._longest is None:
            self._longest = max((len(t.encode("utf-8", "surrogatepass")) for t in self._tok.get_vocab()), default=1)
        return self._longest

    def encode_ids(self, text: str) -> list[int]:
        """Token ids of one text of any length, without special tokens (for scoring long documents)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_words(self, words: list[str]) -> tuple[list[int], list[int | None]]:
        """Token ids of pre-split words with the artifact's special tokens, and the word each token came from (None:
        a special token): a token classifier's input and how its predictions map back to the words."""
        enc = self._tok.encode(words, is_pretokenized=True, add_special_tokens=self.add_special_tokens)
        return list(enc.ids), list(enc.word_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.spec.get("chat_template"))

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}]) through the chat template the
        artifact ships (rendered the way Hugging Face does: a sandboxed Jinja environment)."""
        if not self.has_chat_template:
            raise InputError(f"artifact {self.root} ships no chat template; send a plain prompt "
                             "(/v1/completions, kiln generate without --chat)")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise InputError("messages must be a non-empty list of {\"role\": str, \"content\": str}")
        if self._template is None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as e:
                raise InputError("chat templates are rendered with jinja2: pip install 'kiln[serve]' (or jinja2)") from e

            def raise_exception(message: str) -> None:
                raise InputError(f"the chat template refused the messages: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            path = self.root / self.spec["chat_template"]
            bounded(path, MAX_TEMPLATE_BYTES)
            self._template = env.from_string(path.read_text())
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.spec.get("bos_token") or "",
                                         eos_token=self.spec.get("eos_token") or "")
        except InputError:
            raise
        except Exception as e:  # a template error is the artifact's, with the line jinja reports
            raise ArtifactError(f"the chat template in {self.root} failed: {e}") from e
