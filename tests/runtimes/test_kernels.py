"""kiln's own low-bit kernel (kiln/kernels, ai.kiln.MatMulNBits) against a numpy reference of the same numerics,
against ONNX Runtime's MatMulNBits on the same codes, and against itself: row i of an M-row call equals the one-row
call bit for bit, and every path this CPU runs (scalar, AVX2, AVX-512 VNNI) gives the same bits."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.codes import pack, pack_zeros, rtn
from kiln.runtimes import kernels

built = pytest.mark.skipif(not kernels.available(), reason="kiln's kernel library is not built here")

# (K, N, bits, block, grid): K and N not multiples of the block or the 16-column tile, zero points, 8 bits, big blocks
CASES = [(96, 48, 4, 32, "signed"), (100, 33, 4, 16, "asym"), (200, 50, 8, 32, "signed"), (256, 40, 8, 64, "asym"),
         (300, 24, 4, 128, "signed"), (64, 17, 8, 16, "signed")]


def graph(path: Path, k: int, n: int, bits: int, block: int, grid: str, domain: str, half: bool = False,
          seed: int = 0) -> np.ndarray:
    """A one-node MatMulNBits graph at ``path``; returns the (K, N) weights the codes dequantize to."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    q = rtn(w, bits, block, grid)
    inits = [numpy_helper.from_array(pack(q.codes, bits).reshape(n, -1, block * bits // 8), "B")]
    nodes = []
    if half:  # FP16 scales behind a Cast, as quantize-nbits stores them: the session folds it before the kernel
        inits.append(numpy_helper.from_array(q.scales.astype(np.float16), "S16"))
        nodes.append(helper.make_node("Cast", ["S16"], ["S"], to=TensorProto.FLOAT))
    else:
        inits.append(numpy_helper.from_array(q.scales, "S"))
    names = ["A", "B", "S"]
    if q.zeros is not None:
        inits.append(numpy_helper.from_array(pack_zeros(q.zeros, bits).reshape(-1), "Z"))
        names.append("Z")
    nodes.append(helper.make_node("MatMulNBits", names, ["Y"], domain=domain, K=k, N=n, bits=bits, block_size=block,
                                  accuracy_level=4))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", "M", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "M", n])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]),
              str(path))
    scales = q.scales.astype(np.float16).astype(np.float32) if half else q.scales
    return q.__class__(q.codes, scales, q.zeros, bits, block, k).dequantize()


def session(path: Path, library: bool = True, threads: int = 2) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if library:
        opts.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def reference(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """The kernel's numerics in numpy: int8 activations per row and block (scale max|x| / 127, round half to even),
    the block's exact integer sum, then out = fma(dot, s_w * s_a, out) block by block (float64 then rounded to
    float32: equal to the fused operation unless a double rounding strikes, far below the tolerance used)."""
    m, k = x.shape
    blocks = -(-k // block)
    xp = np.zeros((m, blocks * block), np.float32)
    xp[:, :k] = x
    xb = xp.reshape(m, blocks, block)
    sa = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(sa != 0, np.float32(1) / np.where(sa != 0, sa, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    wp = np.zeros((blocks * block, w.shape[1]), np.float64)
    wp[:k] = w
    out = np.zeros((m, w.shape[1]), np.float32)
    for b in range(blocks):  # dot * s_w * s_a == (q @ (codes - zero)) * s_w * s_a, w = (codes - zero) * s_w
        part = (q[:, b].astype(np.float64) @ wp[b * block:(b + 1) * block]) * sa[:, b:b + 1].astype(np.float64)
        out = (out.astype(np.float64) + part).astype(np.float32)
    return out


def paths() -> list[str]:
    return [isa for isa in kernels.ISAS if kernels.supports(isa)]


@built
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_rows_equal_one_row_on_every_path(case, tmp_path, monkeypatch):
    k, n, bits, block, grid = case
    path = tmp_path / "kiln.onnx"
    graph(path, k, n, bits, block, grid, "ai.kiln")
    x = np.random.default_rng(1).standard_normal((2, 8, k)).astype(np.float32)
    x[0, 3] *= 40  # one loud row: its activation scale must not touch the others
    seen = {}
    for isa in paths():
        monkeypatch.setenv(kernels.FORCE_ISA, isa)
        s = session(path)
        y = s.run(None, {"A": x})[0]
        for i in range(8):
            alone = s.run(None, {"A": x[:1, i:i + 1]})[0]
            assert np.array_equal(y[0, i], alone[0, 0]), f"{isa}: row {i} of 8 differs from the row alone"
        for m in (2, 3, 5):  # decode's few-row path (accumulators in registers) and a remainder past a block of 4
            part = s.run(None, {"A": x[:1, :m]})[0]
            assert np.array_equal(y[0, :m], part[0]), f"{isa}: {m} rows differ from the same rows of 16"
        seen[isa] = y
    first = next(iter(seen.values()))
    for isa, y in seen.items():
        assert np.array_equal(y, first), f"{isa} differs from {next(iter(seen))}"
    assert "scalar" in seen


@built
def test_awkward_activations_quantize_the_same_on_every_path(tmp_path, monkeypatch):
    """The activations' int8 codes are computed per path (AVX2 quantizes a block of 32 in registers): on values
    that sit exactly half-way between codes (round half to even), a block of zeros, a constant block, subnormals and
    infinities, every path gives the same bits. A quantizer that rounds ties another way fails here."""
    k = 128
    path = tmp_path / "kiln.onnx"
    graph(path, k, 40, 4, 32, "signed", "ai.kiln")
    ties = (np.arange(k) % 32 - 16 + 0.5).astype(np.float32)
    ties[::32] = 127  # each block's max|x| is 127: scale 1, so x / scale lands on the ties exactly
    x = np.stack([ties, -ties, np.zeros(k), np.full(k, 3.0), np.full(k, 1e-40), np.where(np.arange(k) == 70, np.inf, ties),
                  np.random.default_rng(3).standard_normal(k) * 1e4]).astype(np.float32)[None]
    seen = {}
    for isa in paths():
        monkeypatch.setenv(kernels.FORCE_ISA, isa)
        seen[isa] = session(path).run(None, {"A": x})[0]
    first = seen["scalar"]
    assert np.isfinite(first[0, :5]).all()
    for isa, y in seen.items():
        assert np.array_equal(y, first, equal_nan=True), f"{isa} differs from scalar"


@built
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_reference_and_matmulnbits(case, tmp_path):
    k, n, bits, block, grid = case
    w = graph(tmp_path / "kiln.onnx", k, n, bits, block, grid, "ai.kiln", half=grid == "signed")
    graph(tmp_path / "ms.onnx", k, n, bits, block, grid, "com.microsoft", half=grid == "signed")
    x = np.random.default_rng(2).standard_normal((1, 5, k)).astype(np.float32)
    y = session(tmp_path / "kiln.onnx").run(None, {"A": x})[0][0]
    exact = x[0].astype(np.float64) @ w.astype(np.float64)
    ref = reference(x[0], w, block)
    scale = np.abs(exact).max()
    # the same numerics: float rounding only
    assert np.abs(y - ref).max() <= 1e-5 * scale, np.abs(y - ref).max() / scale
    # int8 activations cost about 1% of the output's range; a wrong scale, zero point or code order costs far more
    assert np.abs(y - exact).max() <= 0.03 * scale
    ms = session(tmp_path / "ms.onnx", library=False).run(None, {"A": x})[0][0]
    assert np.abs(y - ms).max() <= 0.03 * scale


@built
def test_a_planted_bug_fails_the_reference(tmp_path):
    """The reference check is tight enough to see one code off by one in a block (the tolerance above is not
    vacuous): the kernel on weights with one changed code differs from the reference of the original."""
    k, n, block = 96, 48, 32
    w = graph(tmp_path / "kiln.onnx", k, n, 4, block, "signed", "ai.kiln")
    m = onnx.load(str(tmp_path / "kiln.onnx"))
    b = next(t for t in m.graph.initializer if t.name == "B")
    codes = numpy_helper.to_array(b).copy()
    codes[7, 1, 3] ^= 0x01  # column 7, block 1: one code off by one
    b.CopyFrom(numpy_helper.from_array(codes, "B"))
    onnx.save(m, str(tmp_path / "bad.onnx"))
    x = np.random.default_rng(3).standard_normal((1, 4, k)).astype(np.float32)
    y = session(tmp_path / "bad.onnx").run(None, {"A": x})[0][0]
    ref = reference(x[0], w, block)
    assert np.abs(y - ref).max() > 1e-5 * np.abs(ref).max()


@built
def test_threads_do_not_change_the_answer(tmp_path):
    graph(tmp_path / "kiln.onnx", 256, 200, 4, 32, "signed", "ai.kiln")
    x = np.random.default_rng(4).standard_normal((1, 3, 256)).astype(np.float32)
    one = session(tmp_path / "kiln.onnx", threads=1).run(None, {"A": x})[0]
    two = session(tmp_path / "kiln.onnx", threads=2).run(None, {"A": x})[0]
    assert np.array_equal(one, two)


def resident_kib(path: Path) -> int | None:
    """KiB of ``path`` this process has resident through its mappings (None: not mapped)."""
    total, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) > 5 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total = (total or 0) + int(fields[1])
    return total


@built
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the process's mappings (Linux)")
def test_packed_weights_are_not_resident_twice(tmp_path):
    """ONNX Runtime maps the weights file; packing reads all of it. The kernel hands the source pages back, so the
    session holds the weights once (its packed copy), not twice: the mapped file is almost entirely not resident."""
    import platform

    if tuple(int(v) for v in platform.release().split(".")[:2]) < (5, 4):
        pytest.skip("MADV_PAGEOUT needs Linux 5.4")
    k, n = 1024, 1024
    q = rtn(np.random.default_rng(5).standard_normal((k, n)).astype(np.float32), 4, 32)
    codes = pack(q.codes, 4).reshape(n, -1, 16)
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="ai.kiln", K=k, N=n, bits=4, block_size=32,
                            accuracy_level=4)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(q.scales, "S")])
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.kiln", 1)]),
              str(path), save_as_external_data=True, location="big.onnx.data")
    with open(tmp_path / "big.onnx.data", "rb") as f:  # written back first: Linux keeps dirty pages resident until
        os.fsync(f.fileno())  # their writeback is done, and a busy disk (the other test worker) delays it
    s = session(path)
    data = (tmp_path / "big.onnx.data").resolve()
    resident = resident_kib(data)
    if resident is None:
        pytest.skip("this ONNX Runtime reads the weights file into its own memory instead of mapping it")
    weights = (codes.nbytes + q.scales.nbytes) // 1024
    assert resident <= weights // 10, f"{resident} of the weights' {weights} KiB still resident after packing"
    y = s.run(None, {"A": np.ones((1, k), np.float32)})[0]  # the kernel never reads the source again
    assert np.isfinite(y).all() and resident_kib(data) <= weights // 10


@built
def test_refuses_weights_it_cannot_pack(tmp_path):
    """B fed at run time (not an initializer): the session refuses at load with the op's own message."""
    k, n = 64, 16
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="ai.kiln", K=k, N=n, bits=4, block_size=32,
                            accuracy_level=4)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k]),
                                        helper.make_tensor_value_info("B", TensorProto.UINT8, [n, 2, 16])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array(np.ones((n, 2), np.float32), "S")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.kiln", 1)]),
              str(tmp_path / "m.onnx"))
    with pytest.raises(Exception, match="B must be a constant initializer"):
        session(tmp_path / "m.onnx").run(None, {"A": np.ones((1, k), np.float32), "B": np.zeros((n, 2, 16), np.uint8)})


@built
def test_forcing_a_path_this_cpu_lacks_is_refused(tmp_path, monkeypatch):
    missing = [isa for isa in kernels.ISAS if not kernels.supports(isa)]
    graph(tmp_path / "kiln.onnx", 64, 16, 4, 32, "signed", "ai.kiln")
    monkeypatch.setenv(kernels.FORCE_ISA, missing[0] if missing else "sse9")
    with pytest.raises(Exception, match="KILN_KERNEL_ISA"):
        session(tmp_path / "kiln.onnx")


@built
def test_status_names_the_path_and_hiding_it(monkeypatch):
    state = kernels.status()
    assert state["library"] and state["isa"] in kernels.ISAS and kernels.supports(state["isa"])
    monkeypatch.setenv(kernels.HIDE, "0")
    hidden = kernels.status()
    assert hidden["library"] is None and "KILN_KERNELS=0" in hidden["reason"] and not kernels.available()


def test_the_install_built_the_library(monkeypatch):
    """Where the package's build can compile it (Linux x86-64 with a C++ compiler) the library must be there: the
    tests above skip without it, so a broken build would otherwise pass silently."""
    import platform
    import shutil

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") or not shutil.which("c++"):
        pytest.skip("the library is built on Linux x86-64 with a C++ compiler")
    monkeypatch.delenv(kernels.HIDE, raising=False)
    assert kernels.library() is not None, "kiln/runtimes/_kernels*.so is missing: run pip install -e . again"
