"""ONNX Runtime backend (CPU now; the CUDA provider works the same way when installed)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from kiln.errors import ArtifactError
from kiln.runtimes.artifact import Manifest
from kiln.runtimes.base import CacheRunner, Runtime, Seq2SeqRunner

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
        try:
            values = self._session.run(self._output_names, {k: v for k, v in feeds.items() if k in self._input_names})
        except Exception as e:  # feeds were validated: a failure here is the graph's
            raise _failure(e) from e
        return dict(zip(self._output_names, values))

    def close(self) -> None:
        self._session = None

    def cache_runner(self, kv: dict, batch: int) -> CacheRunner:
        if self._session is None:
            raise RuntimeError("OnnxRuntime.cache_runner called before load() or after close()")
        return SharedBufferCache(self._session, kv, batch)

    def seq2seq_runner(self, kv: dict, cross: dict[str, np.ndarray], mask: np.ndarray) -> Seq2SeqRunner:
        if self._session is None:
            raise RuntimeError("OnnxRuntime.seq2seq_runner called before load() or after close()")
        return BoundSeq2SeqCache(self._session, kv, cross, mask)


class BoundSeq2SeqCache(Seq2SeqRunner):
    """Cross keys/values and the encoder mask are bound once as OrtValues over the encoder's output
    memory: never recomputed, never copied per step. The self-attention cache is ORT's own output of
    one step, bound as the next step's input without passing through numpy."""

    def __init__(self, session: ort.InferenceSession, kv: dict, cross: dict[str, np.ndarray], mask: np.ndarray) -> None:
        self.session = session
        self.binding = session.io_binding()
        mask = np.ascontiguousarray(mask, dtype=np.int64)
        self.fixed = {"encoder_attention_mask": ort.OrtValue.ortvalue_from_numpy(mask),
                      **{n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(cross[n])) for n in kv["cross"]}}
        for name, value in self.fixed.items():
            self.binding.bind_ortvalue_input(name, value)
        empty = np.zeros((mask.shape[0], kv["num_kv_heads"], 0, kv["head_size"]), np.float32)
        self.past = {n: ort.OrtValue.ortvalue_from_numpy(empty) for n in kv["past"]}
        self.pairs = list(zip(kv["past"], kv["present"]))
        self.outputs = ["logits"] + [present for _, present in self.pairs]
        self._keep: np.ndarray | None = None

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self._keep = np.ascontiguousarray(tokens, dtype=np.int64)
        self.binding.bind_cpu_input("decoder_input_ids", self._keep)
        for past, _ in self.pairs:
            self.binding.bind_ortvalue_input(past, self.past[past])
        for name in self.outputs:
            self.binding.bind_output(name)
        _run_bound(self.session, self.binding)
        values = self.binding.get_outputs()
        self.past = {past: values[1 + i] for i, (past, _) in enumerate(self.pairs)}
        return values[0].numpy()


class SharedBufferCache(CacheRunner):
    """One zeroed (batch, kv heads, capacity, head size) buffer per layer and key/value, bound through
    IO binding as both the past input and the present output: GroupQueryAttention appends in place,
    so a step allocates and copies no cache. Only the token ids, the mask and the logits move."""

    def __init__(self, session: ort.InferenceSession, kv: dict, batch: int) -> None:
        self.session = session
        shape = (batch, kv["num_kv_heads"], kv["capacity"], kv["head_size"])
        self.buffers = {name: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for name in kv["past"]}
        self.binding = session.io_binding()
        for past, present in zip(kv["past"], kv["present"]):
            self.binding.bind_ortvalue_input(past, self.buffers[past])
            self.binding.bind_ortvalue_output(present, self.buffers[past])
        self._keep: list[np.ndarray] = []
        self.vocab = int(next(o.shape[-1] for o in session.get_outputs() if o.name == "logits"))

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        logits = np.empty((*ids.shape, self.vocab), np.float32)
        self._keep = [ids, mask]  # bound by pointer: must outlive the run
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("attention_mask", mask)
        self.binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        _run_bound(self.session, self.binding)
        return logits

    def close(self) -> None:
        self.buffers = {}


def _run_bound(session: ort.InferenceSession, binding: ort.IOBinding) -> None:
    try:
        session.run_with_iobinding(binding)
    except Exception as e:  # feeds were validated: a failure here is the graph's
        raise _failure(e) from e


def _failure(e: Exception) -> ArtifactError:
    detail = " ".join(str(e).split())[:300]
    return ArtifactError(f"ONNX Runtime failed running the artifact's graph ({detail}); the artifact is broken: "
                         "recompile it, and report it if it persists")
