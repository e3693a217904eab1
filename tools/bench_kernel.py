"""kiln's low-bit kernel alone against ONNX Runtime's MatMulNBits (the same codes) and llama.cpp's own matmul, one
run, side by side.

For each weight shape of SmolLM2-135M and a 1.1B Llama (TinyLlama) and each row count M (decode rows 1-16, prefill
64 and 512): the median time of one MatMul on each kernel, the ratios, the kernel's weight bandwidth, and M rows
against one row. llama.cpp: ``ggml_mul_mat`` on ggml's CPU backend (``tools/ggml_matmul.cpp``, built against the
llama.cpp ``tools/llama_cpp.py build`` made; skipped with one line where it is not built), its nearest format (Q4_0
for kiln's 4-bit group 32; Q8_0, group 32, for the 8-bit head at group 64), the weights in its repacked buffer
where it has one for the type and ISA (as llama.cpp loads a model). The roof is this machine's memory bandwidth, measured here with a STREAM-style copy (numpy, 256 MB
each way). Prints the CPU line first.

Decode rows are timed as a model meets its weights: from memory, not from the cache. Their graph holds as many copies
of the weight (one node each, the same input) as fill three times the last-level cache, run one after another, and a
MatMul's time is the run's over the copies; the threads spin between nodes as in a model (one session at a time, so
no other pool competes). Prefill rows are compute-bound and take a one-node graph.

"floor M / 1": the least M rows can cost against one row here, whatever the kernel: one row's measured time, or the
M rows' multiply-adds at this CPU's int8 multiply ceiling (``tools/int8_peak.cpp``: the instruction kiln's kernel is
built on, operands in registers, on every thread; vpmaddubsw + vpaddw on AVX2, vpdpbusd with VNNI), if longer.

    .venv/bin/python tools/bench_kernel.py [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp  # noqa: E402
from kiln.passes.codes import pack, rtn  # noqa: E402
from kiln.runtimes import kernels  # noqa: E402
from kiln.runtimes.canary import cpu_name, isa  # noqa: E402

# (model, weight, K, N, bits): the default INT4 recipe's formats (4-bit group 32; 8-bit head at block 64)
SHAPES = [("smollm2-135m", "q/o proj", 576, 576, 4), ("smollm2-135m", "gate/up", 576, 1536, 4),
          ("smollm2-135m", "down", 1536, 576, 4), ("smollm2-135m", "lm_head int8", 576, 49152, 8),
          ("llama-1.1b", "q/o proj", 2048, 2048, 4), ("llama-1.1b", "gate/up", 2048, 5632, 4),
          ("llama-1.1b", "down", 5632, 2048, 4), ("llama-1.1b", "lm_head int8", 2048, 32000, 8)]
ROWS = (1, 2, 4, 8, 16, 64, 512)


def copy_bandwidth() -> float:
    """GB/s of a 256 MB array copy (read + write counted), best of 5."""
    a = np.ones(1 << 26, np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def last_level_cache() -> int:
    """Bytes of the largest CPU cache sysfs lists (32 MiB where it lists none)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


def weights(k: int, n: int, bits: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A (K, N) weight's MatMulNBits codes (N, blocks, bytes), scales and block size in the default INT4 recipe's
    format for ``bits``."""
    block = 64 if bits == 8 else 32
    q = rtn(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), bits, block)
    return pack(q.codes, bits).reshape(n, -1, block * bits // 8), q.scales, block


def graph(path: Path, codes: np.ndarray, scales: np.ndarray, k: int, bits: int, block: int, domain: str,
          copies: int = 1) -> None:
    """``copies`` MatMulNBits nodes of the same codes in their own initializers, each reading A."""
    n = codes.shape[0]
    nodes, inits, outs = [], [], []
    for i in range(copies):
        nodes.append(helper.make_node("MatMulNBits", ["A", f"B{i}", f"S{i}"], [f"Y{i}"], domain=domain, K=k, N=n,
                                      bits=bits, block_size=block, accuracy_level=4))
        inits += [numpy_helper.from_array(codes, f"B{i}"), numpy_helper.from_array(scales, f"S{i}")]
        outs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])], outs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")


def session(path: Path, threads: int, library: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if library:
        opts.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def timed(s: ort.InferenceSession, x: np.ndarray, budget: float) -> float:
    for _ in range(3):
        s.run(None, {"A": x})
    times = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        s.run(None, {"A": x})
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ggml_time(tool: Path, bits: int, k: int, n: int, m: int, copies: int, threads: int, budget: float) -> tuple[float, str]:
    """llama.cpp's seconds for one matmul of M rows (its nearest type to kiln's format) and where its weights went."""
    kind = "q4_0" if bits == 4 else "q8_0"
    out = subprocess.run([str(tool), kind, str(k), str(n), str(m), str(copies), str(threads), str(budget)],
                         capture_output=True, text=True, check=True)
    seconds, where = out.stdout.split()
    return float(seconds), f"{kind} {where}"


def int8_ceiling(kernel_isa: str, threads: int) -> float | None:
    """GMAC/s of ``tools/int8_peak.cpp`` on ``threads`` threads (best of three), or None without a C++ compiler or
    on the scalar path."""
    if kernel_isa == "scalar":
        return None
    source = Path(__file__).resolve().parent / "int8_peak.cpp"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        try:
            subprocess.run(["g++", "-O2", "-std=c++17", str(source), "-o", str(exe), "-lpthread"], check=True,
                           capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        variant = "avx512vnni" if kernel_isa.startswith("avx512") else "avx2"
        runs = [subprocess.run([str(exe), variant, str(threads)], capture_output=True, text=True, check=True)
                for _ in range(3)]
        return max(float(r.stdout.split()[0]) for r in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="0.1 s a measurement instead of 0.4")
    args = ap.parse_args()
    state = kernels.status()
    if state["library"] is None:
        print(f"bench_kernel: error: {state['reason']}; build it with pip install -e .", file=sys.stderr)
        return 2
    roof = copy_bandwidth()
    print(f"machine: {cpu_name()} ({isa()}), onnxruntime {ort.__version__}, kiln kernel {state['isa']}, "
          f"threads {args.threads}; copy bandwidth {roof:.1f} GB/s; last-level cache {last_level_cache() >> 20} MiB")
    ceiling = int8_ceiling(state["isa"], args.threads)
    print(f"int8 multiply ceiling ({'vpdpbusd' if state['isa'].startswith('avx512') else 'vpmaddubsw + vpaddw'}, "
          f"{args.threads} threads): " + (f"{ceiling:.0f} GMAC/s" if ceiling else "not measured (no g++, or the scalar path)"))
    tool = llama_cpp.matmul_tool()
    if tool is None:
        print(f"llama.cpp: skipped, not built in {llama_cpp.home()} (python tools/llama_cpp.py build)")
    print("| model | weight | K x N | bits | M | kiln us | MatMulNBits us | vs MatMulNBits | llama.cpp us | "
          "vs llama.cpp | kiln GB/s (of roof) | kiln M rows / 1 row | floor M / 1 | MatMulNBits M / 1 | llama.cpp M / 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    formats: set[str] = set()
    budget = 0.1 if args.quick else 0.4
    cache = last_level_cache()
    with tempfile.TemporaryDirectory() as tmp:
        for model, name, k, n, bits in SHAPES:
            codes, scales, block = weights(k, n, bits)
            nbytes = codes.nbytes + scales.nbytes
            copies = max(1, min(1024, -(-3 * cache // nbytes)))
            times: dict[str, dict[int, float]] = {}
            for kind, domain in (("kiln", "ai.kiln"), ("ms", "com.microsoft")):
                one, cold = Path(tmp) / f"{kind}{k}_{n}.onnx", Path(tmp) / f"{kind}{k}_{n}_cold.onnx"
                graph(one, codes, scales, k, bits, block, domain)
                graph(cold, codes, scales, k, bits, block, domain, copies)
                times[kind] = {}
                for path, rows, per in ((cold, [m for m in ROWS if m <= 16], copies),
                                        (one, [m for m in ROWS if m > 16], 1)):
                    s = session(path, args.threads, kind == "kiln")
                    for m in rows:
                        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                        times[kind][m] = timed(s, x, budget) / per
                    del s
            if tool is not None:
                times["ggml"] = {}
                for m in ROWS:
                    times["ggml"][m], where = ggml_time(tool, bits, k, n, m, copies if m <= 16 else 1, args.threads,
                                                        budget)
                    formats.add(where)
            for m in ROWS:
                a, b = times["kiln"][m], times["ms"][m]
                c = times.get("ggml", {}).get(m)
                gbs = nbytes / a / 1e9
                theirs = f"{c * 1e6:.0f} | {c / a:.2f}x" if c else "- | -"
                ratio = f"{c / times['ggml'][1]:.2f}x" if c else "-"
                t1 = times["kiln"][1]
                floor = f"{max(t1, m * k * n / (ceiling * 1e9)) / t1:.2f}x" if ceiling else "-"
                print(f"| {model} | {name} | {k} x {n} | {bits} | {m} | {a * 1e6:.0f} | {b * 1e6:.0f} | {b / a:.2f}x | "
                      f"{theirs} | {gbs:.1f} ({gbs / roof:.0%}) | {a / t1:.2f}x | {floor} | "
                      f"{b / times['ms'][1]:.2f}x | {ratio} |", flush=True)
    if formats:
        print(f"llama.cpp formats (type, weight buffer): {', '.join(sorted(formats))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
