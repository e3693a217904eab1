"""A loaded artifact: manifest + backend + tokenizer, behind one object an app holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.errors import ArtifactError
from kiln.runtimes.artifact import Manifest
from kiln.runtimes.base import Runtime, prepare_feeds
from kiln.runtimes.tokenizer import TextEncoder


class Model:
    """Runs an artifact on numpy feeds; ``encode`` turns text into feeds when it ships a tokenizer."""

    def __init__(self, manifest: Manifest, runtime: Runtime) -> None:
        self.manifest = manifest
        self.runtime = runtime
        self._encoder: TextEncoder | None = None

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
        """Validate feeds (names, dtypes, ranks, lengths), fill optional inputs, run the graph."""
        arrays = prepare_feeds(self.manifest.inputs, feeds, self.max_sequence_length)
        return self.runtime.run(arrays)

    def encode(self, texts: str | list[str], truncate: bool = False) -> dict[str, np.ndarray]:
        """Tokenize and pad text into feeds this artifact accepts."""
        if isinstance(texts, str):
            texts = [texts]
        feeds = self.text_encoder.encode(list(texts), self.max_sequence_length, truncate=truncate)
        return {k: v for k, v in feeds.items() if k in self.input_names}

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

    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
