"""Continuous batching: generation requests join and leave between decode steps, and one decode step runs every
active request as one batch, each row at its own position in its own slot of the KV cache.

A batch-1 decode step reads every weight once for one token; the same step over 8 rows reads them once for 8 tokens.
The scheduler owns ``slots`` rows of one KV buffer per layer (``Runtime.slot_cache``). A request waits in a bounded
queue until a slot is free, is prefilled into its slot (with the requests that join in the same step, in
consecutive slots, right-padded: each row's attention stops at its own length and its rows of every matrix product
are those of the request alone, so its cache and first token are exactly those of the request served alone; FP32
bit for bit, tested), and then decodes with every other active request: one graph run over rows
``[0, highest busy slot]`` with a right-padded mask, from which the graph takes each row's own past length
(GroupQueryAttention's ``seqlens_k``: the index of the row's last 1) and its rotary position. A free slot below the
highest busy one runs as an idle row (position 0, nothing read back) until a new request takes it, and the row that
joined in the same step idles at the position its next token will overwrite; new requests take the lowest free slot.
At most one prefill runs between two decode steps (of at most ``generation.PREFILL_TOKENS`` rows x longest prompt, or one longer
prompt alone), so joining requests stall the others for at most one prefill.

Per request: its own sampling settings, seed (its own generator, drawn once per token, as when served alone), stop
tokens and max tokens; a cancelled request leaves at the next step and frees its slot. Torch-free: ``kiln serve``,
the Triton model and any Python program use it the same way.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.errors import ArtifactError, InputError, KilnError
from kiln.runtimes.generation import check_request, joins, row_policy, stream_text
from kiln.runtimes.sampling import GenerateOptions, Sampling, choose

_D = GenerateOptions()
_END = object()


class QueueFull(KilnError):
    """Every slot is busy and the waiting queue is at its bound: retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Request:
    """One generation request as the scheduler keeps it (tokens are the generated ones, the prompt apart)."""

    ident: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop: frozenset[int]
    rng: np.random.Generator
    submitted: float
    tokens: list[int] = field(default_factory=list)
    slot: int | None = None
    finish: str | None = None  # stop | length | cancelled | error
    last: float = 0.0  # time of the last token out (inter-token latency)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Stream:
    """A submitted request: iterate for its token ids as they come (blocking); ``cancel`` to stop it at the next
    step. After the iteration ends, ``finish_reason`` is stop, length or cancelled; a failure of the step that served
    it is raised from the iteration."""

    def __init__(self, request: Request, timeout: float | None = None) -> None:
        self._r = request
        self.timeout = timeout
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self._r.prompt)

    @property
    def slot(self) -> int | None:
        """The KV-cache row the request ran in (None while it waits)."""
        return self._r.slot

    def __iter__(self) -> Iterator[int]:
        while self.finish_reason is None:
            try:
                item = self._r.out.get(timeout=self.timeout)
            except queue.Empty:
                raise TimeoutError(f"no token within {self.timeout} s") from None
            if isinstance(item, BaseException):
                self.finish_reason = "error"
                raise item
            if item is _END:
                self.finish_reason = self._r.finish or "stop"
                return
            self.tokens.append(item)
            yield item

    def result(self) -> list[int]:
        """Every generated token (blocks until the request ends)."""
        for _ in self:
            pass
        return self.tokens

    def cancel(self) -> None:
        self._r.cancelled.set()


class Stats:
    """What the scheduler saw, for ``/metrics`` and ``kiln bench``: decode batch size per step, requests per prefill,
    time to first token and inter-token latency (seconds), queue depth. ``observe`` hooks (name, value) are called
    from the loop."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.prefill_s = 0.0  # graph time of prefills and of decode steps, for tokens/s of each
        self.decode_s = 0.0
        self.decoded = 0  # tokens produced by decode steps (each request's first comes from its prefill)
        self.batch_sizes: list[int] = []
        self.prefill_rows: list[int] = []  # requests prefilled together, per prefill
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.queue_depth = 0
        self.active = 0
        self.hooks: list[Callable[[str, float], None]] = []

    def observe(self, name: str, value: float, keep: list | None = None) -> None:
        if keep is not None and len(keep) < 100_000:
            keep.append(value)
        for hook in self.hooks:
            hook(name, value)


class Scheduler:
    """Continuous batching over a loaded decoder ``Model`` (ONNX Runtime, a shared-buffer KV cache with per-row
    lengths). ``slots``: requests decoded together; ``queue_limit``: requests that may wait for a slot (past it,
    ``submit`` raises ``QueueFull``); ``positions``: KV positions per slot (prompt + new tokens of one request; default
    the artifact's capacity); ``min_rows``: rows every decode step runs (default 1; 2 for an INT8/INT4 artifact whose
    canary did not show here that one row decodes alone as it does beside others).

    Why ``min_rows``: ONNX Runtime's MatMulNBits (accuracy level 4, int8 activations) computes one row (M = 1) with
    another kernel than several rows. On an AVX2 machine with an older ONNX Runtime the two disagreed (SmolLM2-135M
    INT4, one decode step: up to 6.8 in the logits; ONNX Runtime issue 29853: the AVX2 M = 1 path with zero points);
    ONNX Runtime 1.32 agrees with a numpy reference at M = 1, 2 and 8 for every format kiln emits, on AVX-512 VNNI and
    on AVX2 (tools/kernel_conformance.py, docs/verification.md). The canary's ``rows`` entry checks it wherever the
    artifact is loaded (``Model.canary.rows_agree``); where it fails, or was not run, a quantized artifact decodes every
    step with at least two rows (an idle one when a request is alone), so each request's tokens stay independent of
    what else runs. A prefill is always M > 1."""

    def __init__(self, model: Any, slots: int = 8, queue_limit: int = 64, positions: int | None = None,
                 min_rows: int | None = None) -> None:
        data = model.manifest.data
        kv = data.get("kv_cache")
        if not kv or data["model"]["task"] != "causal-lm" or "decoder" in model.runtimes:
            raise ArtifactError(f"{model.manifest.root}: continuous batching serves decoder-only causal-lm artifacts "
                                "with a KV cache; encoder-decoders generate one request at a time (Model.generate)")
        if not kv.get("row_lengths"):
            raise ArtifactError(f"{model.manifest.root}: this artifact's graph gives every row the same past length "
                                f"({kv.get('row_lengths_refused') or 'compiled by an older kiln'}); recompile it with "
                                "this kiln for continuous batching, or serve it one request at a time")
        if slots < 1 or queue_limit < 0:
            raise InputError(f"slots {slots} must be >= 1 and queue_limit {queue_limit} >= 0")
        self.model, self.kv = model, kv
        self.slots, self.queue_limit = slots, queue_limit
        floor, self.join_mixed = row_policy(data, getattr(model, "canary", None))  # join_mixed: see _join
        self.min_rows = min(slots, min_rows if min_rows is not None else floor)
        self.positions = min(int(positions or kv["capacity"]), int(kv["capacity"]))
        self.max_model = int(data["model"]["max_sequence_length"])
        gen = data.get("generation") or {}
        self.eos = [int(t) for t in gen.get("eos_token_ids", [])]
        self.cache = model.runtime.slot_cache(kv, slots, self.positions)
        self.stats = Stats()
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[Request | None] = [None] * slots
        self._lock = threading.Condition()
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kiln-scheduler", daemon=True)
        self._thread.start()

    # ---- requests -------------------------------------------------------------------------------------------------
    def submit(self, input_ids: Sequence[int], max_new_tokens: int = _D.max_new_tokens, do_sample: bool = _D.do_sample,
               temperature: float = _D.temperature, top_k: int = _D.top_k, top_p: float = _D.top_p,
               repetition_penalty: float = _D.repetition_penalty, stop_token_ids: Sequence[int] | None = None,
               seed: int | None = None, cancel: threading.Event | None = None) -> Stream:
        """Queue one request (a list of prompt token ids); returns its ``Stream`` at once. Raises ``InputError`` for a
        request that can never run and ``QueueFull`` when the waiting queue is at its bound. ``cancel``: an event
        another thread sets to end the request at the next step, waiting or decoding (``Stream.cancel`` sets it)."""
        prompt = [int(t) for t in np.asarray(input_ids).reshape(-1)]
        sampling = Sampling(do_sample, temperature, top_k, top_p, repetition_penalty)
        check_request(self.kv, len(prompt), max_new_tokens, sampling, self.max_model)
        if not prompt:
            raise InputError("the prompt is empty; give at least one token")
        vocab = self.model.vocab_size
        if vocab is not None and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InputError(f"the prompt holds a token id outside the vocabulary [0, {vocab}); tokenize with the "
                             "artifact's tokenizer")
        if len(prompt) + max_new_tokens > self.positions:
            raise InputError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) needs more KV positions than "
                             f"a slot holds ({self.positions}); ask for fewer tokens or start the scheduler with "
                             "more positions")
        stop = frozenset(self.eos if stop_token_ids is None else (int(t) for t in stop_token_ids))
        with self._lock:
            if self._closed:
                raise InputError("the scheduler is closed; start a new one")
            if len(self._waiting) >= self.queue_limit + self._rows.count(None):  # free slots take from the queue
                raise QueueFull(f"{len(self._waiting)} requests already wait for one of {self.slots} slots (the "
                                "queue's bound); retry later", self.retry_after())
            request = Request(next(self._ids), prompt, max_new_tokens, sampling, stop, np.random.default_rng(seed),
                              time.perf_counter(), cancelled=cancel or threading.Event())
            self._waiting.append(request)
            self.stats.queue_depth = len(self._waiting)
            self._lock.notify()
        return Stream(request)

    def generate(self, input_ids: Sequence[int], **options: Any) -> list[int]:
        """Prompt + generated token ids of one request (blocks until it ends)."""
        return list(input_ids) + self.submit(input_ids, **options).result()

    def stream(self, prompt: str, chat: bool = False, info: dict[str, Any] | None = None,
               cancel: threading.Event | None = None, **options: Any) -> Iterator[str]:
        """``Model.stream`` through the scheduler: the request is tokenized and queued now (``InputError`` and
        ``QueueFull`` raise here); the iterator yields text pieces as they are produced (partial characters held
        back) and fills ``info`` with prompt_tokens, completion_tokens and finish_reason. Closing the iterator early
        (a client gone) cancels the request."""
        feeds = self.model.encode([prompt], add_special_tokens=False if chat else None)
        ids = [int(t) for t in feeds["input_ids"][0]]
        handle = self.submit(ids, cancel=cancel, **options)
        info = {} if info is None else info
        info.update(prompt_tokens=len(ids), completion_tokens=0, finish_reason="length")
        return self._pieces(handle, info)

    def _pieces(self, handle: Stream, info: dict[str, Any]) -> Iterator[str]:
        stop = handle._r.stop
        emitted, text, kept = 0, "", []
        try:
            for token in handle:
                info["completion_tokens"] += 1
                if token in stop:
                    info["finish_reason"] = "stop"
                    continue
                kept.append(token)
                text, ready = stream_text(self.model.text_encoder.decode, kept)
                if ready > emitted:
                    yield text[emitted:ready]
                    emitted = ready
            if emitted < len(text):
                yield text[emitted:]
        finally:
            handle.cancel()  # a no-op for a finished request; frees the slot of one abandoned mid-stream

    def retry_after(self) -> float:
        """Seconds until a slot is likely free: the mean time a request has held a slot, at least one second."""
        busy = [r for r in self._rows if r is not None]
        left = min((r.max_new_tokens - len(r.tokens) for r in busy), default=1)
        per_token = float(np.mean(self.stats.itl[-256:])) if self.stats.itl else 0.05
        return max(1.0, round(left * per_token * (1 + len(self._waiting) / self.slots), 1))

    def close(self) -> None:
        """Stop the loop; requests still waiting or running end with finish_reason cancelled."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()
        self.cache.close()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop -------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._waiting and all(r is None for r in self._rows):
                    self._lock.wait()
                if self._closed:
                    for r in [*self._waiting, *(r for r in self._rows if r is not None)]:
                        self._end(r, "cancelled")
                    self._waiting.clear()
                    self._rows = [None] * self.slots
                    return
                joining = self._join()
            try:
                self._step(joining)
            except Exception as e:  # noqa: BLE001 - the step's requests end with the error; the loop goes on
                with self._lock:
                    for i, r in enumerate(self._rows):
                        if r is not None:
                            r.out.put(e if isinstance(e, KilnError) else ArtifactError(f"generation failed: {e}"))
                            r.finish = "error"
                            self._rows[i] = None

    def _join(self) -> list[Request]:
        """Waiting requests that join in this step (under the lock): the next ones in arrival order, into consecutive
        free slots from the lowest, so one batched prefill writes them all, as far as ``generation.joins`` allows: at
        most ``PREFILL_TOKENS`` rows x longest prompt (a longer prompt joins alone); a one-token prompt alone (its
        prefill alone is one row, M = 1, which quantized MatMulNBits computes with another kernel: see ``min_rows``);
        quantized artifacts join prompts of one length only: their padding rows and the extra logits rows cost as
        much as real ones in MatMulNBits (SmolLM2-135M INT4, 8 prompts of 6-10 tokens: 214 ms joined vs 186 ms one by
        one; 8 of 8 tokens: 161 vs 216 ms; FP32 154 vs 241 and 106 vs 246 ms)."""
        joining: list[Request] = []
        while self._waiting and None in self._rows:
            candidate = self._waiting[0]
            if candidate.cancelled.is_set():
                self._end(self._waiting.popleft(), "cancelled")
                continue
            if joining:
                slot = joining[-1].slot + 1
                if (slot >= self.slots or self._rows[slot] is not None
                        or not joins([len(r.prompt) for r in joining], len(candidate.prompt), self.join_mixed)):
                    break
            else:
                slot = self._rows.index(None)
            candidate.slot = slot
            self._rows[slot] = self._waiting.popleft()
            joining.append(candidate)
        self.stats.queue_depth = len(self._waiting)
        return joining

    def _step(self, joining: list[Request]) -> None:
        """One prefill (the joining requests, alone in their consecutive slots) and one decode step over every other
        active row."""
        rows = self._rows
        for i, r in enumerate(rows):  # cancelled requests leave before the step
            if r is not None and r.cancelled.is_set():
                self._release(i, "cancelled")
        if joining:  # a request cancelled since it joined is still prefilled (its slot is free again), not emitted
            t = time.perf_counter()
            logits = self.cache.prefill(joining[0].slot, [np.asarray(r.prompt, np.int64) for r in joining])
            self.stats.prefill_s += time.perf_counter() - t
            self.stats.observe("prefill_rows", len(joining), self.stats.prefill_rows)
            for r, row in zip(joining, logits):
                if rows[r.slot] is r:
                    self._emit(r.slot, row)
        joined = {id(r) for r in joining}
        active = [i for i, r in enumerate(rows) if r is not None and id(r) not in joined]
        if not active:
            return
        high = max(active[-1] + 1, self.min_rows)
        tokens = np.zeros(high, np.int64)
        lengths = np.zeros(high, np.int64)  # a free row: token 0 written at position 0, never read back
        for i, r in enumerate(rows[:high]):
            if r is not None:  # positions in the row's cache, where its new token goes; the row that just joined
                lengths[i] = len(r.prompt) + len(r.tokens) - 1  # idles there: its next step overwrites the entry
                tokens[i] = r.tokens[-1] if i in active else 0
        t = time.perf_counter()
        logits = self.cache.decode(tokens, lengths)
        self.stats.decode_s += time.perf_counter() - t
        self.stats.decoded += len(active)
        self.stats.steps += 1
        self.stats.observe("batch_size", len(active), self.stats.batch_sizes)
        for i in active:
            self._emit(i, logits[i])

    def _emit(self, slot: int, logits: np.ndarray) -> None:
        """Choose the row's next token as ``generation.decode`` does for a request alone; end it on a stop token or
        its max tokens."""
        r = self._rows[slot]
        assert r is not None
        seen = np.asarray([r.prompt + r.tokens], np.int64)
        token = int(choose(logits[None].astype(np.float32, copy=False), seen, r.sampling, r.rng)[0])
        now = time.perf_counter()
        if r.tokens:
            self.stats.observe("itl", now - r.last, self.stats.itl)
        else:
            self.stats.observe("ttft", now - r.submitted, self.stats.ttft)
        r.last = now
        r.tokens.append(token)
        r.out.put(token)
        self.stats.tokens += 1
        if token in r.stop:
            self._release(slot, "stop")
        elif len(r.tokens) >= r.max_new_tokens:
            self._release(slot, "length")

    def _release(self, slot: int, reason: str) -> None:
        r = self._rows[slot]
        with self._lock:
            self._rows[slot] = None
        if r is not None:
            self._end(r, reason)

    @staticmethod
    def _end(r: Request, reason: str) -> None:
        r.finish = reason
        r.out.put(_END)
