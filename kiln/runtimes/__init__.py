"""Load and run kiln artifacts with numpy and a backend only (never torch).

    import kiln.runtimes as kr
    model = kr.load("out/")
    outputs = model.run({"input_ids": ids, "attention_mask": mask})
"""

from __future__ import annotations

from pathlib import Path

from kiln.errors import ArtifactError, InputError, KilnError
from kiln.runtimes.artifact import Manifest, TensorSpec, read_manifest
from kiln.runtimes.base import Runtime
from kiln.runtimes.model import Model

BACKENDS = ("onnxruntime",)

__all__ = ["load", "open_manifest", "Model", "Manifest", "Runtime", "TensorSpec", "BACKENDS", "ArtifactError", "InputError", "KilnError"]


def make_runtime(backend: str, threads: int | None = None, optimization: str = "all",
                 session_config: dict[str, str] | None = None) -> Runtime:
    if backend == "onnxruntime":
        from kiln.runtimes.onnxruntime import OnnxRuntime

        return OnnxRuntime(threads=threads, optimization=optimization, session_config=session_config)
    raise ArtifactError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def load(path: str | Path, backend: str = "onnxruntime", threads: int | None = None,
         optimization: str = "all", session_config: dict[str, str] | None = None) -> Model:
    """Open an artifact directory: check its manifest and file checksums, then start the backend.

    ``threads`` sets the backend's intra-op threads (default: the backend's own choice);
    ``optimization`` is ONNX Runtime's graph optimisation level: disabled, basic or all;
    ``session_config`` passes ONNX Runtime session config entries through as they are.
    """
    return open_manifest(read_manifest(path), backend, threads, optimization, session_config)


def open_manifest(manifest: Manifest, backend: str = "onnxruntime", threads: int | None = None,
                  optimization: str = "all", session_config: dict[str, str] | None = None) -> Model:
    """Start the backend on an artifact whose manifest is already read (the compiler verifies its staged
    artifact this way before it writes the manifest once)."""
    runtimes = {}
    for graph in manifest.data["graphs"]:  # "model"; or "encoder" and "decoder"
        runtimes[graph] = make_runtime(backend, threads=threads, optimization=optimization, session_config=session_config)
        runtimes[graph].load(manifest, graph)
    return Model(manifest, runtimes)
