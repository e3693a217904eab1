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
import base64
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
from kiln.runtimes.tokenizer import TooLong
from kiln.serve.batching import EncoderBatcher
from kiln.serve.guard import Guard, Policy
from kiln.serve.metrics import Metrics

try:
    from starlette.applications import Starlette
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover - the serve extra is missing
    raise UsageError("kiln serve needs its extra: pip install 'kiln[serve]' (starlette, uvicorn, jinja2)") from e

from kiln.serve.requests import BadRequest, body, error, field  # noqa: E402 - after the extra check


log = logging.getLogger("kiln.serve")

DEFAULT_SLOTS = 8
"""Decoders: requests decoded together (KV-cache slots of continuous batching) when --max-batch is not given."""
DEFAULT_QUEUE = 64
"""Decoders: requests that may wait for a slot; past it, 429 with Retry-After."""
DECODE_MODES = ("batched", "threads")
"""Decoders: continuous batching, or each request generating on its own thread at batch 1 (kiln before it)."""


class Server:
    def __init__(self, model: kr.Model, max_batch: int | None = None, max_wait_ms: float = 5.0,
                 queue: int = DEFAULT_QUEUE, decode: str = "batched", min_rows: int | None = None,
                 policy: Policy | None = None) -> None:
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
        self.policy = policy or Policy()
        self.metrics = Metrics()
        self.admitted, self.admit_limit = 0, max_batch + queue
        """Generation requests between their admission and their last chunk: past ``admit_limit`` (every slot
        busy and the queue full), 429 before any work, in both decode modes."""
        self.name = str(m.get("architecture") or model.manifest.root.name)
        self.batcher = EncoderBatcher(model, max_batch, max_wait_ms, self.metrics) if self.kind == "encoder" else None
        data = model.manifest.data
        self.generates = self.kind == "decoder" and bool(data.get("kv_cache") or (data.get("generation") or {}).get(
            "recompute")) and m["task"] == "causal-lm" or self.kind == "seq2seq"
        if model.manifest.tokenizer:  # the byte bound of a prompt, read once here rather than on the event loop
            _ = model.text_encoder.longest_token_bytes
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
        async def unrouted(request: Request, exc: Exception) -> Response:  # 404 / 405 as JSON too
            status = getattr(exc, "status_code", 404)
            what = "is not an endpoint of this server" if status == 404 else f"does not take {request.method}"
            return error(f"{request.url.path[:80]} {what}; see GET /v1/models and docs/serving.md", status,
                         "not_found" if status == 404 else "method_not_allowed")

        app = Starlette(routes=routes, lifespan=self.lifespan, exception_handlers={404: unrouted, 405: unrouted})
        app.state.server = self
        app.add_middleware(Guard, policy=self.policy, count=self.metrics.request)
        if self.policy.cors_origins:  # outermost: a browser's preflight carries no key
            app.add_middleware(CORSMiddleware, allow_origins=list(self.policy.cors_origins),
                               allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
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
        async def route(request: Request) -> Any:
            t = time.perf_counter()
            self.metrics.in_flight += 1
            try:
                response = await self.answer(endpoint, handler, request)
            except BaseException:  # cancelled (the server stopping): still counted, never left in flight
                self.metrics.in_flight -= 1
                self.metrics.request(endpoint, 499, time.perf_counter() - t)
                raise

            def done() -> None:
                self.metrics.in_flight -= 1
                self.metrics.request(endpoint, response.status_code, time.perf_counter() - t)

            return Sent(response, done)

        return route

    async def answer(self, endpoint: str, handler: Callable[[Request], Any], request: Request) -> Response:
        """The handler's response, or its error as JSON: every failure is a response with a status."""
        try:
            return await handler(request)
        except TooLong as e:  # the library's message names truncate=True; an API client sends JSON
            return error(f"the input is {e.tokens} tokens, longer than the model's maximum {e.limit}; shorten it"
                         + (' or send "truncate": true' if endpoint == "embeddings" else ""), 400, "invalid_input")
        except (QueueFull, BadRequest) as e:  # QueueFull: every slot busy and the queue at its bound
            response = error(str(e), *((429, "queue_full") if isinstance(e, QueueFull) else (e.status, e.code)))
            if e.retry_after is not None:
                response.headers["Retry-After"] = str(math.ceil(e.retry_after))
            return response
        except ClosedError as e:
            return error(str(e), 503, "closed")
        except KilnError as e:  # InputError (lengths, capacity, sampling): the caller's to fix
            return error(str(e), 400 if isinstance(e, InputError) else 500,
                         "invalid_input" if isinstance(e, InputError) else "model_error")
        except Exception:  # a bug: logged with its traceback, answered as JSON, counted
            log.exception("kiln serve: %s failed", endpoint)
            return error("the server failed on this request (logged); report it with the request", 500,
                         "internal_error")

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
        data = await body(request, self.policy)
        texts = data.get("input")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("input must be a non-empty string or a non-empty list of non-empty strings")
        if len(texts) > 2048:
            raise BadRequest(f"input holds {len(texts)} texts; send at most 2048 per request")
        encoding = field(data, "encoding_format", str, "float", lambda v: v in ("float", "base64"),
                         "choose float or base64")
        truncate = field(data, "truncate", bool, False)
        if not truncate:
            for text in texts:
                self._fits(text, 'shorten it or send "truncate": true')
        loop = asyncio.get_running_loop()  # tokenizing runs off the event loop: /health never waits on it
        feeds = await loop.run_in_executor(None, lambda: self.model.encode(texts, truncate=truncate))
        vectors = await self.batcher.embed(feeds)
        tokens = int(feeds["attention_mask"].sum())

        def vector(v: Any) -> Any:  # base64: little-endian float32 bytes, as OpenAI's clients decode them
            return base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else \
                v.astype(float).tolist()

        return JSONResponse({"object": "list", "model": self.name,
                             "data": [{"object": "embedding", "index": i, "embedding": vector(v)}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _fits(self, text: str, fix: str = "shorten it") -> None:
        """Refuse a text whose byte count alone shows it is longer than the model takes, before tokenizing it."""
        encoder = self.model.text_encoder
        limit = self.model.max_sequence_length
        most = (limit + 8) * (encoder.longest_token_bytes + 1) * 4  # 4: normalizers that drop characters
        size = len(text.encode("utf-8"))
        if size > most:
            raise BadRequest(f"the input is {size} bytes, longer than the model's maximum of {limit} tokens can be "
                             f"(at most {most} bytes with this tokenizer); {fix}", 400, "invalid_input")

    # --- decoders ----------------------------------------------------------------------------
    def _sampling(self, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("n", 1) != 1:
            raise BadRequest("n must be 1 (one completion per request)")
        if data.get("stop"):
            raise BadRequest("stop sequences are not supported; generation stops at the model's end-of-text token")
        temperature = field(data, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "in [0, 2]")
        out = {"max_new_tokens": field(data, "max_tokens", int, 16, lambda v: 1 <= v <= 1 << 20, "in [1, 2**20]"),
               "top_p": field(data, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
               "seed": field(data, "seed", int, None, lambda v: 0 <= v < 1 << 63, "in [0, 2**63)"),
               "do_sample": temperature > 0, "temperature": float(temperature) if temperature > 0 else 1.0}
        if field(data, "ignore_eos", bool, False):  # vLLM's extension: exactly max_tokens (benchmarks)
            out["stop_token_ids"] = []
        return out

    async def completions(self, request: Request) -> Response:
        self._need("/v1/completions", self.generates, self._served())
        data = await body(request, self.policy)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string (one prompt per request)")
        self._fits(prompt)
        return await self._generate(request, prompt, self._sampling(data), field(data, "stream", bool, False),
                                    chat=False)

    async def chat(self, request: Request) -> Response:
        self._need("/v1/chat/completions", self.generates, self._served())
        data = await body(request, self.policy)
        sampling, stream = self._sampling(data), field(data, "stream", bool, False)
        messages = data.get("messages")
        if isinstance(messages, list):
            for m in messages:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    self._fits(m["content"])
        loop = asyncio.get_running_loop()  # InputError: no template, malformed messages
        prompt = await loop.run_in_executor(None, self.model.chat_prompt, messages)
        self._fits(prompt)
        return await self._generate(request, prompt, sampling, stream, chat=True)

    def _admit(self) -> None:
        """Count a generation request in, or refuse it with 429 before any work: every slot busy and the queue
        full, in either decode mode."""
        if self.admitted >= self.admit_limit:
            wait = self.scheduler.retry_after() if self.scheduler is not None else 1.0
            raise BadRequest(f"all {self.max_batch} decode slots are busy and {self.admit_limit - self.max_batch} "
                             "requests wait already; retry later", 429, "queue_full", retry_after=wait)
        self.admitted += 1

    async def _generate(self, request: Request, prompt: str, sampling: dict[str, Any], stream: bool,
                        chat: bool) -> Response:
        self._admit()
        cancelled = threading.Event()
        released = False

        def release() -> None:  # the request's admission ends with its last chunk, its error or its client
            nonlocal released
            cancelled.set()
            if not released:
                released = True
                self.admitted -= 1

        try:
            return await self._generation(request, prompt, sampling, stream, chat, cancelled, release)
        except BaseException:
            release()
            raise

    async def _generation(self, request: Request, prompt: str, sampling: dict[str, Any], stream: bool,
                          chat: bool, cancelled: threading.Event, release: Callable[[], None]) -> Response:
        loop = asyncio.get_running_loop()
        info: dict[str, Any] = {}
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def produce() -> None:
            if cancelled.is_set():  # the client went away while the request waited for a thread
                return
            try:  # tokenizing and queueing happen here, off the event loop
                if self.scheduler is not None:
                    chunks = self.scheduler.stream(prompt, chat=chat, info=info, cancel=cancelled, **sampling)
                else:
                    chunks = self.model.stream(prompt, chat=chat, info=info, **sampling)
                for piece in chunks:
                    if cancelled.is_set():  # the client went away: stop generating
                        chunks.close()
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        async def watch() -> None:  # a client that closes its socket cancels its generation at the next step
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    cancelled.set()
                    queue.put_nowait(("gone", None))
                    return

        self.metrics.queue_depth += 1
        loop.run_in_executor(self.workers, produce)
        watcher = asyncio.ensure_future(watch())
        try:
            # the first event decides the status: a request error (capacity, lengths) is a 4xx, never a broken stream
            kind, value = await queue.get()
        finally:
            self.metrics.queue_depth -= 1
        try:
            if kind == "error":
                raise value
            if kind == "gone":
                raise BadRequest("the client went away", 499, "client_disconnected")
            if not stream:
                return await self._whole(queue, (kind, value), info, chat, release)
        finally:
            if not stream or kind != "text":
                watcher.cancel()
        response = self._events(queue, (kind, value), info, chat, release, watcher)
        response.cancel = release  # type: ignore[attr-defined]  # Sent calls it when the response is done
        return response

    async def _whole(self, queue: asyncio.Queue[tuple[str, Any]], first: tuple[str, Any], info: dict[str, Any],
                     chat: bool, release: Callable[[], None]) -> Response:
        kind, value = first
        parts = []
        while kind == "text":
            parts.append(value)
            kind, value = await queue.get()
        release()
        if kind == "error":
            raise value
        if kind == "gone":
            raise BadRequest("the client went away", 499, "client_disconnected")
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text, "logprobs": None})
        return JSONResponse({"id": ident(chat), "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.name,
                             "choices": [choice | {"finish_reason": info["finish_reason"]}], "usage": usage(info)})

    def _events(self, queue: asyncio.Queue[tuple[str, Any]], first: tuple[str, Any], info: dict[str, Any],
                chat: bool, release: Callable[[], None], watcher: asyncio.Future[None]) -> StreamingResponse:
        name, created = ident(chat), int(time.time())

        def event(text: str | None, finish: str | None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                obj = "text_completion"
            return "data: " + json.dumps({"id": name, "object": obj, "created": created, "model": self.name,
                                          "choices": [choice]}) + "\n\n"

        async def sse() -> AsyncIterator[str]:
            kind, value = first
            try:
                if chat:
                    yield "data: " + json.dumps({"id": name, "object": "chat.completion.chunk", "created": created,
                                                 "model": self.name, "choices": [{"index": 0, "delta": {
                                                     "role": "assistant"}, "finish_reason": None}]}) + "\n\n"
                while kind == "text":
                    yield event(value, None)
                    kind, value = await queue.get()
                if kind == "gone":
                    return
                if kind == "error":  # mid-stream: the status is sent; the error goes in the stream
                    yield "data: " + json.dumps({"error": {"message": str(value), "type": "server_error"}}) + "\n\n"
                else:
                    yield event(None, info["finish_reason"])
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                release()

        return StreamingResponse(sse(), media_type="text/event-stream")


def ident(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


class Sent:
    """A response as an ASGI app that calls ``done`` once it is sent, or abandoned: a stream whose client went away
    before its first byte is still counted, and its generation cancelled (``cancel``, set by ``_generate``)."""

    def __init__(self, response: Response, done: Callable[[], None]) -> None:
        self.response, self.done = response, done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            cancel = getattr(self.response, "cancel", None)
            if cancel is not None:
                cancel()
            self.done()


def usage(info: dict[str, Any]) -> dict[str, int]:
    p, c = int(info.get("prompt_tokens", 0)), int(info.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def create_app(artifact: Any, max_batch: int | None = None, max_wait_ms: float = 5.0, threads: int | None = None,
               queue: int = DEFAULT_QUEUE, decode: str = "batched", min_rows: int | None = None,
               policy: Policy | None = None) -> Starlette:
    """An ASGI app serving ``artifact`` (a path, or an already loaded ``kiln.runtimes.Model``). A path is loaded with
    its canary run (``kiln.runtimes.load``): a server does not start on a machine where its artifact computes another
    answer. ``min_rows``: rows every decode step runs (default: the artifact's canary decides). ``policy``: keys,
    hosts, origins and limits (``kiln.serve.guard.Policy``; default: loopback, no key, the default limits)."""
    # ONNX Runtime's own thread settings (its pool spins briefly between runs): measured with tools/load_serve.py,
    # spinning off cost the batching server 5-10% (395 vs 432 req/s) and the unbatched one as much
    model = artifact if isinstance(artifact, kr.Model) else kr.load(artifact, threads=threads)
    if not model.manifest.tokenizer:
        raise UsageError(f"{model.manifest.root} ships no tokenizer; kiln serve takes text, so compile the artifact "
                         "from a checkpoint with one")
    return Server(model, max_batch, max_wait_ms, queue, decode, min_rows, policy).app()
