"""TensorRT engines for an artifact: what is missing on this machine, and the build (TensorRT 10.x and 11.x, one
code path). Imported only when asked for (``kiln build-engine``, ``backend="auto"``); ``tensorrt`` itself is the
``gpu`` extra and is imported inside the functions that need it.

The build follows TensorRT's documented Python API: a strongly typed network (10.x: the ``STRONGLY_TYPED``
creation flag; 11.x: always) from the ONNX parser reading the graph file (its external data beside it), parser
errors reported per node, one optimization profile per ``engines.input_profiles``, a persisted timing cache,
``build_serialized_network``; the plan goes to ``engines/<key>.plan`` beside ``<key>.json`` (the record a later
load checks with ``engines.refusal``). Precision lives in the graph (TensorRT 11 removed the builder's precision
flags): the artifact's own Casts and Q/DQ decide it.

Not yet here: the runtime backend that executes a plan (execute_async_v3, device buffers, the KV cache on the GPU)
and the GPU check script; nothing in this module has run on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, UsageError
from kiln.runtimes.artifact import Manifest, read_manifest
from kiln.runtimes.engines import EngineRecord, axis_ranges, input_profiles, parse_profile, refusal

INSTALL = ("pip install 'kiln[gpu]' on a machine with an NVIDIA GPU (the tensorrt-cu12 wheels come from NVIDIA's "
           "index: --extra-index-url https://pypi.nvidia.com)")


class EngineUnavailableError(KilnError):
    """TensorRT or an NVIDIA GPU is missing here (exit 1)."""


class EngineBuildError(KilnError):
    """TensorRT could not parse or build the artifact's graph."""


def compute_capability() -> str | None:
    """The first GPU's compute capability ("9.0") through the CUDA driver API, or None when there is no driver
    or no device (no torch, no CUDA toolkit needed)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    count, dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev):
        return None
    return f"{major.value}.{minor.value}"


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
    logger = trt.Logger(trt.Logger.WARNING)
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
                               f"{wanted.compute_capability}; rerun with --verbose for TensorRT's log")
    tmp = plan.with_suffix(".plan.tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(plan)
    timing_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    record_path.write_text(json.dumps(wanted.to_json() | {"seconds": round(time.perf_counter() - t, 1)}, indent=2))
    say(f"built {plan} in {time.perf_counter() - t:.0f} s (TensorRT {trt.__version__}, compute capability "
        f"{wanted.compute_capability}, precision {recipe})")
    return plan
