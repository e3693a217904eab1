"""kiln tried as an attacker and a careless client would: each row of the serve-and-load-safely issue's table as a
test (it failed on the code before the fix), against a real Uvicorn server on 127.0.0.1 where sockets matter (body
caps, timeouts, a client that goes away) and Starlette's test client elsewhere; then property-based fuzzing of
request bodies against the running server. Artifacts, checkpoints and reports are confined and bounded too."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import FUZZ_SEED

import kiln.runtimes as kr
from kiln.cli import main
from kiln.errors import ArtifactError, CheckpointError, UsageError

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from kiln.serve import create_app  # noqa: E402
from kiln.serve.guard import Policy, check_bind, http_protocol, protocol, read_keys  # noqa: E402

KEY = "k" * 20 + "-test-key"
WAIT = 30.0
"""A bound on every wait below: reached only when the behaviour under test is broken (never a timing assertion)."""


@contextlib.contextmanager
def running(app, policy: Policy | None = None, base: type | None = None):
    """``app`` served by Uvicorn (with kiln's header timeout; over ``base``, Uvicorn's HTTP protocol class, or the
    one ``kiln serve`` picks) on a free loopback port, in a thread."""
    policy = policy or Policy()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    http = protocol(base, policy.header_timeout_s) if base else http_protocol(policy.header_timeout_s)
    config = uvicorn.Config(app, log_level="warning", access_log=False, http=http,
                            limit_concurrency=256)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()


def in_flight(text: str) -> float:
    return float(next(l.split()[1] for l in text.splitlines() if l.startswith("kiln_in_flight ")))


def requests_total(text: str) -> int:
    return sum(int(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("kiln_requests_total{"))


def settle(client, base: str = "", headers=None) -> str:
    """/metrics once ``kiln_in_flight`` is back to 0 (bounded)."""
    deadline = time.monotonic() + WAIT
    while True:
        text = client.get(base + "/metrics", headers=headers).text
        if in_flight(text) == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


@pytest.fixture
def llama_app(artifacts):
    return create_app(artifacts["llama"], threads=1)


# ---- limits before work ---------------------------------------------------------------------------------------------
def send_and_read(port: int, head: bytes, body: bytes) -> bytes:
    """Send ``head`` and then ``body`` from another thread (the server may answer and close before it is all sent),
    and read the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        s.sendall(head)

        def rest():
            with contextlib.suppress(OSError):
                for i in range(0, len(body), 1 << 16):
                    s.sendall(body[i:i + (1 << 16)])

        sender = threading.Thread(target=rest, daemon=True)
        sender.start()
        out = b""
        with contextlib.suppress(socket.timeout, ConnectionResetError):
            while b"\r\n\r\n" not in out and (chunk := s.recv(65536)):
                out += chunk
        return out


POST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def test_a_10_mb_body_is_refused_before_it_is_read_and_health_never_waits(artifacts):
    policy = Policy(max_body_bytes=1 << 20)
    app = create_app(artifacts["llama"], threads=1, policy=policy)
    big = json.dumps({"prompt": "the cat " * (10 * 2 ** 20 // 8)}).encode()
    with running(app, policy) as (base, port), httpx.Client(timeout=WAIT) as client:
        with ThreadPoolExecutor(4) as pool:
            posts = [pool.submit(send_and_read, port, POST + b"Content-Length: %d\r\n\r\n" % len(big), big)
                     for _ in range(3)]
            healths = [client.get(base + "/health") for _ in range(5)]
            replies = [p.result() for p in posts]
        assert all(r.startswith(b"HTTP/1.1 413") for r in replies), replies
        assert all(h.status_code == 200 for h in healths)
        # a lying Content-Length with one byte sent: 413 at once, nothing held open
        reply = send_and_read(port, POST + b"Content-Length: 99999999999999\r\n\r\n", b"{")
        assert reply.startswith(b"HTTP/1.1 413")
        # a chunked body (no Content-Length for the guard) is cut at the cap while it is read
        chunk = b" " * (1 << 20)
        chunked = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2 + b"0\r\n\r\n"
        reply = send_and_read(port, POST + b"Transfer-Encoding: chunked\r\n\r\n", chunked)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        # under the cap but longer than any prompt the model takes: refused from its byte count, not tokenized
        r = client.post(base + "/v1/completions", json={"prompt": "x" * (512 << 10)})
        assert r.status_code == 400 and "bytes, longer than the model's maximum" in r.json()["error"]["message"]
        text = settle(client, base)
    assert in_flight(text) == 0 and 'endpoint="completions",status="413"' in text


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_slow_bodies_and_slow_headers_are_cut_off(artifacts, parser):
    if parser == "httptools":
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as http
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as http
    policy = Policy(body_timeout_s=0.5, header_timeout_s=0.5)
    app = create_app(artifacts["llama"], threads=1, policy=policy)
    with running(app, policy, http) as (base, port):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"pro")
        slow = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(40)]
        for s in slow:
            s.sendall(head)
        headers_only = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(40)]
        for s in headers_only:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.")
        with httpx.Client(timeout=WAIT) as client:
            assert client.get(base + "/health").status_code == 200  # the server still answers others
        for s in slow:  # each gets 408 once its body is overdue
            assert s.recv(4096).startswith(b"HTTP/1.1 408")
            s.close()
        for s in headers_only:  # closed without an answer once its headers are overdue
            assert s.recv(4096) == b""
            s.close()
        with httpx.Client(timeout=WAIT) as client:
            text = settle(client, base)
        assert in_flight(text) == 0 and 'status="408"' in text


# ---- who may call ---------------------------------------------------------------------------------------------------
def test_api_key_host_origin_and_content_type(artifacts):
    policy = Policy(keys=(KEY,), cors_origins=("https://app.example",))
    with TestClient(create_app(artifacts["llama"], threads=1, policy=policy), base_url="http://127.0.0.1:8000") as c:
        good = {"authorization": f"Bearer {KEY}"}
        assert c.get("/health").status_code == 200  # open for load balancers
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      headers={"authorization": "Bearer " + KEY[:-1] + "x"}).status_code == 401
        assert c.get("/metrics").status_code == 401
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=good)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
        # DNS rebinding: a name the server was not told about
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers=good | {"host": "attacker.example:8000"})
        assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
        # a web page's form or text/plain post (no preflight in a browser): refused
        r = c.post("/v1/completions", content=b'{"prompt": "hi"}', headers=good | {"content-type": "text/plain"})
        assert r.status_code == 415
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers=good | {"origin": "https://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        # the named origin gets CORS, preflight included
        pre = c.options("/v1/completions", headers={"origin": "https://app.example",
                                                    "access-control-request-method": "POST",
                                                    "access-control-request-headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers=good | {"origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        metrics = c.get("/metrics", headers=good).text
        for status in ("401", "400", "415", "403"):
            assert f'status="{status}"' in metrics
        assert in_flight(metrics) == 0


def test_without_a_key_no_cors_and_same_origin_only(llama_app):
    with TestClient(llama_app, base_url="http://localhost:8000") as c:
        same = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      headers={"origin": "http://localhost:8000"})
        assert same.status_code == 200 and "access-control-allow-origin" not in same.headers
        assert c.post("/v1/completions", json={"prompt": "hi"},
                      headers={"origin": "http://localhost:9999"}).status_code == 403
        assert c.options("/v1/completions", headers={"origin": "https://evil.example",
                                                     "access-control-request-method": "POST"}).status_code in (403, 405)


def test_binding_beyond_loopback_needs_a_key(artifacts, tmp_path, capsys, monkeypatch):
    with pytest.raises(UsageError, match="--api-key"):
        check_bind(Policy(bind="0.0.0.0"), insecure_no_auth=False)
    check_bind(Policy(bind="0.0.0.0"), insecure_no_auth=True)
    check_bind(Policy(bind="0.0.0.0", keys=(KEY,)), insecure_no_auth=False)
    check_bind(Policy(bind="::1"), insecure_no_auth=False)
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    assert main(["serve", str(artifacts["llama"]), "--host", "0.0.0.0"]) == 2
    assert "--insecure-no-auth" in capsys.readouterr().err
    assert main(["serve", str(artifacts["llama"]), "--api-key", "short"]) == 2
    assert "at least 16" in capsys.readouterr().err
    keys = tmp_path / "keys"
    keys.write_text(f"# ops\n{KEY}\n\n{KEY}2\n")
    assert read_keys(None, str(keys), {"KILN_API_KEY": KEY + "3"}) == (KEY + "3", KEY, KEY + "2")
    keys.write_text("# none\n")
    with pytest.raises(UsageError, match="holds no key"):
        read_keys(None, str(keys), {})
    # the wildcard bind takes any Host unless names are given; a loopback bind its own names only
    assert Policy(bind="0.0.0.0").host_allowed("anything:1")
    assert not Policy(bind="0.0.0.0", allowed_hosts=("api.example",)).host_allowed("other.example")
    assert Policy(bind="127.0.0.1").host_allowed("[::1]:8000") and Policy(bind="::1").host_allowed("localhost")


# ---- backpressure ---------------------------------------------------------------------------------------------------
def slow_steps(server, seconds: float = 0.03) -> None:
    """Every decode step of the server's scheduler takes ``seconds`` longer (a model big enough to watch)."""
    step = server.scheduler._step

    def slow(joining):
        time.sleep(seconds)
        return step(joining)

    server.scheduler._step = slow


def tokens_generated(server) -> int:
    return server.metrics.generation["itl"].total + server.metrics.generation["ttft"].total


@pytest.mark.parametrize("decode", ["batched", "threads"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_frees_its_slot(artifacts, monkeypatch, stream, decode):
    app = create_app(artifacts["llama"], threads=1, max_batch=2, decode=decode)
    server = app.state.server
    pieces = []
    if decode == "batched":
        slow_steps(server)
    else:  # each request generates on its own thread: count what its generator still produces
        generate = server.model.stream

        def slow(*a, **k):
            for piece in generate(*a, **k):
                time.sleep(0.03)
                pieces.append(piece)
                yield piece

        monkeypatch.setattr(server.model, "stream", slow)
    payload = json.dumps({"prompt": "the cat", "max_tokens": 40, "ignore_eos": True, "stream": stream}).encode()
    with running(app) as (base, port):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(POST + b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            time.sleep(0.3)  # a few steps in
        with httpx.Client(timeout=WAIT) as client:
            text = settle(client, base)
            made = tokens_generated(server) if decode == "batched" else len(pieces)
            ok = client.post(base + "/v1/completions", json={"prompt": "the cat", "max_tokens": 3})
    assert in_flight(text) == 0 and server.admitted == 0
    assert made < 30, f"{made} of 40 tokens generated for a client that left"
    assert ok.status_code == 200
    if server.scheduler is not None:
        assert all(r is None for r in server.scheduler._rows)


def test_threads_mode_has_the_bounded_queue(artifacts, monkeypatch):
    app = create_app(artifacts["llama"], threads=1, max_batch=1, queue=2, decode="threads")
    server = app.state.server
    assert server.scheduler is None
    stream = server.model.stream

    def slow(*a, **k):
        for piece in stream(*a, **k):
            time.sleep(0.05)
            yield piece

    monkeypatch.setattr(server.model, "stream", slow)
    with running(app) as (base, _), httpx.Client(timeout=WAIT) as client:
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda _: client.post(base + "/v1/completions", json={
                "prompt": "the cat", "max_tokens": 8, "ignore_eos": True}), range(12)))
        text = settle(client, base)
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 3 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    assert all(int(r.headers["retry-after"]) >= 1 for r in replies if r.status_code == 429)
    assert in_flight(text) == 0 and server.admitted == 0


# ---- every bad request a 4xx JSON error, the metrics true --------------------------------------------------------
BAD = [
    ({"prompt": "x", "seed": -1}, "seed -1 is invalid"),
    ({"prompt": "x", "seed": 2 ** 70}, "seed"),
    (b'{"prompt": "\\ud800"}', "not valid Unicode"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "nests deeper"),
    ({"prompt": "x", "stream": "no"}, "stream 'no' is invalid"),
    ({"prompt": "x", "max_tokens": 10 ** 30}, "max_tokens"),
    ({"prompt": "the cat " * 200}, "tokens, longer than the model's maximum"),
]


def test_bad_requests_are_4xx_json_and_counted(llama_app):
    with TestClient(llama_app, base_url="http://localhost") as c:
        before = requests_total(c.get("/metrics").text)
        for payload, words in BAD:
            body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500 and words in r.json()["error"]["message"], (str(payload)[:40], r.text)
            assert "truncate=True" not in r.text
        text = c.get("/metrics").text
    assert in_flight(text) == 0
    assert requests_total(text) == before + len(BAD)  # every one counted


def test_embeddings_encoding_format_and_truncate(artifacts):
    with TestClient(create_app(artifacts["bert"], threads=1), base_url="http://localhost") as c:
        plain = c.post("/v1/embeddings", json={"input": ["a cat", "the dog"]}).json()["data"]
        packed = c.post("/v1/embeddings", json={"input": ["a cat", "the dog"], "encoding_format": "base64"}).json()
        bad = c.post("/v1/embeddings", json={"input": "a", "encoding_format": "int8"})
        long = c.post("/v1/embeddings", json={"input": "word " * 300})
        cut = c.post("/v1/embeddings", json={"input": "word " * 300, "truncate": True})
        huge = c.post("/v1/embeddings", json={"input": "word " * 20_000})  # refused from its byte count
    for want, got in zip(plain, packed["data"]):
        vector = np.frombuffer(base64.b64decode(got["embedding"]), "<f4")
        np.testing.assert_array_equal(vector, np.asarray(want["embedding"], np.float32))
    assert bad.status_code == 400 and "float or base64" in bad.json()["error"]["message"]
    assert long.status_code == 400 and '"truncate": true' in long.json()["error"]["message"]
    assert "truncate=True" not in long.text and cut.status_code == 200
    assert huge.status_code == 400 and "bytes, longer" in huge.text and '"truncate": true' in huge.json()["error"]["message"]


# ---- artifacts: confined, checksummed, bounded --------------------------------------------------------------------
def relink(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def tampered(artifact: Path, tmp_path: Path, change) -> Path:
    out = tmp_path / "art"
    shutil.copytree(artifact, out)
    data = json.loads((out / "manifest.json").read_text())
    change(data, out)
    (out / "manifest.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("change,words", [
    (lambda d, p: d["tokenizer"].update(chat_template="../../secret.txt"), 'tokenizer.chat_template "../../secret.txt"'),
    (lambda d, p: d["files"].update({"../../../../etc/hostname": "0" * 64}), '"../../../../etc/hostname"'),
    (lambda d, p: d["files"].update({"/etc/hostname": "0" * 64}), '"/etc/hostname"'),
    (lambda d, p: d["files"].pop("model.onnx"), 'graphs.model "model.onnx"'),
    (lambda d, p: d.update(files={}), "lists no files"),
    (lambda d, p: relink(p / "tokenizer.json", "/etc/hostname"), "symbolic link"),
    (lambda d, p: (p / "x.data").symlink_to("/etc/hostname"), 'symbolic link "x.data"'),
    (lambda d, p: d["generation"].update(pad_token_id=2 ** 70), "generation.pad_token_id"),
    (lambda d, p: d["kv_cache"].update(capacity=2 ** 40), "kv_cache.capacity"),
    (lambda d, p: d["kv_cache"].update(num_kv_heads=60000, head_size=60000), "GiB per sequence"),
    (lambda d, p: d.update(schema_version="1"), 'schema_version "1", this kiln reads 1 (an integer)'),
])
def test_hostile_manifests_are_refused_naming_the_path(artifacts, tmp_path, change, words):
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 7 * 6 }} secret")
    art = tampered(artifacts["llama"], tmp_path, change)
    with pytest.raises(ArtifactError) as e:
        kr.load(art, threads=1)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert main(["check", str(art)]) != 0


def test_a_known_hash_no_longer_tells_whether_a_file_exists(artifacts, tmp_path):
    from kiln.runtimes.artifact import sha256_file

    target = Path("/etc/hostname")
    for name, digest in (("../../../../etc/hostname", sha256_file(target) if target.is_file() else "0" * 64),
                         ("../../../../etc/no-such-file", "0" * 64)):
        art = tampered(artifacts["llama"], tmp_path / name.rsplit("/", 1)[1], lambda d, p: d["files"].update({name: digest}))
        with pytest.raises(ArtifactError, match="not a plain relative path"):
            kr.load(art, threads=1)


# ---- checkpoints: confined and bounded ------------------------------------------------------------------------------
def sharded(tmp_path: Path, shard: str) -> Path:
    from safetensors.numpy import save_file

    root = tmp_path / "ckpt"
    root.mkdir()
    save_file({"w": np.zeros(4, np.float32)}, str(root / "model-00001.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    return root


def header_file(tmp_path: Path, header: bytes, length: int | None = None) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header) if length is None else length) + header
                                             + b"\0" * 64)
    return root


@pytest.mark.parametrize("make,words", [
    (lambda t: sharded(t, "../../../../etc/passwd"), '"../../../../etc/passwd"'),
    (lambda t: sharded(t, "/etc/passwd"), '"/etc/passwd"'),
    (lambda t: header_file(t, b"{}", 2 ** 63), "header length"),
    (lambda t: header_file(t, b"[1, 2]"), "not an object"),
    (lambda t: header_file(t, b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99999]}}'), "truncated"),
    (lambda t: header_file(t, b'{"w": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}'), "valid dtype"),
    (lambda t: header_file(t, b"[" * 5000 + b"]" * 5000), "corrupt"),
])
def test_hostile_checkpoints_are_refused_naming_the_path(tmp_path, make, words):
    from kiln.compiler.lazy import LazyWeights
    from kiln.compiler.load import check_weights

    root = make(tmp_path)
    for read in (check_weights, LazyWeights):
        with pytest.raises(CheckpointError) as e:
            read(root)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_symlinked_shard_out_of_the_checkpoint_is_refused(tmp_path):
    from kiln.compiler.load import check_weights

    root = sharded(tmp_path, "model-00002.safetensors")
    (root / "model-00002.safetensors").symlink_to(root / "model-00001.safetensors")
    check_weights(root)  # a link inside the checkpoint is fine
    (root / "model-00002.safetensors").unlink()
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(root / "model-00001.safetensors", outside)
    (root / "model-00002.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link out of the directory"):
        check_weights(root)


# ---- kiln gate: unusable input is exit 2 ----------------------------------------------------------------------------
def report(tmp_path: Path, metrics: dict, **extra) -> Path:
    p = tmp_path / "report.json"
    p.write_text(json.dumps({"schema": "kiln-report", "schema_version": 1,
                             "metrics": {"ppl_increase_pct": 1.0, "top1_agreement": 1.0} | metrics,
                             "latency": {"p50_ms": 1.0}} | extra))
    return p


@pytest.mark.parametrize("write,words", [
    (lambda t: report(t, {"top1_agreement": float("inf")}), "not a finite number"),
    (lambda t: report(t, {"top1_agreement": True}), "not a finite number"),
    (lambda t: report(t, {"top1_agreement": "0.99"}), "not a finite number"),
    (lambda t: report(t, {"top1_agreement": 1.0, "ppl_increase_pct": float("-inf")}), "not a finite number"),
    (lambda t: t, "not a file"),
    (lambda t: (t / "deep.json").write_text("[" * 100_000 + "]" * 100_000) and t / "deep.json", "too deeply"),
    (lambda t: report(t, {"top1_agreement": 1.0}, schema_version=2, artifacts=[
        {"artifact": None, "metrics": {"top1_agreement": 1.0}, "latency": {}}]), "lacks its metrics"),
    (lambda t: report(t, {"top1_agreement": 1.0}, schema_version=True), "not a kiln report"),
])
def test_gate_refuses_unusable_reports_with_exit_2(tmp_path, capsys, monkeypatch, write, words):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path)
    code = main(["gate", str(path), "--min-top1-agreement", "0.9", "--max-ppl-increase-pct", "5"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_gate_refuses_a_non_finite_threshold_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["gate", str(report(tmp_path, {"top1_agreement": 1.0})), "--min-top1-agreement", "nan"]) == 2
    assert "finite" in capsys.readouterr().err


# ---- fuzzing: any body, any endpoint, against the running server --------------------------------------------------
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_values = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
                       | st.text(max_size=16), lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
_fields = st.fixed_dictionaries({}, optional={
    "prompt": _values | st.text(max_size=40), "messages": _values, "input": _values | st.text(max_size=40),
    "max_tokens": _values | st.integers(-2, 6), "temperature": _values, "top_p": _values, "seed": _values,
    "stream": _values, "n": _values, "stop": _values, "encoding_format": _values, "truncate": _values,
    "ignore_eos": _values})
_bodies = st.one_of(_fields.map(lambda d: json.dumps(d).encode()), _values.map(lambda v: json.dumps(v).encode()),
                    st.binary(max_size=64))
_paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/nope"])


@pytest.fixture(scope="module")
def fuzz_server(artifacts):
    app = create_app(artifacts["llama"], threads=1, max_batch=2, queue=4)
    with running(app) as (base, _), httpx.Client(base_url=base, timeout=WAIT) as client:
        yield client


def _one(client, path: str, body: bytes) -> None:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404, 405, 413, 429), (path, body[:80], r.status_code, r.text[:200])
    payload = r.json()
    assert r.status_code == 200 or isinstance(payload["error"]["message"], str)


_QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@settings(max_examples=80, deadline=None, suppress_health_check=_QUIET, derandomize=True, database=None)
@given(path=_paths, body=_bodies)
def test_fuzzed_request_bodies_get_json_answers(fuzz_server, path, body):
    _one(fuzz_server, path, body)


@seed(FUZZ_SEED)
@settings(max_examples=40, deadline=None, suppress_health_check=_QUIET, database=None)
@given(path=_paths, body=_bodies)
def test_fuzzed_request_bodies_get_json_answers_fresh_seed(fuzz_server, path, body):
    _one(fuzz_server, path, body)


def test_after_the_fuzzing_nothing_is_left_in_flight(fuzz_server):
    text = settle(fuzz_server)
    assert in_flight(text) == 0 and 'status="500"' not in text


def test_a_canary_that_claims_a_huge_array_is_refused_before_it_is_allocated(artifacts, tmp_path):
    import io
    import zipfile

    from kiln.compiler.manifest import write

    art = tmp_path / "art"
    shutil.copytree(artifacts["llama"], art)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2 ** 40,)})
    with zipfile.ZipFile(art / "canary.npz", "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr("decode_1/bomb.npy", header.getvalue() + b"\0" * 64)
    data = json.loads((art / "manifest.json").read_text())
    data.pop("files")
    (art / "manifest.json").unlink()
    write(art, data)  # re-hashed: only the bound can stop it
    with pytest.raises(ArtifactError, match="unpacks to 439804651[0-9]+ bytes"):
        kr.load(art, threads=1)


def test_onnx_runtime_refuses_external_data_outside_the_graphs_directory(tmp_path):
    """kiln relies on ONNX Runtime to confine a graph's external data (docs/artifact.md): pinned here, so an
    ONNX Runtime that stops doing it fails the suite instead of reading files elsewhere."""
    pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    (tmp_path / "secret.bin").write_bytes(b"s" * 64)
    (tmp_path / "art").mkdir()
    w = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    path = tmp_path / "art" / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    with pytest.raises(Exception, match="(?i)outside|escapes"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
