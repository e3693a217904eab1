"""The CUDA driver API through ctypes: the first GPU's compute capability, and the few calls the TensorRT backend
needs (primary context, stream, device memory, async copies). No torch, pycuda or cuda-python: an edge install of
``kiln.runtimes`` has numpy and onnxruntime only, and TensorRT brings the driver library with the GPU."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kiln.errors import KilnError


def _libcuda() -> Any:
    """The CUDA driver library, or None where there is no NVIDIA driver."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def compute_capability() -> str | None:
    """The first GPU's compute capability ("9.0") through the CUDA driver API, or None when there is no driver
    or no device (no torch, no CUDA toolkit needed)."""
    cuda = _libcuda()
    if cuda is None:
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


class CudaError(KilnError):
    """A CUDA driver call failed."""


class CudaDriver:
    """The few CUDA driver calls the backend needs (primary context, stream, device memory, async copies), through
    ctypes: TensorRT runs in the device's primary context, the one the CUDA runtime uses too.

    A CUDA context is current per thread, and a loaded model is called from any thread (the server's worker threads,
    a scheduler's loop): every driver call here, and every TensorRT call the backend makes, runs inside
    ``current()``, which pushes the context on the calling thread and pops it afterwards (once per thread when
    nested)."""

    def __init__(self, device: int = 0) -> None:
        lib = _libcuda()
        if lib is None:
            raise CudaError("backend tensorrt: no CUDA driver (libcuda) on this machine; install NVIDIA's driver, or use "
                            "backend onnxruntime-cpu")
        self.lib = lib
        self._depth = threading.local()
        self._check(lib.cuInit(0), "cuInit")
        self.device = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(self.device), device), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), self.device), "cuDevicePrimaryCtxRetain")
        self.stream = ctypes.c_void_p()
        with self.current():
            self._check(lib.cuStreamCreate(ctypes.byref(self.stream), 0), "cuStreamCreate")

    @contextmanager
    def current(self) -> Iterator[None]:
        """The context current on the calling thread for the block (pushed and popped once per thread)."""
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            self._check(self.lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                popped = ctypes.c_void_p()
                self._check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaError(f"CUDA {call} failed: {(text.value or b'error %d' % code).decode()}")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        with self.current():
            self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1))), "cuMemAlloc")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        with self.current():
            self._check(self.lib.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")

    def to_device(self, ptr: int, array: np.ndarray) -> None:
        with self.current():
            self._check(self.lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(ptr), array.ctypes.data_as(ctypes.c_void_p),
                                                      ctypes.c_size_t(array.nbytes), self.stream), "cuMemcpyHtoDAsync")

    def to_host(self, array: np.ndarray, ptr: int) -> None:
        with self.current():
            self._check(self.lib.cuMemcpyDtoHAsync_v2(array.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(ptr),
                                                      ctypes.c_size_t(array.nbytes), self.stream), "cuMemcpyDtoHAsync")

    def synchronize(self) -> None:
        with self.current():
            self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    @property
    def stream_handle(self) -> int:
        return int(self.stream.value or 0)

    def close(self) -> None:
        if self.stream.value:
            with self.current():
                self.lib.cuStreamDestroy_v2(self.stream)
            self.stream = ctypes.c_void_p()
        if self.context.value:
            self.lib.cuDevicePrimaryCtxRelease_v2(self.device)
            self.context = ctypes.c_void_p()
