"""ONNX Runtime backend (CPU now; the CUDA provider works the same way when installed)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from kiln.errors import ArtifactError
from kiln.runtimes.artifact import Manifest
from kiln.runtimes.base import Runtime

log = logging.getLogger(__name__)


class OnnxRuntime(Runtime):
    name = "onnxruntime"

    def __init__(self, threads: int | None = None, providers: list[str] | None = None,
                 optimization: str = "all", session_config: dict[str, str] | None = None) -> None:
        self.threads = threads
        self.session_config = dict(session_config or {})
        self.providers = providers or ["CPUExecutionProvider"]
        self.optimization = optimization
        self._session: ort.InferenceSession | None = None
        self._output_names: list[str] = []
        self._input_names: set[str] = set()

    def load(self, manifest: Manifest, graph: str = "model") -> None:
        opts = ort.SessionOptions()
        if self.threads:
            opts.intra_op_num_threads = self.threads
            opts.inter_op_num_threads = 1
        opts.graph_optimization_level = {
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[self.optimization]
        for key, value in self.session_config.items():  # e.g. session.intra_op.allow_spinning
            opts.add_session_config_entry(key, value)
        path = manifest.graph_path(graph)
        try:
            self._session = ort.InferenceSession(str(path), opts, providers=self.providers)
        except Exception as e:  # ORT raises its own untyped errors
            raise ArtifactError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}; recompile the artifact") from e
        self._output_names = [o.name for o in self._session.get_outputs()]
        # The manifest may list inputs the graph no longer reads (eliminate-unused-io): accepted, not fed.
        self._input_names = {i.name for i in self._session.get_inputs()}
        log.debug("loaded %s with %s", path, self._session.get_providers())

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            raise RuntimeError("OnnxRuntime.run called before load() or after close()")
        values = self._session.run(self._output_names, {k: v for k, v in feeds.items() if k in self._input_names})
        return dict(zip(self._output_names, values))

    def close(self) -> None:
        self._session = None
