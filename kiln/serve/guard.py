"""What every request meets before a route runs, and what the server refuses to start with.

``Guard`` is an ASGI middleware in front of kiln serve's routes. In order, a request is refused when:
- its ``Host`` header names neither the address the server is bound to nor a name given with ``--allowed-host``
  (400): a web page cannot reach a loopback server through a DNS name it controls (DNS rebinding);
- it carries an ``Origin`` (a browser's cross-origin request) that is neither the server's own origin nor one given
  with ``--cors-origin`` (403);
- an API key is set and ``Authorization: Bearer KEY`` does not match one (401; compared in constant time); ``/health``
  stays open for load balancers;
- a POST's body is not ``application/json`` (415): a page's form or ``text/plain`` post is a "simple" request a
  browser sends without asking first;
- its ``Content-Length`` is over the body cap (413), before a byte of the body is read.
``Policy`` holds those settings; ``read_keys`` and ``check_bind`` are the CLI's start-up checks; ``protocol`` adds the
header-read timeout Uvicorn lacks (a connection that has not finished its request line and headers in time is closed).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kiln.errors import UsageError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 << 20
"""A request body past it is refused with 413 (2048 embedding inputs of ~2 KB, or a prompt of a million characters)."""
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = frozenset({"/health"})
ENDPOINTS = {"/v1/embeddings": "embeddings", "/v1/completions": "completions", "/v1/chat/completions": "chat",
             "/health": "health", "/metrics": "metrics", "/v1/models": "models"}
"""Path -> the endpoint label of the metrics; any other path counts as "other" (a bounded label set)."""


def loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Policy:
    """How the server guards its routes (``kiln serve`` flags; ``create_app(..., policy=...)``)."""

    bind: str = "127.0.0.1"
    """The address the server listens on: the Host header must name it (or an allowed host)."""
    keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    hosts: frozenset[str] | None = field(init=False)
    """Host names (lower case, no port) a request may name; None: any (a wildcard bind with no --allowed-host)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.body_timeout_s <= 0 or self.header_timeout_s <= 0:
            raise UsageError(f"--max-body-bytes {self.max_body_bytes} / --body-timeout {self.body_timeout_s:g} / "
                             f"--header-timeout {self.header_timeout_s:g}: give at least 1024 bytes and positive "
                             "seconds")
        names = {h.lower().strip("[]") for h in self.allowed_hosts}
        if wildcard(self.bind):
            hosts = frozenset(names) if names else None
        else:
            hosts = frozenset(names | {self.bind.lower().strip("[]")}
                              | (set(LOOPBACK_NAMES) if loopback(self.bind) else set()))
        object.__setattr__(self, "hosts", hosts)

    def host_allowed(self, header: str) -> bool:
        if self.hosts is None:
            return True
        name = header.lower()
        name = name[1:name.index("]")] if name.startswith("[") and "]" in name else name.rsplit(":", 1)[0] \
            if name.count(":") == 1 else name
        return name in self.hosts

    def key_ok(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return False
        given_bytes = given.strip().encode("utf-8", "surrogateescape")
        ok = False
        for key in self.keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given_bytes, key.encode())
        return ok


def read_keys(flags: list[str] | None, key_file: str | None, env: dict[str, str] | None = None) -> tuple[str, ...]:
    """API keys from ``--api-key`` (repeatable), ``--api-key-file`` (one per line, ``#`` comments) and
    ``KILN_API_KEY``; each at least 16 characters of visible ASCII."""
    env = os.environ if env is None else env
    keys = list(flags or [])
    if env.get("KILN_API_KEY"):
        keys.append(env["KILN_API_KEY"])
    if key_file:
        path = Path(key_file)
        try:
            if path.stat().st_size > 1 << 20:
                raise UsageError(f"--api-key-file {key_file} is over 1 MiB; give a file of keys, one per line")
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file {key_file} cannot be read ({e}); give a text file of keys, one per "
                             "line") from e
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise UsageError(f"--api-key-file {key_file} holds no key; put one key per line")
    for key in keys:
        if len(key) < 16 or not key.isascii() or not key.isprintable() or " " in key:
            raise UsageError("an API key must be at least 16 visible ASCII characters without spaces (one was "
                             f"{len(key)} characters); generate one with: python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))'")
    return tuple(dict.fromkeys(keys))


def check_bind(policy: Policy, insecure_no_auth: bool) -> None:
    """Refuse to listen beyond this machine without an API key, unless the user says so."""
    if not policy.keys and not loopback(policy.bind) and not insecure_no_auth:
        raise UsageError(f"--host {policy.bind} listens beyond this machine without an API key: pass --api-key KEY "
                         "(or KILN_API_KEY, --api-key-file), or --insecure-no-auth behind a proxy that authenticates")


def protocol(base: type, header_timeout_s: float) -> type:
    """Uvicorn's HTTP protocol class ``base`` with a header-read timeout: a connection whose next request has not
    finished its headers ``header_timeout_s`` after it opened (or after its last response) is closed. Uvicorn
    replaces ``cycle`` when a request's headers are complete, so the timer only has to see whether it changed."""

    class TimedHeaders(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._kiln_arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._kiln_arm()

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_kiln_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _kiln_arm(self) -> None:
            timer = getattr(self, "_kiln_timer", None)
            if timer is not None:
                timer.cancel()
            armed_at = self.cycle
            self._kiln_timer = self.loop.call_later(header_timeout_s, self._kiln_expire, armed_at)

        def _kiln_expire(self, armed_at: Any) -> None:
            if self.cycle is armed_at and not self.transport.is_closing():  # no request began since: too slow
                self.transport.close()

    TimedHeaders.__name__ = f"TimedHeaders{base.__name__}"
    return TimedHeaders


def http_protocol(header_timeout_s: float) -> type:
    """Uvicorn's fastest installed HTTP protocol (httptools, else h11) with the header-read timeout."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return protocol(base, header_timeout_s)


def error_body(message: str, status: int, code: str) -> dict[str, Any]:
    """kiln serve's JSON error, the same for the guard's refusals and the routes' (``requests.error``)."""
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "code": code}}


async def send_error(send: Send, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(error_body(message, status, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
           (b"connection", b"close")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


class Guard:
    """The ASGI middleware: refuse (one JSON error, counted in the metrics) or pass the request on."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], policy: Policy,
                 count: Callable[[str, int, float], None]) -> None:
        self.app, self.policy, self.count = app, policy, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t = time.perf_counter()
        refused = self.refusal(scope)
        if refused is None:
            return await self.app(scope, receive, send)
        status, code, message, extra = refused
        await send_error(send, status, code, message, extra)
        self.count(ENDPOINTS.get(scope.get("path", ""), "other"), status, time.perf_counter() - t)

    def refusal(self, scope: Scope) -> tuple[int, str, str, dict[str, str]] | None:
        headers: dict[str, str] = {}
        for name, value in scope.get("headers", []):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        p = self.policy
        host = headers.get("host", "")
        if not p.host_allowed(host):
            return (400, "invalid_host", f"Host {host[:80]!r} is not a name this server answers to; send the address "
                    "it listens on or start it with --allowed-host NAME", {})
        origin = headers.get("origin")
        if origin is not None and origin not in p.cors_origins and urlsplit(origin).netloc.lower() != host.lower():
            return (403, "cross_origin", f"cross-origin requests from {origin[:80]!r} are refused; start the server "
                    "with --cors-origin ORIGIN to allow a web app", {})
        path = scope.get("path", "")
        if p.keys and path not in OPEN_PATHS and not p.key_ok(headers.get("authorization", "")):
            return (401, "invalid_api_key", "this server needs an API key: send Authorization: Bearer KEY",
                    {"WWW-Authenticate": "Bearer"})
        if scope.get("method") == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return (415, "unsupported_media_type", f"the body must be application/json, got "
                        f"{kind[:60] or 'no Content-Type'!r}; send JSON with Content-Type: application/json", {})
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or len(length) > 18):
                return (400, "invalid_request", f"Content-Length {length[:40]!r} is not a byte count", {})
            if length is not None and int(length) > p.max_body_bytes:
                return (413, "body_too_large", f"the body is {int(length)} bytes, more than this server's "
                        f"{p.max_body_bytes} (--max-body-bytes)", {})
        return None
