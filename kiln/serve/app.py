"""The ASGI app behind ``kiln serve``: OpenAI-compatible endpoints over one loaded artifact.

- Encoders: ``POST /v1/embeddings``. Requests are tokenized as they arrive (a bad one fails alone), then a
  batcher takes what is queued, waits up to ``max_wait_ms`` for more while the batch has room (``max_batch``
  texts), regroups the texts by length (padding within ``PAD_SLACK`` of the real tokens), runs each group and
  splits the results back; while a batch runs, the next one collects. ``max_batch=1``: no batching.
- Decoders: ``POST /v1/completions`` and ``/v1/chat/completions`` (the artifact's chat template), with
  ``stream: true`` as server-sent events. Continuous batching (``kiln.runtimes.scheduler``): requests join and
  leave between decode steps and one decode step runs up to ``max_batch`` of them as one batch, each in its own
  KV-cache slot; up to ``queue`` more wait for a slot, past that 429 with Retry-After. A client that goes away
  frees its slot at the next step. Artifacts whose graph cannot give each row its own past length (GPT-2's learned
  positions, older artifacts) and encoder-decoders generate each request on its own thread instead.
- ``GET /health``, ``GET /metrics`` (Prometheus text).
Errors are JSON ``{"error": {"message", "type", "code"}}``: 400 for a bad request (including a prompt past the
KV-cache capacity, with kiln's message), 404 for an endpoint this artifact's kind does not serve, 429 when the
generation queue is full.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Any


import kiln.runtimes as kr
from kiln.errors import ArtifactError, ClosedError, InputError, KilnError, UsageError
from kiln.runtimes.scheduler import QueueFull, Scheduler
from kiln.serve.batching import EncoderBatcher
from kiln.serve.metrics import Metrics

try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - the serve extra is missing
    raise UsageError("kiln serve needs its extra: pip install 'kiln[serve]' (starlette, uvicorn, jinja2)") from e


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error(message: str, status: int = 400, code: str = "invalid_request") -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


async def body(request: Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not JSON ({e.msg if hasattr(e, 'msg') else e})") from e
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


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


log = logging.getLogger("kiln.serve")

DEFAULT_SLOTS = 8
"""Decoders: requests decoded together (KV-cache slots of continuous batching) when --max-batch is not given."""
DEFAULT_QUEUE = 64
"""Decoders: requests that may wait for a slot; past it, 429 with Retry-After."""
DECODE_MODES = ("batched", "threads")
"""Decoders: continuous batching, or each request generating on its own thread at batch 1 (kiln before it)."""


class Server:
    def __init__(self, model: kr.Model, max_batch: int | None = None, max_wait_ms: float = 5.0,
                 queue: int = DEFAULT_QUEUE, decode: str = "batched", min_rows: int | None = None) -> None:
        m = model.manifest.data["model"]
        self.kind, self.task = m["kind"], m["task"]
        max_batch = max_batch if max_batch is not None else DEFAULT_SLOTS if self.kind == "decoder" else 32
        if decode not in DECODE_MODES:
            raise UsageError(f"--decode {decode!r}: choose one of {', '.join(DECODE_MODES)}")
        if min_rows is not None and min_rows < 1:
            raise UsageError(f"--min-rows {min_rows}: give at least 1 (or leave it to the artifact's canary)")
        if max_batch < 1 or max_wait_ms < 0 or queue < 0:
            raise UsageError(f"--max-batch {max_batch} / --max-wait-ms {max_wait_ms:g} / --queue {queue}: give at "
                             "least 1, at least 0 and at least 0")
        self.model, self.max_batch = model, max_batch
        self.metrics = Metrics()
        self.name = str(m.get("architecture") or model.manifest.root.name)
        self.batcher = EncoderBatcher(model, max_batch, max_wait_ms, self.metrics) if self.kind == "encoder" else None
        data = model.manifest.data
        self.generates = self.kind == "decoder" and bool(data.get("kv_cache") or (data.get("generation") or {}).get(
            "recompute")) and m["task"] == "causal-lm" or self.kind == "seq2seq"
        batched = self.kind == "decoder" and self.generates and decode == "batched"
        self.scheduler = self._scheduler(model, max_batch, queue, min_rows) if batched else None
        threads = max_batch + queue + 1 if self.scheduler else max_batch  # a scheduler's waiting requests block here
        self.workers = ThreadPoolExecutor(threads, thread_name_prefix="kiln-gen") if self.kind != "encoder" else None

    def _scheduler(self, model: kr.Model, slots: int, queue: int, min_rows: int | None) -> Scheduler | None:
        """Continuous batching where the artifact allows it; otherwise each request generates on its own thread
        (the reason logged)."""
        try:
            scheduler = Scheduler(model, slots=slots, queue_limit=queue, min_rows=min_rows)
        except ArtifactError as e:
            log.warning("kiln serve: requests generate one at a time per thread: %s", e)
            return None
        scheduler.stats.hooks.append(self.metrics.generated)
        self.metrics.generation_queue = lambda: scheduler.stats.queue_depth
        return scheduler

    # --- plumbing ----------------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [Route("/health", self.health, methods=["GET"]), Route("/metrics", self.prometheus, methods=["GET"]),
                  Route("/v1/embeddings", self.wrap("embeddings", self.embeddings), methods=["POST"]),
                  Route("/v1/completions", self.wrap("completions", self.completions), methods=["POST"]),
                  Route("/v1/chat/completions", self.wrap("chat", self.chat), methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"])]
        app = Starlette(routes=routes, lifespan=self.lifespan)
        app.state.server = self
        return app

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.batcher is not None:
            self.batcher.start()
        yield
        if self.batcher is not None:
            await self.batcher.stop()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.workers is not None:
            self.workers.shutdown(wait=False, cancel_futures=True)

    def wrap(self, endpoint: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def route(request: Request) -> Response:
            t = time.perf_counter()
            self.metrics.in_flight += 1
            try:
                response = await handler(request)
            except BadRequest as e:
                response = error(str(e), e.status, e.code)
            except QueueFull as e:  # every slot busy and the queue at its bound: come back later
                response = error(str(e), 429, "queue_full")
                response.headers["Retry-After"] = str(math.ceil(e.retry_after))
            except ClosedError as e:
                response = error(str(e), 503, "closed")
            except KilnError as e:  # InputError (lengths, capacity, sampling): the caller's to fix
                response = error(str(e), 400 if isinstance(e, InputError) else 500,
                                 "invalid_input" if isinstance(e, InputError) else "model_error")

            def done(status: int = response.status_code) -> None:
                self.metrics.in_flight -= 1
                self.metrics.request(endpoint, status, time.perf_counter() - t)

            if not isinstance(response, StreamingResponse):
                done()
                return response
            inner = response.body_iterator

            async def counted() -> AsyncIterator[Any]:  # a stream is served until its last chunk
                try:
                    async for chunk in inner:
                        yield chunk
                finally:
                    done()

            response.body_iterator = counted()
            return response

        return route

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.name, "kind": self.kind, "task": self.task,
                             "precision": self.model.manifest.data.get("precision")})

    async def prometheus(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "kiln"}]})

    def _need(self, endpoint: str, ok: bool, what: str) -> None:
        if not ok:
            raise BadRequest(f"{endpoint} is not served by this artifact ({self.kind}, {self.task}); it serves {what}",
                             404, "unsupported_endpoint")

    def _served(self) -> str:
        if self.kind == "encoder":
            return "/v1/embeddings"
        return "/v1/completions and /v1/chat/completions" if self.generates else "nothing generative (no KV cache)"

    # --- encoders ----------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        self._need("/v1/embeddings", self.batcher is not None, self._served())
        data = await body(request)
        texts = data.get("input")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("input must be a non-empty string or a non-empty list of non-empty strings")
        if len(texts) > 2048:
            raise BadRequest(f"input holds {len(texts)} texts; send at most 2048 per request")
        feeds = self.model.encode(texts)  # InputError (too long, no tokens) fails this request alone
        vectors = await self.batcher.embed(feeds)
        tokens = int(feeds["attention_mask"].sum())
        return JSONResponse({"object": "list", "model": self.name,
                             "data": [{"object": "embedding", "index": i, "embedding": v.astype(float).tolist()}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    # --- decoders ----------------------------------------------------------------------------
    def _sampling(self, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("n", 1) != 1:
            raise BadRequest("n must be 1 (one completion per request)")
        if data.get("stop"):
            raise BadRequest("stop sequences are not supported; generation stops at the model's end-of-text token")
        temperature = field(data, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "in [0, 2]")
        out = {"max_new_tokens": field(data, "max_tokens", int, 16, lambda v: v >= 1, "at least 1"),
               "top_p": field(data, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
               "seed": field(data, "seed", int, None),
               "do_sample": temperature > 0, "temperature": float(temperature) if temperature > 0 else 1.0}
        if field(data, "ignore_eos", bool, False):  # vLLM's extension: exactly max_tokens (benchmarks)
            out["stop_token_ids"] = []
        return out

    async def completions(self, request: Request) -> Response:
        self._need("/v1/completions", self.generates, self._served())
        data = await body(request)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string (one prompt per request)")
        return await self._generate(prompt, self._sampling(data), bool(data.get("stream")), chat=False)

    async def chat(self, request: Request) -> Response:
        self._need("/v1/chat/completions", self.generates, self._served())
        data = await body(request)
        prompt = self.model.chat_prompt(data.get("messages"))  # InputError: no template, malformed messages
        return await self._generate(prompt, self._sampling(data), bool(data.get("stream")), chat=True)

    async def _generate(self, prompt: str, sampling: dict[str, Any], stream: bool, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        info: dict[str, Any] = {}
        source = self.scheduler or self.model
        chunks = source.stream(prompt, chat=chat, info=info, **sampling)
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()

        def produce() -> None:
            try:
                for piece in chunks:
                    if cancelled.is_set():  # the client went away: stop generating
                        chunks.close()
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        self.metrics.queue_depth += 1
        loop.run_in_executor(self.workers, produce)
        # the first event decides the status: a request error (capacity, lengths) is a 4xx, never a broken stream
        kind, value = await queue.get()
        self.metrics.queue_depth -= 1
        if kind == "error":
            raise value
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not stream:
            parts = []
            while kind == "text":
                parts.append(value)
                kind, value = await queue.get()
            if kind == "error":
                raise value
            text = "".join(parts)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text, "logprobs": None})
            return JSONResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                 "created": created, "model": self.name,
                                 "choices": [choice | {"finish_reason": info["finish_reason"]}],
                                 "usage": usage(info)})

        def event(text: str | None, finish: str | None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                obj = "text_completion"
            return "data: " + json.dumps({"id": ident, "object": obj, "created": created, "model": self.name,
                                          "choices": [choice]}) + "\n\n"

        first = (kind, value)

        async def sse() -> AsyncIterator[str]:
            kind, value = first
            try:
                if chat:
                    yield "data: " + json.dumps({"id": ident, "object": "chat.completion.chunk", "created": created,
                                                 "model": self.name, "choices": [{"index": 0, "delta": {
                                                     "role": "assistant"}, "finish_reason": None}]}) + "\n\n"
                while kind == "text":
                    yield event(value, None)
                    kind, value = await queue.get()
                if kind == "error":  # mid-stream: the status is sent; the error goes in the stream
                    yield "data: " + json.dumps({"error": {"message": str(value), "type": "server_error"}}) + "\n\n"
                else:
                    yield event(None, info["finish_reason"])
                yield "data: [DONE]\n\n"
            finally:
                cancelled.set()

        return StreamingResponse(sse(), media_type="text/event-stream")


def usage(info: dict[str, Any]) -> dict[str, int]:
    p, c = int(info.get("prompt_tokens", 0)), int(info.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def create_app(artifact: Any, max_batch: int | None = None, max_wait_ms: float = 5.0, threads: int | None = None,
               queue: int = DEFAULT_QUEUE, decode: str = "batched", min_rows: int | None = None) -> Starlette:
    """An ASGI app serving ``artifact`` (a path, or an already loaded ``kiln.runtimes.Model``). A path is loaded with
    its canary run (``kiln.runtimes.load``): a server does not start on a machine where its artifact computes another
    answer. ``min_rows``: rows every decode step runs (default: the artifact's canary decides)."""
    # ONNX Runtime's own thread settings (its pool spins briefly between runs): measured with tools/load_serve.py,
    # spinning off cost the batching server 5-10% (395 vs 432 req/s) and the unbatched one as much
    model = artifact if isinstance(artifact, kr.Model) else kr.load(artifact, threads=threads)
    if not model.manifest.tokenizer:
        raise UsageError(f"{model.manifest.root} ships no tokenizer; kiln serve takes text, so compile the artifact "
                         "from a checkpoint with one")
    return Server(model, max_batch, max_wait_ms, queue, decode, min_rows).app()
