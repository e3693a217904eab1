"""kiln's own low-bit kernels: the custom-op library built with the package (``kiln/kernels``, ``setup.py``).

An artifact whose manifest has a ``kernels`` section computes its MatMulNBits nodes in the ``ai.kiln`` domain
(``kiln.passes.kiln_kernels``). Where the library is present, ONNX Runtime loads it into the session; where it is
not (built without a compiler, another ISA, or hidden with ``KILN_KERNELS=0``), the session loads the artifact's
fallback graph: the same nodes and codes as ONNX Runtime's own MatMulNBits. Either way ``Model.backend["kernels"]``
and ``kiln check`` say which ran, and the canary decides whether the answer is the verified one.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
from pathlib import Path
from typing import Any

import onnxruntime as ort

from kiln.errors import ArtifactError

log = logging.getLogger(__name__)

HIDE = "KILN_KERNELS"
"""``KILN_KERNELS=0``: act as if the library were not built (the fallback's test, and a user's way around it)."""
FORCE_ISA = "KILN_KERNEL_ISA"
"""``KILN_KERNEL_ISA=scalar|avx2|avx512vnni``: the path the library's kernels take (one the CPU runs)."""
ISAS = ("scalar", "avx2", "avx512vnni")


def hidden() -> bool:
    """``KILN_KERNELS=0`` (or false / no / off) is set."""
    return os.environ.get(HIDE, "1").strip().lower() in ("0", "false", "no", "off")


def library() -> Path | None:
    """The built library, or None (not built here, or hidden by ``KILN_KERNELS=0``)."""
    if hidden():
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.is_file():
            return path
    return None


def status() -> dict[str, Any]:
    """What this machine runs: {"library": path or None, "isa": the path kernels take, "reason": why none}."""
    path = library()
    if path is None:
        return {"library": None, "isa": None,
                "reason": f"{HIDE}=0" if hidden() else "kiln's kernel library was not built with this install "
                                                     "(no C++ compiler, or not x86-64)"}
    lib = ctypes.CDLL(str(path))
    lib.kiln_kernel_isa.restype = ctypes.c_char_p
    isa = lib.kiln_kernel_isa().decode()
    forced = os.environ.get(FORCE_ISA)
    return {"library": str(path), "isa": forced or isa, "reason": None}


def supports(isa: str) -> bool:
    """Whether this CPU (and its OS) runs the library's ``isa`` path."""
    path = library()
    if path is None:
        return False
    lib = ctypes.CDLL(str(path))
    lib.kiln_kernel_supports.argtypes = [ctypes.c_char_p]
    return bool(lib.kiln_kernel_supports(isa.encode()))


def available() -> bool:
    return library() is not None


def register(opts: ort.SessionOptions) -> bool:
    """Register the library on ``opts`` where it is available (for sessions over graphs kiln made itself, such as the
    compiler's per-layer runs); whether it was."""
    path = library()
    if path is not None:
        opts.register_custom_ops_library(str(path))
    return path is not None


def portable_graph(manifest: Any, graph: str = "model") -> Path:
    """The file of ``graph`` that any ONNX Runtime runs: the fallback where the artifact computes with kiln's
    kernel (Triton's ONNX Runtime backend, for one, cannot load kiln's library), else the graph itself."""
    fallback = (manifest.data.get("kernels") or {}).get("fallback", {}).get(graph)
    return manifest.root / fallback if fallback else manifest.graph_path(graph)


def graph_file(manifest: Any, graph: str, opts: ort.SessionOptions,
               optimization: str = "all") -> tuple[Path, dict[str, Any] | None]:
    """The file of ``graph`` to load and what computes its kiln nodes: the library, registered on ``opts``, or the
    fallback graph with ONNX Runtime's MatMulNBits. None when the artifact has no kiln nodes.

    ``optimization`` "disabled" takes the fallback too: the kernel packs its weights when the session creates it,
    from constants, and FP16 scales are constants only once the session has folded their Cast."""
    spec = manifest.data.get("kernels")
    if not spec:
        return manifest.graph_path(graph), None
    state = status()
    if optimization == "disabled":
        state = {"library": None, "reason": "graph optimisation disabled (kiln's kernel reads its scales as folded "
                                            "constants)"}
    if state["library"] is not None:
        opts.register_custom_ops_library(state["library"])
        return manifest.graph_path(graph), {"op": spec["op"], "ran": f"kiln {state['isa']}"}
    fallback = spec.get("fallback", {}).get(graph)
    if fallback is None:
        raise ArtifactError(f"{manifest.root} computes with kiln's kernel library, which is not available here "
                            f"({state['reason']}), and ships no fallback graph for {graph!r}; reinstall kiln with a "
                            "C++ compiler, or recompile the artifact with --kernels onnxruntime")
    log.info("%s: %s; running ONNX Runtime's MatMulNBits on the same codes", manifest.root, state["reason"])
    return manifest.root / fallback, {"op": "com.microsoft.MatMulNBits", "ran": "onnxruntime MatMulNBits",
                                      "reason": state["reason"]}
