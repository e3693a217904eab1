"""Load and run kiln artifacts with numpy and a backend only (never torch).

    import kiln.runtimes as kr
    model = kr.load("out/")
    outputs = model.run({"input_ids": ids, "attention_mask": mask})
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from kiln.errors import ArtifactError, InputError, KilnError
from kiln.runtimes import canary
from kiln.runtimes.canary import CanaryError
from kiln.runtimes.artifact import Manifest, TensorSpec, read_manifest
from kiln.runtimes.base import Runtime
from kiln.runtimes.model import Model

BACKENDS = ("auto", "tensorrt", "onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda", "onnxruntime-tensorrt")
"""``auto``: the first that can run here, in the order TensorRT (an engine for this GPU), ONNX Runtime CUDA, ONNX
Runtime CPU; the choice and the reasons for skipping the others are logged and kept in ``Model.backend``.
``onnxruntime`` is ``onnxruntime-cpu``. ``onnxruntime-tensorrt`` (asked for by name only: its first load builds
engines, which takes minutes) is ONNX Runtime's TensorRT execution provider, its engine and timing caches kept in the
artifact's ``engines/onnxruntime-trt``, falling back to CUDA and CPU for what TensorRT does not take."""

log = logging.getLogger("kiln.runtimes")

__all__ = ["load", "open_manifest", "run_canary", "Model", "Manifest", "Runtime", "TensorSpec", "BACKENDS", "ArtifactError", "CanaryError", "InputError", "KilnError"]


def make_runtime(backend: str, threads: int | None = None, optimization: str = "all",
                 session_config: dict[str, str] | None = None) -> Runtime:
    if backend in ("onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda", "onnxruntime-tensorrt"):
        from kiln.runtimes.onnxruntime import OnnxRuntime

        providers: list = ["CPUExecutionProvider"]
        if backend == "onnxruntime-tensorrt":
            why = provider_missing("TensorrtExecutionProvider")
            if why:
                raise ArtifactError(f"backend onnxruntime-tensorrt: {why}; pip install 'kiln[gpu]' (onnxruntime-gpu with "
                                    "TensorRT's libraries) on a machine with an NVIDIA GPU, or use backend onnxruntime-cpu")
            providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
        elif backend == "onnxruntime-cuda":
            why = cuda_missing()
            if why:
                raise ArtifactError(f"backend onnxruntime-cuda: {why}; pip install 'kiln[gpu]' (onnxruntime-gpu) on "
                                    "a machine with an NVIDIA GPU, or use backend onnxruntime-cpu")
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return OnnxRuntime(threads=threads, providers=providers, optimization=optimization,
                           session_config=session_config)
    if backend == "tensorrt":
        from kiln.runtimes.tensorrt import TensorRTRuntime

        return TensorRTRuntime()
    raise ArtifactError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def provider_missing(provider: str) -> str | None:
    """Why ONNX Runtime cannot use ``provider`` here (None: it can)."""
    import onnxruntime as ort

    if provider not in ort.get_available_providers():
        return f"this onnxruntime has no {provider.replace('ExecutionProvider', '')} execution provider"
    from kiln.runtimes.cuda import compute_capability

    return None if compute_capability() else "no NVIDIA GPU is visible"


def cuda_missing() -> str | None:
    return provider_missing("CUDAExecutionProvider")


def choose_backend(manifest: Manifest) -> tuple[str, dict[str, str]]:
    """``auto``: the backend to use here and why each one before it was skipped."""
    from kiln.runtimes.tensorrt import usable_engine

    skipped: dict[str, str] = {}
    if len(manifest.data["graphs"]) > 1:
        skipped["tensorrt"] = "encoder-decoder artifacts run on ONNX Runtime only"
    else:
        plan, why_not = usable_engine(manifest)
        if plan is not None:
            return "tensorrt", skipped
        skipped["tensorrt"] = why_not
    why = cuda_missing()
    if why is None:
        return "onnxruntime-cuda", skipped
    skipped["onnxruntime-cuda"] = why
    return "onnxruntime-cpu", skipped


def cpu_session_config(manifest: Manifest, chosen: str) -> dict[str, str]:
    """What a TensorRT INT8 artifact needs on ONNX Runtime's CPU (verification, and the CPU fallback): its
    symmetric int8 Q/DQ pairs, fused by ONNX Runtime into int8 x int8 kernels, add pairs of products in int16
    with saturation on x86 CPUs without VNNI (top-1 dropped to 86% on a tiny Llama on an AVX2 machine). With
    the fusion off, DequantizeLinear and an FP32 MatMul compute what TensorRT computes (int32 sums), on
    every CPU. The CPU targets' graphs store uint8 codes instead and keep their integer kernels."""
    if chosen in ("onnxruntime", "onnxruntime-cpu") and manifest.data.get("target") == "tensorrt":
        return {"session.disable_quant_qdq": "1"}
    return {}


def load(path: str | Path, backend: str = "onnxruntime", threads: int | None = None,
         optimization: str = "all", session_config: dict[str, str] | None = None, check: bool = True) -> Model:
    """Open an artifact directory: check its manifest and file checksums, start the backend, then (``check``) run
    the artifact's canary on it (``kiln.runtimes.canary``): an artifact that computes another answer here than where
    it was verified is refused with ``CanaryError`` (one line: this machine, the backend, the entry point, the error).

    ``threads`` sets the backend's intra-op threads (default: the backend's own choice);
    ``optimization`` is ONNX Runtime's graph optimisation level: disabled, basic or all;
    ``session_config`` passes ONNX Runtime session config entries through as they are.
    The result is kept in ``Model.canary`` (None: not run, or the artifact carries no canary).
    """
    model = open_manifest(read_manifest(path), backend, threads, optimization, session_config)
    if check:
        run_canary(model, threads)
    return model


def run_canary(model: Model, threads: int | None = None) -> canary.Result | None:
    """Run ``model``'s canary and keep the result in ``model.canary``; refuse (closing it) when an entry fails."""
    start = time.perf_counter()
    try:
        result = canary.check(model, threads)
    except KilnError:
        model.close()
        raise
    finally:  # the canary's KV buffers are not kept for the app's requests
        for runtime in model.runtimes.values():
            pool = getattr(runtime, "pool", None)
            if pool is not None:
                pool.clear()
    model.canary = result
    if result is None:
        log.info("%s carries no canary (compiled by an older kiln, or a streamed encoder): not checked on this machine",
                 model.manifest.root)
        return None
    log.info("canary %s in %.0f ms on %s", "passed" if result.passed else "failed",
             1e3 * (time.perf_counter() - start), result.machine)
    if result.refused:
        model.close()
        raise canary.refusal(model, result)
    if result.rows_agree is False:
        log.warning("%s: one row decodes differently alone than beside others on this machine (%s); generate "
                    "and continuous batching decode at least two rows per step here (min_rows=2)", model.manifest.root,
                    result.machine)
    return result


def open_manifest(manifest: Manifest, backend: str = "onnxruntime", threads: int | None = None,
                  optimization: str = "all", session_config: dict[str, str] | None = None) -> Model:
    """Start the backend on an artifact whose manifest is already read (the compiler verifies its staged
    artifact this way before it writes the manifest once)."""
    chosen, skipped = (choose_backend(manifest) if backend == "auto" else (backend, {}))
    if backend == "auto":
        log.info("backend auto: %s (%s)", chosen, "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    runtimes = {}
    session_config = {**cpu_session_config(manifest, chosen), **(session_config or {})}
    for graph in manifest.data["graphs"]:  # "model"; or "encoder" and "decoder"
        runtimes[graph] = make_runtime(chosen, threads=threads, optimization=optimization, session_config=session_config)
        runtimes[graph].load(manifest, graph)
    model = Model(manifest, runtimes)
    model.backend = {"name": "onnxruntime-cpu" if chosen == "onnxruntime" else chosen, "requested": backend,
                     "skipped": skipped}
    ran = next((r.kernels for r in runtimes.values() if getattr(r, "kernels", None)), None)
    if ran is not None:  # the artifact's low-bit nodes: kiln's library, or ONNX Runtime's MatMulNBits (and why)
        model.backend["kernels"] = ran
    return model
