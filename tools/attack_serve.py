"""``kiln serve`` under attack, then under load: the serve-and-load-safely issue's checks on a real model.

    python tools/attack_serve.py [--variant fp32|int4] [--clients 32] [--seconds 60] [--slow 500]

The server runs in its own process (``kiln serve``, SmolLM2-135M-Instruct compiled once into ``--work``), the attacks
and clients here:
1. a 10 MB body: its 413's latency, and ``/health``'s latency while three such bodies are being sent;
2. ``--slow`` connections that send their headers and five bytes of a 100-byte body, and as many that never finish
   their headers: each is answered 408 or closed after the server's timeouts, and ``/health``'s worst latency while
   they are held;
3. a cross-origin ``text/plain`` POST (what any web page can send to 127.0.0.1), a foreign Origin, a foreign Host;
4. malformed requests (seed -1, a lone surrogate, JSON nested 100k deep, stream "no"): all 4xx JSON;
5. 32 non-streaming clients that close their sockets mid-generation: tokens generated for them afterwards;
6. with ``--api-key``: no key 401, the key 200;
then ``--clients`` streaming clients for ``--seconds`` (greedy): errors, completions equal to the same prompt served
alone, and ``kiln_in_flight`` once they are done. Prints the machine line and one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from load_serve import TOPICS, Server, alone_all, smollm2_artifact, stream_load  # noqa: E402

from bench_encoder import cpu_name  # noqa: E402
from kiln.runtimes.canary import isa  # noqa: E402

POST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def reply_of(port: int, head: bytes, body: bytes = b"", wait: float = 60.0) -> tuple[bytes, float]:
    """Send ``head`` then ``body`` (from a thread: the server may answer first); the reply's status line and the
    seconds from the first byte sent to the first byte of the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        t = time.perf_counter()
        s.sendall(head)

        def rest() -> None:
            try:
                for i in range(0, len(body), 1 << 16):
                    s.sendall(body[i:i + (1 << 16)])
            except OSError:
                pass

        threading.Thread(target=rest, daemon=True).start()
        first = s.recv(4096)
        return first.split(b"\r\n", 1)[0].removeprefix(b"HTTP/1.1 "), time.perf_counter() - t


def health_ms(url: str, n: int = 10) -> float:
    import httpx

    worst = 0.0
    for _ in range(n):
        t = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.02)
    return 1e3 * worst


def metrics_text(url: str) -> str:
    import httpx

    return httpx.get(url + "/metrics", timeout=60).text


def metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text(url).splitlines() if line.startswith(name))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def attacks(server: Server, slow: int, rows: list[tuple[str, str, str]]) -> None:
    import httpx

    url, port = server.url, server.port
    before = rss_mib(server.proc.pid)
    big = json.dumps({"prompt": "the cat " * (10 * 2 ** 20 // 8)}).encode()
    status, seconds = reply_of(port, POST + b"Content-Length: %d\r\n\r\n" % len(big), big)
    rows.append(("10 MB body", status.decode(), f"answered in {1e3 * seconds:.1f} ms"))
    with ThreadPoolExecutor(3) as pool:
        posts = [pool.submit(reply_of, port, POST + b"Content-Length: %d\r\n\r\n" % len(big), big) for _ in range(3)]
        during = health_ms(url)
        statuses = {p.result()[0].decode() for p in posts}
    rows.append(("/health while 3 x 10 MB are sent", ", ".join(sorted(statuses)), f"worst {during:.1f} ms"))
    rows.append(("server RSS before / after the 10 MB bodies", f"{before:.0f} / {rss_mib(server.proc.pid):.0f} MiB", ""))

    socks = []
    for _ in range(slow):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(POST + b"Content-Length: 100\r\n\r\n{\"pro")
        socks.append(("body", s))
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.")
        socks.append(("headers", s))
    held = health_ms(url)
    answers = {"body": {}, "headers": {}}
    t = time.perf_counter()
    for kind, s in socks:
        try:
            got = s.recv(4096).split(b"\r\n", 1)[0].removeprefix(b"HTTP/1.1 ").decode() or "closed"
        except OSError as e:
            got = type(e).__name__
        answers[kind][got] = answers[kind].get(got, 0) + 1
        s.close()
    rows.append((f"{slow} slow bodies (5 of 100 bytes)", ", ".join(f"{k} x{v}" for k, v in answers["body"].items()),
                 f"/health worst {held:.1f} ms while held"))
    rows.append((f"{slow} unfinished headers", ", ".join(f"{k} x{v}" for k, v in answers["headers"].items()),
                 f"all ended {time.perf_counter() - t:.1f} s after the last was opened"))

    with httpx.Client(base_url=url, timeout=60) as c:
        for name, kwargs in (("cross-origin text/plain POST", {"content": b'{"prompt": "hi"}', "headers": {
                                 "content-type": "text/plain", "origin": "https://evil.example"}}),
                             ("text/plain POST, no Origin", {"content": b'{"prompt": "hi"}',
                                                             "headers": {"content-type": "text/plain"}}),
                             ("foreign Origin, JSON", {"json": {"prompt": "hi"},
                                                       "headers": {"origin": "https://evil.example"}}),
                             ("foreign Host (DNS rebinding)", {"json": {"prompt": "hi"},
                                                               "headers": {"host": "evil.example:8000"}})):
            r = c.post("/v1/completions", **kwargs)
            rows.append((name, str(r.status_code), r.json()["error"]["message"][:60]))
        for name, body in (("seed -1", b'{"prompt": "x", "seed": -1}'), ("lone surrogate", b'{"prompt": "\\ud800"}'),
                           ("JSON 100k deep", b"[" * 100_000 + b"]" * 100_000),
                           ("stream \"no\"", b'{"prompt": "x", "stream": "no"}')):
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            rows.append((name, str(r.status_code), r.json()["error"]["message"][:60]))

    generated = metric(url, "kiln_inter_token_latency_seconds_count")
    payload = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": True}).encode()
    gone = []
    for _ in range(32):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(POST + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        gone.append(s)
    time.sleep(1.0)
    for s in gone:
        s.close()
    deadline = time.time() + 60
    while metric(url, "kiln_in_flight") and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    made = metric(url, "kiln_inter_token_latency_seconds_count") - generated
    rows.append(("32 clients leave after 1 s (200 tokens each)", f"in flight {metric(url, 'kiln_in_flight'):.0f}",
                 f"{made:.0f} of 6400 tokens generated"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="fp32", choices=("fp32", "int4"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--slow", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "kiln" / "load-serve")
    args = ap.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 2 sockets per slow client, here and in the server
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.slow + 1024)), hard))
    art = smollm2_artifact(args.work, args.variant, args.threads)
    rows: list[tuple[str, str, str]] = []
    flags = ("--max-batch", "8", "--queue", "64", "--body-timeout", "2", "--header-timeout", "2",
             "--max-connections", str(4 * args.slow + 256))
    server = Server(art, args.threads, *flags)
    try:
        attacks(server, args.slow, rows)
        prompts = [f"Write one sentence about {t}." for t in TOPICS][:args.clients]
        alone = asyncio.run(alone_all(server.url, prompts, args.tokens))
        load = asyncio.run(stream_load(server.url, prompts, args.tokens, alone, args.seconds))
        rows.append((f"then {args.clients} clients x {args.seconds:g} s", f"{load['errors']} errors",
                     f"{load['equal']} of {load['requests'] - load['errors']} equal to alone, "
                     f"{load['tok_s']:.0f} tok/s"))
        rows.append(("kiln_in_flight after the load", f"{metric(server.url, 'kiln_in_flight'):.0f}", ""))
        fives = sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text(server.url).splitlines()
                    if line.startswith("kiln_requests_total") and 'status="500"' in line)
        rows.append(("HTTP 500s in kiln_requests_total", f"{fives:.0f}", ""))
    finally:
        server.close()
    key = secrets.token_urlsafe(24)
    os.environ["KILN_API_KEY"] = key
    server = Server(art, args.threads)
    try:
        import httpx

        with httpx.Client(base_url=server.url, timeout=60) as c:
            body = {"prompt": "hi", "max_tokens": 2}
            rows.append(("KILN_API_KEY set: no key / the key / /health",
                         f"{c.post('/v1/completions', json=body).status_code} / "
                         f"{c.post('/v1/completions', json=body, headers={'authorization': f'Bearer {key}'}).status_code}"
                         f" / {c.get('/health').status_code}", ""))
    finally:
        server.close()
        os.environ.pop("KILN_API_KEY")
    print(f"machine: {cpu_name()} ({isa()}), {os.cpu_count()} cores; SmolLM2-135M-Instruct {args.variant}, "
          f"kiln serve {' '.join(flags)}")
    print(f"{'attack':<46} {'answer':<26} detail")
    for name, answer, detail in rows:
        print(f"{name:<46} {answer:<26} {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
