"""Text to feeds with the ``tokenizers`` package alone (no transformers, no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError


class TextEncoder:
    """Tokenizes a batch of texts and pads it the way the artifact was verified."""

    def __init__(self, root: Path, spec: dict[str, Any]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers is a base dependency
            raise ArtifactError("text input needs the `tokenizers` package; pip install tokenizers") from e
        path = root / spec["file"]
        self._tok = Tokenizer.from_file(str(path))
        # Checkpoints ship tokenizer.json with their training-time truncation/padding baked in;
        # kiln pads itself and refuses over-long input instead of silently cutting it.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.pad_id = int(spec.get("pad_token_id") or 0)
        self.padding_side = spec.get("padding_side", "right")
        self.add_special_tokens = bool(spec.get("add_special_tokens", True))

    def encode(self, texts: list[str], max_length: int, truncate: bool = False) -> dict[str, np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        rows = []
        for text, enc in zip(texts, encs):
            ids, types = list(enc.ids), list(enc.type_ids)
            if not ids:
                raise InputError(f"text {text[:40]!r} has no tokens; give non-empty text")
            if len(ids) > max_length:
                if not truncate:
                    raise InputError(
                        f"text {text[:40]!r}... is {len(ids)} tokens, longer than the model's maximum {max_length}; "
                        "shorten it or pass truncate=True (--truncate)"
                    )
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

    def encode_ids(self, text: str) -> list[int]:
        """Token ids of one text of any length, without special tokens (for scoring long documents)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)
