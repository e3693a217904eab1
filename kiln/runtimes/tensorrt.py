"""TensorRT engines for an artifact: what is missing on this machine, and the build (TensorRT 10.x and 11.x, one
code path). Imported only when asked for (``kiln build-engine``, ``backend="auto"``); ``tensorrt`` itself is the
``gpu`` extra and is imported inside the functions that need it.

The build follows TensorRT's documented Python API: a strongly typed network (10.x: the ``STRONGLY_TYPED``
creation flag; 11.x: always) from the ONNX parser reading the graph file (its external data beside it), parser
errors reported per node, one optimization profile per ``engines.input_profiles``, a persisted timing cache,
``build_serialized_network``; the plan goes to ``engines/<key>.plan`` beside ``<key>.json`` (the record a later
load checks with ``engines.refusal``). Precision lives in the graph (TensorRT 11 removed the builder's precision
flags): the artifact's own Casts and Q/DQ decide it.

The runtime backend (``TensorRTRuntime``, ``backend="tensorrt"``) loads the first engine in ``engines/`` whose record
matches this TensorRT, this GPU, the artifact's precision and graph (a stale or foreign one is refused with the reason),
keeps one execution context, device buffers that grow to the largest shape seen, and one CUDA stream; a run sets
each input's shape, copies the feeds in, ``execute_async_v3``, copies the outputs out. Device memory and streams come
from the CUDA driver API through ctypes (``CudaDriver``): no torch, pycuda or cuda-python. TensorRT-target decoders
carry their KV cache as standard-op Concats (``kv-cache-concat``): ``DeviceCache`` keeps it on the GPU between
steps, ping-ponging two buffers per cache tensor.

Nothing in this module has run on a GPU in kiln's CI: it is written to TensorRT's documented API, type-checked
against ``tensorrt-stubs`` (``make typecheck``), and ``tools/gpu_check.py`` exercises it where a GPU is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError, KilnError, UsageError
from kiln.runtimes.artifact import Manifest, cache_shape, read_manifest
from kiln.runtimes.base import CacheRunner, Runtime, check_assumptions
from kiln.runtimes.cuda import CudaDriver, compute_capability
from kiln.runtimes.engines import (
    EngineRecord,
    axis_ranges,
    input_profiles,
    outside_profile,
    parse_profile,
    pick,
    refusal,
)

INSTALL = ("pip install 'kiln[gpu]' on a machine with an NVIDIA GPU (the tensorrt-cu12 wheels come from NVIDIA's "
           "index: --extra-index-url https://pypi.nvidia.com)")


log = logging.getLogger(__name__)


def trt_logger(trt: Any) -> Any:
    """TensorRT's logger at kiln's verbosity: its verbose log with ``kiln -v`` (debug logging), warnings otherwise;
    TensorRT writes it to stderr."""
    return trt.Logger(trt.Logger.VERBOSE if log.isEnabledFor(logging.DEBUG) else trt.Logger.WARNING)


class EngineUnavailableError(KilnError):
    """TensorRT or an NVIDIA GPU is missing here (exit 1)."""


class EngineBuildError(KilnError):
    """TensorRT could not parse or build the artifact's graph."""


def tensorrt_version() -> str | None:
    """The installed TensorRT's version; None when it is absent, or present only as type stubs (``tensorrt-stubs``
    installs a bare ``tensorrt`` namespace package: importable, but no library behind it)."""
    try:
        import tensorrt as trt
    except ImportError:
        return None
    version = getattr(trt, "__version__", None)
    return str(version) if version and hasattr(trt, "Builder") else None


def missing() -> str | None:
    """What this machine lacks for building or running TensorRT engines, in one phrase (None: nothing)."""
    problems = []
    if tensorrt_version() is None:
        problems.append("TensorRT is not installed")
    if compute_capability() is None:
        problems.append("no NVIDIA GPU is visible (no CUDA driver or device)")
    return " and ".join(problems) or None


def graph_sha256(manifest: Manifest) -> str:
    """The graph's identity for the cache key: its file and its external weights, from the sha256s ``read_manifest``
    has just checked (no second read of a multi-GB file)."""
    name = manifest.graph_path().name
    parts = sorted((f, h) for f, h in manifest.data["files"].items() if f == name or f.startswith(name + "."))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def engines_dir(manifest: Manifest) -> Path:
    return manifest.root / "engines"


def build(artifact: str | Path, precision: str | None = None, profile: str | None = None, force: bool = False,
          workspace_gb: float = 4.0, say: Any = print) -> Path:
    """Build (or reuse) the engine of ``artifact`` for this GPU; returns the plan's path."""
    problem = missing()
    if problem:
        raise EngineUnavailableError(f"kiln build-engine needs TensorRT and an NVIDIA GPU: {problem}; {INSTALL}")
    import tensorrt as trt

    manifest = read_manifest(artifact)
    if manifest.kind == "seq2seq":
        raise UsageError(f"{artifact} is an encoder-decoder; kiln build-engine builds single-graph artifacts")
    recipe = precision or str(manifest.data.get("precision"))
    profiles = input_profiles(manifest.data, axis_ranges(manifest.data, parse_profile(profile) if profile else None))
    graph = manifest.graph_path()
    wanted = EngineRecord(str(trt.__version__), compute_capability() or "", profiles, recipe, graph_sha256(manifest))
    out = engines_dir(manifest)
    plan, record_path = out / f"{wanted.key}.plan", out / f"{wanted.key}.json"
    if plan.is_file() and record_path.is_file() and not force:
        why = refusal(EngineRecord.from_json(json.loads(record_path.read_text())), wanted)
        if why is None:
            say(f"engine {plan} is current for this GPU; reusing it (--force rebuilds)")
            return plan
    out.mkdir(exist_ok=True)
    logger = trt_logger(trt)
    builder = trt.Builder(logger)
    major = int(str(trt.__version__).split(".")[0])
    flags = 0 if major >= 11 else 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        detail = "; ".join(f"node {e.node()} ({e.node_name()}): {e.desc()}" for e in errors[:5])
        raise EngineBuildError(f"TensorRT {trt.__version__} cannot parse {graph}: {detail}; report it with the "
                               "artifact's manifest")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    opt = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profiles.items():
        if any(network.get_input(i).name == name for i in range(network.num_inputs)):
            opt.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(mid)), trt.Dims(list(hi)))
    config.add_optimization_profile(opt)
    timing_path = out / f"timing-{trt.__version__}-{wanted.compute_capability}.cache"
    cache = config.create_timing_cache(timing_path.read_bytes() if timing_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    t = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT {trt.__version__} could not build {graph} for compute capability "
                               f"{wanted.compute_capability}; rerun as kiln -v build-engine ... for TensorRT's verbose log")
    tmp = plan.with_suffix(".plan.tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(plan)
    timing_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    record_path.write_text(json.dumps(wanted.to_json() | {"seconds": round(time.perf_counter() - t, 1)}, indent=2))
    say(f"built {plan} in {time.perf_counter() - t:.0f} s (TensorRT {trt.__version__}, compute capability "
        f"{wanted.compute_capability}, precision {recipe})")
    return plan


def stored_engines(manifest: Manifest) -> list[tuple[str, EngineRecord]]:
    """Every engine record in the artifact's ``engines/`` with a plan beside it, newest first."""
    out = []
    folder = engines_dir(manifest)
    records = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []
    for path in records:
        if path.name.startswith("timing-") or not path.with_suffix(".plan").is_file():
            continue
        try:
            out.append((path.with_suffix(".plan").name, EngineRecord.from_json(json.loads(path.read_text()))))
        except (ValueError, ArtifactError):
            continue  # a torn or foreign record: not an engine this kiln can vouch for
    return out


def usable_engine(manifest: Manifest) -> tuple[Path | None, str]:
    """The engine this machine may run for the artifact, or None and why not (one phrase)."""
    problem = missing()
    if problem:
        return None, problem
    stored = stored_engines(manifest)
    if not stored:
        return None, f"no engine in {engines_dir(manifest)} (kiln build-engine {manifest.root})"
    wanted = EngineRecord(tensorrt_version() or "", compute_capability() or "", {}, str(manifest.data.get("precision")),
                          graph_sha256(manifest))
    name, refused = pick(stored, wanted)
    if name is None:
        return None, "; ".join(refused)
    return engines_dir(manifest) / name, ""


class TensorRTRuntime(Runtime):
    """Runs an artifact's TensorRT engine (``backend="tensorrt"``); decoders generate through ``DeviceCache``."""

    name = "tensorrt"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[str, tuple[int, int]] = {}  # tensor name -> (device pointer, bytes)
        self._engine: Any = None
        self._context: Any = None
        self._cuda: CudaDriver | None = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._profiles: dict[str, Any] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._runtime: Any = None
        self.plan: Path | None = None

    def load(self, manifest: Manifest, graph: str = "model") -> None:
        if graph != "model":
            raise ArtifactError("backend tensorrt runs single-graph artifacts; use backend onnxruntime for "
                                "encoder-decoders")
        plan, why = usable_engine(manifest)
        if plan is None:
            fix = f"; {INSTALL}" if missing() else ""
            raise EngineUnavailableError(f"backend tensorrt cannot run {manifest.root}: {why}{fix}")
        import tensorrt as trt

        self._cuda = CudaDriver()
        with self._cuda.current():
            self._runtime = trt.Runtime(trt_logger(trt))
            self._engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
            if self._engine is None:
                raise ArtifactError(f"TensorRT {trt.__version__} could not deserialize {plan}; rebuild it with "
                                    "kiln build-engine --force")
            self._context = self._engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self._inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._dtypes = {n: np.dtype(trt.nptype(self._engine.get_tensor_dtype(n))) for n in names}
        self._profiles = {n: tuple(tuple(d) for d in self._engine.get_tensor_profile_shape(n, 0)) for n in self._inputs}
        self.plan = plan
        self.assume(manifest, graph)

    def _buffer(self, name: str, nbytes: int) -> int:
        assert self._cuda is not None
        ptr, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if ptr:
                self._cuda.free(ptr)
            ptr, size = self._cuda.alloc(nbytes), nbytes
            self._buffers[name] = (ptr, size)
        return ptr

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return check_assumptions(self.execute(feeds, {}, {}, None), self.assumed, self.graph)

    def execute(self, feeds: Mapping[str, np.ndarray], device_inputs: Mapping[str, tuple[int, tuple[int, ...]]],
                device_outputs: Mapping[str, int], fetch: list[str] | None) -> dict[str, np.ndarray]:
        """One engine run. ``feeds``: host arrays, copied in; ``device_inputs``: (pointer, shape) of inputs already
        on the GPU (a KV cache); ``device_outputs``: outputs written straight into GPU buffers the caller owns;
        ``fetch``: the outputs copied back (None: every output not in ``device_outputs``)."""
        if self._context is None or self._cuda is None:
            from kiln.errors import ClosedError

            raise ClosedError("the TensorRT engine was closed (or never loaded); load the artifact again to run it")
        arrays = {n: np.ascontiguousarray(feeds[n], dtype=self._dtypes[n]) for n in self._inputs if n in feeds}
        absent = [n for n in self._inputs if n not in arrays and n not in device_inputs]
        if absent:
            raise InputError(f"the engine takes input(s) {', '.join(absent)} that were not fed")
        problem = outside_profile({**{n: a.shape for n, a in arrays.items()},
                                   **{n: shape for n, (_, shape) in device_inputs.items()}}, self._profiles)
        if problem:
            raise InputError(problem)
        wanted = [n for n in self._outputs if n not in device_outputs] if fetch is None else fetch
        with self._lock, self._cuda.current():  # the context is current per thread: push it on the calling one
            for name, array in arrays.items():
                if not self._context.set_input_shape(name, array.shape):
                    raise InputError(f"TensorRT refused shape {list(array.shape)} for input {name}")
                ptr = self._buffer(name, array.nbytes)
                self._cuda.to_device(ptr, array)
                self._context.set_tensor_address(name, ptr)
            for name, (ptr, shape) in device_inputs.items():
                if not self._context.set_input_shape(name, shape):
                    raise InputError(f"TensorRT refused shape {list(shape)} for input {name}")
                self._context.set_tensor_address(name, ptr)
            unresolved = self._context.infer_shapes()
            if unresolved:
                raise ArtifactError(f"TensorRT could not infer the shapes of {', '.join(unresolved)}; rebuild the engine")
            out: dict[str, np.ndarray] = {}
            for name in self._outputs:
                if name in device_outputs:
                    self._context.set_tensor_address(name, device_outputs[name])
                    continue
                shape = tuple(self._context.get_tensor_shape(name))
                host = np.empty(shape, self._dtypes[name])
                self._context.set_tensor_address(name, self._buffer(name, host.nbytes))
                if name in wanted:
                    out[name] = host
            if not self._context.execute_async_v3(self._cuda.stream_handle):
                raise ArtifactError(f"TensorRT failed to execute {self.plan}; rerun with kiln -v (or "
                                    "logging at DEBUG) for TensorRT's verbose log")
            for name, array in out.items():
                self._cuda.to_host(array, self._buffers[name][0])
            self._cuda.synchronize()
        return out

    def cache_runner(self, kv: dict, batch: int, length: int | None = None) -> CacheRunner:
        return DeviceCache(self, kv, batch, length)

    def close(self) -> None:
        with self._lock:
            if self._cuda is not None:
                with self._cuda.current():
                    for ptr, _ in self._buffers.values():
                        self._cuda.free(ptr)
                    self._buffers = {}
                    self._context = self._engine = self._runtime = None
                self._cuda.close()
                self._cuda = None


class DeviceCache(CacheRunner):
    """A decoder's KV cache kept on the GPU between steps: two device buffers per cache tensor, sized for the request
    (``length`` positions, else the capacity). A step reads the past from one and the engine writes the present (past
    plus the new positions, the graph's Concat) into the other; then they swap. Only the token ids, the mask and the
    logits cross the bus."""

    def __init__(self, runtime: TensorRTRuntime, kv: dict, batch: int, length: int | None = None) -> None:
        if runtime._cuda is None:
            from kiln.errors import ClosedError

            raise ClosedError("the TensorRT engine was closed; load the artifact again to generate")
        self.runtime = self.engine = runtime
        self.cuda = runtime._cuda
        self.positions = int(length or kv["capacity"])
        self.kv, self.batch = kv, batch
        self.pairs = list(zip(kv["past"], kv["present"]))
        itemsize = runtime._dtypes[self.pairs[0][0]].itemsize
        self.buffers = {}
        for past, _ in self.pairs:
            nbytes = int(np.prod(cache_shape(kv, past, batch, self.positions))) * itemsize
            self.buffers[past] = [self.cuda.alloc(nbytes), self.cuda.alloc(nbytes)]
        self.current = 0
        self.past_len = 0
        self.fixed = {kv["logits_to_keep"]: np.array(1, np.int64)} if kv.get("logits_to_keep") else {}

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        new = int(input_ids.shape[1])
        if self.past_len + new > self.positions:
            raise InputError(f"the request needs {self.past_len + new} positions but its cache holds {self.positions}; "
                             "ask for fewer new tokens")
        inputs = {past: (self.buffers[past][self.current], cache_shape(self.kv, past, self.batch, self.past_len))
                  for past, _ in self.pairs}
        outputs = {present: self.buffers[past][1 - self.current] for past, present in self.pairs}
        out = self.engine.execute({"input_ids": input_ids, "attention_mask": attention_mask, **self.fixed}, inputs,
                                   outputs, ["logits"])
        self.current, self.past_len = 1 - self.current, self.past_len + new
        return out["logits"]

    def close(self) -> None:
        for pair in self.buffers.values():
            for ptr in pair:
                self.cuda.free(ptr)
        self.buffers = {}
