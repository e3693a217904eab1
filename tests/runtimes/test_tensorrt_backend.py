"""The TensorRT backend's own logic without a GPU: shapes, buffers, the profile check and the GPU-resident KV cache,
run against a stand-in engine. The stand-in has TensorRT's execution-context interface and computes with ONNX Runtime
on memory a stand-in CUDA driver keeps in host arrays, so a wrong pointer, shape or cache swap changes the tokens."""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import numpy as np
import onnxruntime as ort
import pytest

import kiln.runtimes as kr
from conftest import fast_options
from kiln.compiler import compile
from kiln.errors import InputError
from kiln.runtimes.artifact import read_manifest
from kiln.runtimes.engines import axis_ranges, input_profiles
from kiln.runtimes import cuda as cuda_lib
from kiln.runtimes.tensorrt import TensorRTRuntime


class HostCuda:
    """CudaDriver's interface over host memory: pointers are keys into byte arrays. Like the driver, it keeps the
    context current per thread (``current``), and records which threads made engine calls with it current and
    which without (``OrtContext`` asks)."""

    def __init__(self) -> None:
        self.mem: dict[int, np.ndarray] = {}
        self.next = 4096
        self.freed: list[int] = []
        self.local = threading.local()
        self.lock = threading.Lock()  # the real driver's allocations are thread-safe; this stand-in's too
        self.with_context: set[int] = set()
        self.without_context: list[str] = []

    @contextmanager
    def current(self):
        depth = getattr(self.local, "n", 0)
        self.local.n = depth + 1
        try:
            yield
        finally:
            self.local.n = depth

    def engine_call(self, what: str) -> None:
        if getattr(self.local, "n", 0):
            self.with_context.add(threading.get_ident())
        else:
            self.without_context.append(f"{what} on thread {threading.get_ident()}")

    def alloc(self, nbytes: int) -> int:
        with self.lock:
            self.next += 4096 + nbytes
            self.mem[self.next] = np.zeros(max(nbytes, 1), np.uint8)
            return self.next

    def free(self, ptr: int) -> None:
        with self.lock:
            del self.mem[ptr]
            self.freed.append(ptr)

    def to_device(self, ptr: int, array: np.ndarray) -> None:
        self.mem[ptr][:array.nbytes] = np.ascontiguousarray(array).view(np.uint8).ravel()

    def to_host(self, array: np.ndarray, ptr: int) -> None:
        array.view(np.uint8).ravel()[:] = self.mem[ptr][:array.nbytes]

    def read(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.mem[ptr][:n].view(dtype).reshape(shape).copy()

    def synchronize(self) -> None:
        pass

    stream_handle = 0

    def close(self) -> None:
        pass


class OrtContext:
    """IExecutionContext's calls the backend makes, computing with ONNX Runtime on HostCuda memory."""

    def __init__(self, session: ort.InferenceSession, cuda: HostCuda, dtypes: dict[str, np.dtype]) -> None:
        self.session, self.cuda, self.dtypes = session, cuda, dtypes
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.results: dict[str, np.ndarray] = {}

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        self.cuda.engine_call("set_input_shape")
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.cuda.engine_call("set_tensor_address")
        self.addresses[name] = ptr
        return True

    def infer_shapes(self) -> list[str]:
        self.cuda.engine_call("infer_shapes")
        feeds = {n: self.cuda.read(self.addresses[n], s, self.dtypes[n]) for n, s in self.shapes.items()}
        names = [o.name for o in self.session.get_outputs()]
        self.results = dict(zip(names, self.session.run(None, feeds)))
        return []

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.results[name].shape

    def execute_async_v3(self, stream: int) -> bool:
        self.cuda.engine_call("execute_async_v3")
        for name, value in self.results.items():
            self.cuda.to_device(self.addresses[name], value)
        return True


def stand_in(artifact) -> tuple[TensorRTRuntime, HostCuda]:
    manifest = read_manifest(artifact)
    session = ort.InferenceSession(str(manifest.graph_path()), providers=["CPUExecutionProvider"])
    rt = TensorRTRuntime()
    cuda = HostCuda()
    dtypes = {a.name: np.dtype(np.int64 if a.type == "tensor(int64)" else np.float32)
              for a in list(session.get_inputs()) + list(session.get_outputs())}
    rt._cuda, rt._dtypes = cuda, dtypes  # type: ignore[assignment]
    rt._context = OrtContext(session, cuda, dtypes)
    rt._inputs = [i.name for i in session.get_inputs()]
    rt._outputs = [o.name for o in session.get_outputs()]
    rt._profiles = input_profiles(manifest.data, axis_ranges(manifest.data))
    return rt, cuda


def no_swap(real):
    """A planted bug: the device cache's present is written but never read back (the runner stays on its buffer)."""
    def make(kv, batch, length=None):
        runner = real(kv, batch, length)
        step = runner.step

        def stuck(ids, mask):
            current = runner.current
            out = step(ids, mask)
            runner.current = current
            return out

        runner.step = stuck
        return runner
    return make


@pytest.fixture(scope="module")
def trt_llama(checkpoints, tmp_path_factory):
    return compile(checkpoints["llama"], tmp_path_factory.mktemp("trt") / "llama", fast_options(target="tensorrt"))


def test_generation_through_the_device_cache_matches_onnxruntime(trt_llama):
    rt, cuda = stand_in(trt_llama)
    manifest = read_manifest(trt_llama)
    assert manifest.data["kv_cache"]["shared_buffer"] is False  # the Concat cache: present = past + new
    engine_model = kr.Model(manifest, {"model": rt})
    prompts = [[5, 9, 17, 3, 44], [7, 2]]  # left-padded into one batch: the mask covers pads, past and new
    with kr.load(trt_llama) as cpu:
        want = cpu.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    got = engine_model.generate(prompts, max_new_tokens=12, stop_token_ids=[])
    np.testing.assert_array_equal(got, want)
    real = rt.cache_runner
    rt.cache_runner = no_swap(real)
    assert not np.array_equal(engine_model.generate(prompts, max_new_tokens=12, stop_token_ids=[]), want)
    rt.cache_runner = real
    live = len(cuda.mem)
    runner = rt.cache_runner(manifest.data["kv_cache"], 1, 8)
    ids = np.array([[5, 9, 17]])
    first = runner.step(ids, np.ones((1, 3), np.int64))
    assert runner.past_len == 3 and runner.current == 1
    with kr.load(trt_llama) as cpu:
        np.testing.assert_allclose(first[:, -1], cpu.run({"input_ids": ids, "attention_mask": np.ones((1, 3),
                                                                                       np.int64)})["logits"][:, -1],
                                   atol=1e-5)
    runner.step(np.array([[4]]), np.ones((1, 4), np.int64))
    with pytest.raises(InputError, match="needs 9 positions but its cache holds 8"):
        runner.step(np.ones((1, 5), np.int64), np.ones((1, 9), np.int64))
    runner.close()
    assert len(cuda.mem) == live  # every cache buffer it took was freed


def test_a_shape_outside_the_engine_profile_is_refused_before_running(trt_llama):
    rt, _ = stand_in(trt_llama)
    rt._profiles = {"input_ids": ((1, 1), (1, 1), (2, 16))}
    with pytest.raises(InputError, match=r"input input_ids has shape \[3, 4\], outside the engine's profile"):
        rt.run({"input_ids": np.ones((3, 4), np.int64), "attention_mask": np.ones((3, 4), np.int64),
                **{n: np.zeros((3, 2, 0, 16), np.float32) for n in rt._inputs if n.startswith("past")}})


def test_engine_calls_from_two_threads_each_run_in_the_context(trt_llama):
    """A model is called from whichever thread serves the request: every TensorRT call runs with the CUDA context
    pushed on the calling thread (the stand-in records it per thread); without the push (the planted bug: the
    context made current only where the model was loaded) the calls from the other thread are caught."""
    rt, cuda = stand_in(trt_llama)
    model = kr.Model(read_manifest(trt_llama), {"model": rt})
    prompts = [[5, 9, 17, 3, 44], [7, 2]]
    with kr.load(trt_llama) as cpu:
        want = cpu.generate(prompts, max_new_tokens=6, stop_token_ids=[])
    both = threading.Barrier(2, timeout=60)  # each of the two threads takes a call: neither can run all four

    def call(i: int) -> np.ndarray:
        if i < 2:
            both.wait()
        return model.generate(prompts, max_new_tokens=6, stop_token_ids=[])

    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(call, range(4)))
    for got in outs:
        np.testing.assert_array_equal(got, want)
    assert not cuda.without_context and len(cuda.with_context) == 2
    cuda.current = nullcontext  # the planted bug
    with ThreadPoolExecutor(1) as pool:
        pool.submit(model.generate, prompts, max_new_tokens=2, stop_token_ids=[]).result()
    assert cuda.without_context and "execute_async_v3" in " ".join(cuda.without_context)


class FakeLibcuda:
    """libcuda's calls CudaDriver makes, keeping a context stack per thread: a memory, copy or stream call made on a
    thread whose current context is not the primary one is recorded."""

    CONTEXT = 0xC0FFEE

    def __init__(self) -> None:
        self.stacks: dict[int, list[int]] = {}
        self.calls: list[tuple[str, int, bool]] = []  # (call, thread, context current)

    def _stack(self) -> list[int]:
        return self.stacks.setdefault(threading.get_ident(), [])

    def _record(self, name: str) -> int:
        stack = self._stack()
        self.calls.append((name, threading.get_ident(), bool(stack) and stack[-1] == self.CONTEXT))
        return 0

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, dev, ordinal):
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        ctx._obj.value = self.CONTEXT
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, dev):
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self._stack().append(ctx.value)
        return 0

    def cuCtxPopCurrent_v2(self, out):
        out._obj.value = self._stack().pop()
        return 0

    def cuStreamCreate(self, stream, flags):
        stream._obj.value = 7
        return self._record("cuStreamCreate")

    def cuMemAlloc_v2(self, ptr, size):
        ptr._obj.value = 4096
        return self._record("cuMemAlloc")

    def cuMemFree_v2(self, ptr):
        return self._record("cuMemFree")

    def cuMemcpyHtoDAsync_v2(self, dst, src, size, stream):
        return self._record("cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync_v2(self, dst, src, size, stream):
        return self._record("cuMemcpyDtoHAsync")

    def cuStreamSynchronize(self, stream):
        return self._record("cuStreamSynchronize")

    def cuStreamDestroy_v2(self, stream):
        return self._record("cuStreamDestroy")


def test_cuda_driver_pushes_the_context_on_every_calling_thread(monkeypatch):
    lib = FakeLibcuda()
    monkeypatch.setattr(cuda_lib, "_libcuda", lambda: lib)
    driver = cuda_lib.CudaDriver()

    def work():
        ptr = driver.alloc(16)
        with driver.current():  # nested: one push per thread, popped once
            driver.to_device(ptr, np.zeros(4, np.float32))
            driver.to_host(np.zeros(4, np.float32), ptr)
        driver.synchronize()
        driver.free(ptr)

    work()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(work).result()
    driver.close()
    assert {t for _, t, _ in lib.calls} == set(lib.stacks) and len(lib.stacks) == 2
    assert all(ok for _, _, ok in lib.calls), [c for c in lib.calls if not c[2]]
    assert all(not stack for stack in lib.stacks.values())  # every push popped
    assert len(lib.calls) == 1 + 2 * 5 + 1  # stream create, each thread's five calls, stream destroy
    assert ctypes.c_void_p(driver.context.value).value is None  # released
    planted = cuda_lib.CudaDriver()
    planted.current = nullcontext  # the planted bug: calls made without pushing the context
    with ThreadPoolExecutor(1) as pool:
        pool.submit(planted.alloc, 16).result()
    assert lib.calls[-1][0] == "cuMemAlloc" and not lib.calls[-1][2]


def test_the_canary_checks_the_engine_path(trt_llama):
    """The canary is how an engine built elsewhere gets checked: it passes on the stand-in engine, and a stuck device
    cache (the present never read back) is refused with the backend named."""
    rt, _ = stand_in(trt_llama)
    engine_model = kr.Model(read_manifest(trt_llama), {"model": rt})
    engine_model.backend = {"name": "tensorrt", "requested": "tensorrt", "skipped": {}}
    assert kr.run_canary(engine_model).passed
    rt.cache_runner = no_swap(rt.cache_runner)
    with pytest.raises(kr.CanaryError, match="tensorrt.*canary entry decode_1"):
        kr.run_canary(engine_model)
