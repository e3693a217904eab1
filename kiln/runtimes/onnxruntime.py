"""ONNX Runtime backend (CPU now; the CUDA provider works the same way when installed)."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from kiln.errors import ArtifactError, ClosedError, GraphRunError
from kiln.runtimes import kernels
from kiln.runtimes.artifact import Manifest, cache_shape
from kiln.runtimes.base import CacheRunner, Runtime, Seq2SeqRunner, check_assumptions

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
        self._path = "the artifact"
        self.pool = BufferPool()
        self.kernels: dict | None = None
        """What computes the artifact's kiln nodes here (``kernels.graph_file``); None: it has none."""

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
        path, self.kernels = kernels.graph_file(manifest, graph, opts, self.optimization)
        providers = [(p, tensorrt_provider_options(manifest)) if p == "TensorrtExecutionProvider" else p
                     for p in self.providers]
        try:
            self._session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as e:  # ORT raises its own untyped errors
            raise _load_failure(e, path, manifest, self.providers) from e
        self._path = str(path)
        self.assume(manifest, graph)
        self._output_names = [o.name for o in self._session.get_outputs()]
        # The manifest may list inputs the graph no longer reads (eliminate-unused-io): accepted, not fed.
        self._input_names = {i.name for i in self._session.get_inputs()}
        log.debug("loaded %s with %s", path, self._session.get_providers())

    @property
    def session(self) -> ort.InferenceSession:
        """The live session; kiln's own error once ``close()`` released it (a call in flight keeps its reference
        and finishes; the next one stops here)."""
        session = self._session
        if session is None:
            raise ClosedError(f"{self._path} was closed (or never loaded); load the artifact again to run it")
        return session

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.session
        try:
            values = session.run(self._output_names, {k: v for k, v in feeds.items() if k in self._input_names})
        except Exception as e:  # feeds were validated: a failure here is the graph's
            raise _failure(e) from e
        return check_assumptions(dict(zip(self._output_names, values)), self.assumed, self.graph)

    def close(self) -> None:
        self._session = None
        self.pool.clear()

    def cache_runner(self, kv: dict, batch: int, length: int | None = None) -> CacheRunner:
        if not kv.get("shared_buffer", True):  # a Concat cache (TensorRT graphs): the present grows, fed back
            return CacheRunner(self, kv, batch)
        return SharedBufferCache(self, kv, batch, length)

    def seq2seq_runner(self, kv: dict, cross: dict[str, np.ndarray], mask: np.ndarray) -> Seq2SeqRunner:
        return BoundSeq2SeqCache(self.session, kv, cross, mask)

    def keeps_rows(self, kv: dict) -> bool:
        return bool(kv.get("row_lengths")) and bool(kv.get("shared_buffer", True))

    def slot_cache(self, kv: dict, slots: int, positions: int, pooled: bool = False) -> SlotCache:
        if not kv.get("shared_buffer", True):
            return super().slot_cache(kv, slots, positions, pooled)
        return SlotCache(self, kv, slots, positions, pooled)


BUCKET_MIN = 64
"""Smallest KV buffer a request gets (positions); larger requests round up to the next power of two."""


def bucket(need: int, capacity: int) -> int:
    """KV positions to allocate for ``need`` (prompt + new tokens): the next power of two from ``BUCKET_MIN``, at
    most the artifact's capacity, so requests of similar length share pooled buffers."""
    size = BUCKET_MIN
    while size < need:
        size *= 2
    return min(size, capacity)


class BufferPool:
    """Idle KV buffer sets by (batch, positions): a generate call takes one for its whole run and gives it back at
    the end, so concurrent calls never share a buffer and a later call of the same size allocates nothing. At most
    ``keep`` idle sets are held (the oldest dropped first): memory stays flat under any request mix."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._idle: list[tuple[tuple[int, int], dict[str, np.ndarray]]] = []
        self._lock = threading.Lock()

    def take(self, kv: dict, batch: int, positions: int) -> dict[str, np.ndarray]:
        """One buffer per past name of ``kv`` (each its layer's own shape, ``cache_shape``), ``positions`` long."""
        key = (batch, positions)
        with self._lock:
            found = next((i for i, (k, _) in enumerate(self._idle) if k == key), None)
            buffers = self._idle.pop(found)[1] if found is not None else None
        if buffers is None:
            return {name: np.zeros(cache_shape(kv, name, batch, positions), np.float32) for name in kv["past"]}
        for b in buffers.values():  # positions past a request's length are never read; zeroed all the same
            b.fill(0)
        return buffers

    def give(self, batch: int, positions: int, buffers: dict[str, np.ndarray]) -> None:
        with self._lock:
            self._idle.append(((batch, positions), buffers))
            del self._idle[:-self.keep]

    def clear(self) -> None:
        with self._lock:
            self._idle = []


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
        self.past = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros(cache_shape(kv, n, mask.shape[0], 0), np.float32))
                     for n in kv["past"]}
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
    """One zeroed (batch, kv heads, positions, head size) buffer per layer and key/value, bound through
    IO binding as both the past input and the present output: GroupQueryAttention appends in place,
    so a step allocates and copies no cache. Only the token ids, the mask and the logits move.
    ``length``: the positions this request needs (prompt + new tokens), rounded up by ``bucket``; the buffers
    come from the runtime's pool and go back to it at ``close``."""

    def __init__(self, runtime: OnnxRuntime, kv: dict, batch: int, length: int | None = None) -> None:
        self.runtime = runtime
        session = runtime.session
        cap = int(kv["capacity"])
        self.batch, self.positions = batch, bucket(length, cap) if length else cap
        self.arrays = runtime.pool.take(kv, self.batch, self.positions)
        self.buffers = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in self.arrays.items()}
        self.binding = session.io_binding()
        for past, present in zip(kv["past"], kv["present"]):
            self.binding.bind_ortvalue_input(past, self.buffers[past])
            self.binding.bind_ortvalue_output(present, self.buffers[past])
        self._keep: list[np.ndarray] = []
        self.vocab = int(next(o.shape[-1] for o in session.get_outputs() if o.name == "logits"))
        self.last_only = bool(kv.get("logits_to_keep"))
        if self.last_only:  # the head for the last position only: a prefill computes and returns one row
            self._one = np.array(1, np.int64)
            self.binding.bind_cpu_input(kv["logits_to_keep"], self._one)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        logits = np.empty((ids.shape[0], 1 if self.last_only else ids.shape[1], self.vocab), np.float32)
        self._keep = [ids, mask]  # bound by pointer: must outlive the run
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("attention_mask", mask)
        self.binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        _run_bound(self.runtime.session, self.binding)
        return logits

    def close(self) -> None:
        if self.buffers:
            self.buffers = {}
            self.binding = None
            self.runtime.pool.give(self.batch, self.positions, self.arrays)
            self.arrays = {}


class SlotCache:
    """The KV cache of continuous batching (``kiln.runtimes.scheduler``): one (slots, kv heads, positions, head size)
    buffer per layer and key/value, a request per row. ``prefill`` binds rows ``[lo, lo + k)`` alone (a view of the
    same memory) and writes k prompts from position 0, right-padded to the longest (each row's own length is its
    past length in the graph, as in decoding; padding is written past the row's end and overwritten by its next
    tokens); ``decode`` binds rows ``[0, n)`` and feeds a right-padded mask whose last 1 in each row is where that
    row's new token goes (the graph takes each row's past length from it). Bindings are made once per row range,
    then reused. ``pooled`` (one generate call): ``positions`` rounded up by ``bucket`` and the buffers taken from
    the runtime's pool, given back at ``close``."""

    def __init__(self, runtime: OnnxRuntime, kv: dict, slots: int, positions: int, pooled: bool = False) -> None:
        self.runtime = runtime
        self.kv = kv
        self.pooled = (slots, bucket(positions, int(kv["capacity"]))) if pooled else None
        self.arrays = runtime.pool.take(kv, *self.pooled) if self.pooled else \
            {name: np.zeros(cache_shape(kv, name, slots, positions), np.float32) for name in kv["past"]}
        session = runtime.session
        self.vocab = int(next(o.shape[-1] for o in session.get_outputs() if o.name == "logits"))
        self._bindings: dict[tuple[int, int], tuple[ort.IOBinding, list]] = {}
        self._keep: list[np.ndarray] = []

    def _binding(self, lo: int, hi: int) -> ort.IOBinding:
        if (lo, hi) not in self._bindings:
            binding = self.runtime.session.io_binding()
            values = []
            for past, present in zip(self.kv["past"], self.kv["present"]):
                view = self.arrays[past][lo:hi]  # leading-axis slice of a C-contiguous array: contiguous, same memory
                value = ort.OrtValue.ortvalue_from_numpy(view)
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
                values.append(value)
            self._bindings[lo, hi] = binding, values
        return self._bindings[lo, hi][0]

    def _run(self, binding: ort.IOBinding, ids: np.ndarray, mask: np.ndarray, keep: int = 1) -> np.ndarray:
        """Logits (rows, positions kept, vocab): the last ``keep`` positions where the graph can slice, else all."""
        name = self.kv.get("logits_to_keep")
        kept = keep if name else ids.shape[1]
        logits = np.empty((ids.shape[0], kept, self.vocab), np.float32)
        self._keep = [ids, mask, np.array(keep, np.int64)]  # bound by pointer: must outlive the run
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        if name:
            binding.bind_cpu_input(name, self._keep[2])
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        _run_bound(self.runtime.session, binding)
        return logits

    def prefill(self, lo: int, prompts: Sequence[np.ndarray]) -> np.ndarray:
        """Prompts into rows ``[lo, lo + len(prompts))`` from position 0; each prompt's last logits (k, vocab). The
        graph keeps the logits of the last (longest - shortest + 1) positions, so that each row's own last position is
        among them (every position of a right-padded row past its end is padding)."""
        lengths = np.asarray([len(p) for p in prompts])
        width = int(lengths.max())
        ids = np.zeros((len(prompts), width), np.int64)
        mask = np.zeros((len(prompts), width), np.int64)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
            mask[i, :len(p)] = 1
        keep = width - int(lengths.min()) + 1
        logits = self._run(self._binding(lo, lo + len(prompts)), ids, mask, keep)
        return logits[np.arange(len(prompts)), lengths - 1 - (width - logits.shape[1])]

    def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One new token per row of rows ``[0, n)``, written at position ``lengths[row]`` of that row's cache (an idle
        row: token 0 at position 0, never read back); logits (n, vocab)."""
        lengths = np.asarray(lengths, np.int64)
        mask = (np.arange(int(lengths.max()) + 1)[None, :] <= lengths[:, None]).astype(np.int64)
        ids = np.ascontiguousarray(tokens, np.int64)[:, None]
        return self._run(self._binding(0, len(tokens)), ids, mask)[:, -1]

    def close(self) -> None:
        if self.pooled and self.arrays:
            self.runtime.pool.give(*self.pooled, self.arrays)
        self._bindings, self.arrays = {}, {}


REDUCED_NAMES = {"fp16": "float16", "bf16": "bfloat16"}


def tensorrt_provider_options(manifest: Manifest) -> dict[str, str]:
    """ONNX Runtime's TensorRT provider with its engine and timing caches in the artifact's
    ``engines/onnxruntime-trt`` (built on the first load, reused after; the provider keys them to the GPU and
    TensorRT version itself). Precision is the graph's: no FP16/INT8 builder flags."""
    cache = manifest.root / "engines" / "onnxruntime-trt"
    cache.mkdir(parents=True, exist_ok=True)
    return {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": "True", "trt_timing_cache_path": str(cache),
            "trt_max_workspace_size": str(4 << 30)}


def _load_failure(e: Exception, path: Path, manifest: Manifest, providers: list[str]) -> ArtifactError:
    """A graph ONNX Runtime cannot load. A missing kernel in a reduced-precision (TensorRT) graph is the device's
    limit, not a broken artifact: say where it runs instead."""
    first = str(e).splitlines()[0]
    dtype = REDUCED_NAMES.get(str(manifest.data.get("precision")))
    if "NOT_IMPLEMENTED" in first and dtype:
        op = first.split("implementation for ", 1)[-1].split(" node", 1)[0] if "implementation for " in first else "an op"
        where = ", ".join(p.replace("ExecutionProvider", "") for p in providers)
        return ArtifactError(f"{path}: ONNX Runtime ({where}) has no {dtype} kernel for {op}; this {dtype} graph is for "
                             "TensorRT: run it on a GPU (--backend tensorrt or onnxruntime-cuda) or compile with "
                             "--precision fp16 or fp32 for ONNX Runtime CPU")
    return ArtifactError(f"ONNX Runtime cannot load {path}: {first}; recompile the artifact")


def _run_bound(session: ort.InferenceSession, binding: ort.IOBinding) -> None:
    try:
        session.run_with_iobinding(binding)
    except Exception as e:  # feeds were validated: a failure here is the graph's
        raise _failure(e) from e


SOURCE_LINE = re.compile(r"\S+\.(?:h|cc|cpp):\d+ .*?\)(?: [^.]*? was false\.)? ")
"""The C++ file, line, function and failed condition ONNX Runtime puts before its message in a status."""


def _failure(e: Exception) -> GraphRunError:
    detail = SOURCE_LINE.sub("", " ".join(str(e).split()), count=1)[:300]
    return GraphRunError(f"ONNX Runtime failed running the artifact's graph ({detail}); the artifact is broken: "
                         "recompile it, and report it if it persists", detail)
