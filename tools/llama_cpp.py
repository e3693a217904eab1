"""llama.cpp, the CPU anchor users pick for decoders, for kiln's INT4 benchmarks.

    python tools/llama_cpp.py build                 # about 15 minutes on 2 cores, cached outside the repo
    python tools/llama_cpp.py check                 # which binaries are there

llama.cpp has no wheel on the package index; the ``llama-cpp-python`` sdist vendors its source, so ``build``
downloads that sdist and builds ``llama-bench``, ``llama-perplexity``, ``llama-quantize`` and ``llama-batched-bench``
with cmake and ninja
into ``~/.cache/kiln/llamacpp`` (``KILN_LLAMA_CPP`` overrides the directory).

GGUFs: ``write_f32`` writes an F32 GGUF from a GGUF (every tensor dequantized, all metadata copied, optionally
with its channels permuted: the same function off the source's quantization grid), which ``llama-quantize`` turns
into Q8_0 / Q4_K_M / Q4_0 and which kiln compiles too (``kiln compile FILE.gguf``), so both tools start from the
same weights. Perplexity is llama-perplexity's own protocol (``perplexity_second_half`` reproduces it for kiln
artifacts): the text is tokenized once and cut into chunks of ``n_ctx`` tokens; each chunk is scored on the
next-token predictions of its second half. Decode speed: ``llama-bench`` tg at a depth (prompt already in the
cache), batch 1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

SDIST = "llama-cpp-python==0.3.36"
TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-batched-bench")


def home() -> Path:
    return Path(os.environ.get("KILN_LLAMA_CPP", Path.home() / ".cache" / "kiln" / "llamacpp"))


def binaries() -> dict[str, Path] | None:
    """The built tools, or None if any is missing."""
    found = {t: home() / "bin" / t for t in TOOLS}
    return found if all(p.is_file() for p in found.values()) else None


def build(log=print) -> dict[str, Path]:
    """Download the sdist, build the three tools (native CPU flags, Release) and copy them to ``home()/bin``."""
    if binaries():
        return binaries()
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"pip download {SDIST} --no-binary :all:")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", str(root)], check=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    src = root / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(root, filter="data")
    build_dir = src / "build"
    log(f"cmake build of {', '.join(TOOLS)} in {build_dir} (about 15 minutes on 2 cores)")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target", *TOOLS],
                   check=True, stdout=subprocess.DEVNULL)
    (root / "bin").mkdir(exist_ok=True)
    for t in TOOLS:
        shutil.copy2(build_dir / "bin" / t, root / "bin" / t)
    for lib in build_dir.rglob("*.so*"):  # shared ggml/llama libraries the tools link against
        shutil.copy2(lib, root / "bin" / lib.name, follow_symlinks=True)
    return binaries()


MATMUL = Path(__file__).with_name("ggml_matmul.cpp")
"""llama.cpp's own matmul alone (ggml's CPU backend, llama.cpp's weight buffers), for tools/bench_kernel.py."""


def matmul_tool() -> Path | None:
    """``tools/ggml_matmul.cpp`` built against the llama.cpp ``build`` made (once, beside its tools), or None where
    llama.cpp is not built."""
    root = home()
    libs = root / "bin"
    headers = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/ggml/include"))
    if binaries() is None or not headers:
        return None
    out = libs / "kiln-ggml-matmul"
    if not out.is_file() or out.stat().st_mtime < MATMUL.stat().st_mtime:
        staged = out.with_suffix(".tmp")
        subprocess.run(["g++", "-O2", "-std=c++17", f"-I{headers[-1]}", str(MATMUL), f"-L{libs}", "-lggml",
                        "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{libs}", "-o", str(staged)], check=True)
        staged.replace(out)
    return out


def run(tool: str, *args: str) -> str:
    tools = binaries()
    if tools is None:
        raise FileNotFoundError(f"llama.cpp is not built in {home()}: python tools/llama_cpp.py build")
    env = dict(os.environ, LD_LIBRARY_PATH=str(home() / "bin"))
    done = subprocess.run([str(tools[tool]), *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout + done.stderr


def permutation(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def permuted(name: str, w: np.ndarray, hidden: np.ndarray, ffn: dict[int, np.ndarray], head: np.ndarray,
             head_dim: int) -> np.ndarray:
    """One llama tensor (numpy layout: (rows, ne0) = (out, in) for Linears; (vocab, hidden) for the table) with
    the hidden channels permuted by ``hidden``, each layer's FFN channels by ``ffn[layer]`` and the dimensions
    inside every attention head of V (and the matching inputs of the output projection) by ``head``: RMSNorm,
    attention and the SwiGLU MLP are equivariant to these, so the model computes the same function."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    kind = name.split(".")[-2] if name.endswith(".weight") else name
    if name in ("token_embd.weight", "output.weight") or kind in ("attn_norm", "ffn_norm") or name == "output_norm.weight":
        return w[..., hidden]
    if kind in ("attn_q", "attn_k"):
        return w[:, hidden]
    if kind == "attn_v":
        rows = (np.arange(w.shape[0]).reshape(-1, head_dim)[:, head]).reshape(-1)
        return w[rows][:, hidden]
    if kind == "attn_output":
        cols = (np.arange(w.shape[1]).reshape(-1, head_dim)[:, head]).reshape(-1)
        return w[hidden][:, cols]
    if kind in ("ffn_gate", "ffn_up"):
        return w[ffn[layer]][:, hidden]
    if kind == "ffn_down":
        return w[hidden][:, ffn[layer]]
    raise ValueError(f"permuting {name}: not a llama tensor this knows")


def write_f32(src: Path, out: Path, permute_seed: int | None = None) -> Path:
    """``src`` (any llama GGUF) with every tensor as F32, metadata copied; with ``permute_seed`` the channels
    permuted (``permuted``). Written to a temporary name, then renamed."""
    import gguf

    if out.is_file():
        return out
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{src}: architecture {arch}; write_f32 permutes llama tensors only")
    hidden_size = int(r.fields["llama.embedding_length"].contents())
    head_dim = hidden_size // int(r.fields["llama.attention.head_count"].contents())
    layers = int(r.fields["llama.block_count"].contents())
    ffn_size = int(r.fields["llama.feed_forward_length"].contents())
    seed = permute_seed or 0
    hidden = permutation(hidden_size, seed)
    ffn = {i: permutation(ffn_size, seed + 1 + i) for i in range(layers)}
    head = permutation(head_dim, seed + 1000)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)])  # numpy order: (ne1, ne0)
        if permute_seed is not None:
            data = permuted(t.name, data, hidden, ffn, head, head_dim)
        w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def quantize(f32: Path, out: Path, kind: str, threads: int = 2) -> Path:
    """``llama-quantize`` F32 -> ``kind`` (Q8_0, Q4_K_M, Q4_0, ...)."""
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        run("llama-quantize", str(f32), str(tmp), kind, str(threads))
        tmp.replace(out)
    return out


def perplexity(model: Path, text: Path, n_ctx: int = 128, chunks: int = 40, threads: int = 2) -> float:
    """llama-perplexity's final estimate on ``text`` (second half of each ``n_ctx`` chunk scored)."""
    out = run("llama-perplexity", "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx),
              "--chunks", str(chunks), "-t", str(threads))
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not found:
        raise RuntimeError(f"llama-perplexity printed no final estimate: {out[-500:]}")
    return float(found.group(1))


def decode_tps(model: Path, threads: int = 2, new: int = 64, depth: int = 64, repetitions: int = 5) -> float:
    """llama-bench tg``new`` at depth ``depth``, batch 1: mean tokens per second over ``repetitions``."""
    out = run("llama-bench", "-m", str(model), "-p", "0", "-n", str(new), "-d", str(depth), "-t", str(threads),
              "-r", str(repetitions), "-o", "json")
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    return float(next(r for r in rows if r.get("n_gen") == new)["avg_ts"])


def perplexity_second_half(model, ids: list[int], n_ctx: int = 128, chunks: int = 40) -> tuple[float, int]:
    """A kiln artifact scored as llama-perplexity scores a GGUF: chunk i is ``ids[i * n_ctx:(i + 1) * n_ctx]``,
    run whole; the predictions at positions n_ctx / 2 .. n_ctx - 2 of the next token are scored (FP64 softmax)."""
    nll, count = 0.0, 0
    first = n_ctx // 2
    for i in range(min(chunks, len(ids) // n_ctx)):
        chunk = np.asarray([ids[i * n_ctx:(i + 1) * n_ctx]], np.int64)
        logits = model.run({"input_ids": chunk, "attention_mask": np.ones_like(chunk)})["logits"][0].astype(np.float64)
        scored = logits[first:n_ctx - 1]
        top = scored.max(-1)
        lse = np.log(np.exp(scored - top[:, None]).sum(-1)) + top
        nll += float((lse - scored[np.arange(len(scored)), chunk[0, first + 1:]]).sum())
        count += len(scored)
    return float(np.exp(nll / count)), count


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "build":
        print(build(lambda m: print(m, file=sys.stderr)))
    elif what == "check":
        print(binaries() or f"not built in {home()}: python tools/llama_cpp.py build")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
