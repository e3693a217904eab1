"""The one place the defaults of ``kiln bench`` and ``kiln report`` live, for the CLI and the Python API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchOptions:
    batch_sizes: tuple[int, ...] = (1,)
    seq_lens: tuple[int, ...] = (128,)
    budget_s: float = 2.0
    """Timing budget per system and shape, split over ``rounds`` alternating rounds."""
    rounds: int = 5
    threads: int | None = None
    backend: str = "onnxruntime"
    """kiln.runtimes.BACKENDS; ``auto`` picks one and the result records which and why."""
    concurrent: tuple[int, ...] = ()
    """Decoders: also drive N concurrent synthetic requests through continuous batching, for each N."""
    new_tokens: int = 64
    """Tokens each concurrent request generates."""


@dataclass(frozen=True)
class ReportOptions:
    max_texts: int = 64
    """Texts used from the data file."""
    max_tokens: int = 128
    """Tokens per text."""
    latency_s: float = 3.0
    """Seconds spent measuring the latency distribution."""
    threads: int | None = None
    backend: str = "onnxruntime"
    """kiln.runtimes.BACKENDS; ``auto`` picks one and report.json's measured_on records which and why."""
    evals: tuple[str, ...] = ()
    """Labelled JSONL sets scored with task metrics (kiln.evaluate.tasks), the reference beside each artifact."""
    eval_task: str | None = None
    """The task of every --eval set, where its fields do not say it (summarization: source + reference)."""
    eval_examples: int = 1000
    """Examples used from each --eval set."""
    eval_new_tokens: int = 32
    """Tokens generated per example for exact match, translation and summaries."""
    eval_chat: bool = False
    """Decoders: each --eval prompt goes through the artifact's chat template as one user message."""
