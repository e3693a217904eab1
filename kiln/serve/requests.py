"""Reading a request: its JSON body within the server's limits, and its fields by type and range. Every problem
is a ``BadRequest`` with a status, which the app answers as a JSON error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from kiln.serve.guard import Policy, error_body


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after


def error(message: str, status: int = 400, code: str = "invalid_request") -> JSONResponse:
    return JSONResponse(error_body(message, status, code), status_code=status)


MAX_JSON_DEPTH = 32
"""OpenAI requests nest a few levels (messages of parts); deeper bodies are refused before any route looks at them."""


async def body(request: Request, policy: Policy) -> dict[str, Any]:
    """The request's JSON object, read within the body cap and timeout, parsed off the event loop, and checked for
    depth and for strings that are not valid Unicode (a lone surrogate would fail deep inside the tokenizer)."""
    async def read() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > policy.max_body_bytes:  # a chunked body carries no Content-Length for the guard to check
                raise BadRequest(f"the body is over this server's {policy.max_body_bytes} bytes (--max-body-bytes)",
                                 413, "body_too_large")
            parts.append(chunk)
        return b"".join(parts)

    try:
        raw = await asyncio.wait_for(read(), policy.body_timeout_s)
    except asyncio.TimeoutError as e:
        raise BadRequest(f"the body did not arrive within {policy.body_timeout_s:g} s (--body-timeout)", 408,
                         "body_timeout") from e
    except ClientDisconnect as e:
        raise BadRequest("the client went away before sending its body", 400, "client_disconnected") from e
    data = await asyncio.get_running_loop().run_in_executor(None, parse, raw)
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def parse(raw: bytes) -> Any:
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not JSON ({e.msg if hasattr(e, 'msg') else e})") from e
    except RecursionError as e:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from e
    problem = unusable(data)
    if problem:
        raise BadRequest(problem)
    return data


def unusable(value: Any) -> str | None:
    """Why a parsed body cannot be used (too deep, a string that is not valid Unicode), or None."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            return f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return "the request body holds a string that is not valid Unicode (a lone surrogate escape such " \
                       "as \\ud800); send UTF-8 text"
        elif isinstance(v, dict):
            todo += [(k, depth + 1) for k in v] + [(x, depth + 1) for x in v.values()]
        elif isinstance(v, list):
            todo += [(x, depth + 1) for x in v]
    return None


def field(data: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any,
          check: Callable[[Any], bool] = lambda v: True, why: str = "") -> Any:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    if not isinstance(value, kind) or not check(value):
        raise BadRequest(f"{name} {value!r} is invalid{': ' + why if why else ''}")
    return value
