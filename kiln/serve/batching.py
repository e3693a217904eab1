"""Dynamic batching for encoders behind ``kiln serve``: queued requests run together, regrouped by length."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import kiln.runtimes as kr
from kiln.serve.metrics import Metrics

class EncoderBatcher:
    """Dynamic batching: queued requests, and those arriving within ``max_wait_ms`` while there is room, run
    together (regrouped by length)."""

    def __init__(self, model: kr.Model, max_batch: int, max_wait_ms: float, metrics: Metrics) -> None:
        self.model, self.max_batch, self.max_wait = model, max_batch, max_wait_ms / 1000
        self.metrics = metrics
        self.queue: asyncio.Queue[tuple[dict[str, np.ndarray], asyncio.Future]] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kiln-batch")
        self.task: asyncio.Task | None = None
        enc = model.text_encoder
        self.pad_id, self.left = enc.pad_id, enc.padding_side == "left"
        self.output = "sentence_embedding" if "sentence_embedding" in model.output_names else "last_hidden_state"

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def embed(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((feeds, fut))
        self.metrics.queue_depth = self.queue.qsize()
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            rows = self._drain(items, len(items[0][0]["input_ids"]))
            deadline = loop.time() + self.max_wait
            while rows < self.max_batch and loop.time() < deadline:  # room left: wait for company, a slice at a time
                await asyncio.sleep(min(WAIT_SLICE, deadline - loop.time()))
                rows = self._drain(items, rows)
            self.metrics.queue_depth = self.queue.qsize()
            self.metrics.batched(rows)
            try:
                out = await loop.run_in_executor(self.executor, self._run, [f for f, _ in items])
            except Exception as e:  # noqa: BLE001 - every waiter gets the failure
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            start = 0
            for feeds, fut in items:
                n = len(feeds["input_ids"])
                if not fut.done():
                    fut.set_result(out[start:start + n])
                start += n

    def _drain(self, items: list, rows: int) -> int:
        """Move queued requests into ``items`` while the batch has room; returns its row count."""
        while rows < self.max_batch and not self.queue.empty():
            item = self.queue.get_nowait()
            items.append(item)
            rows += len(item[0]["input_ids"])
        return rows

    def _run(self, parts: list[dict[str, np.ndarray]]) -> np.ndarray:
        """Every request's rows, regrouped by length so padding stays small (a batch padded to its longest text
        wastes what batching gains on CPU: all-MiniLM-L6-v2, 32 texts padded to 54 tokens ran at 3.8 ms a text,
        one at a time 2.9 ms; 32 rows of 16 tokens 16.6k tokens/s against 6.1k for one row), each group one model
        run; the pooled embedding per row, in request order."""
        rows = []  # (length, request-local arrays of one row, unpadded)
        for p in parts:
            lengths = p["attention_mask"].sum(1)
            for r, n in enumerate(lengths):
                span = slice(p["input_ids"].shape[1] - n, None) if self.left else slice(0, n)
                rows.append((int(n), {k: v[r, span] for k, v in p.items()}))
        order = sorted(range(len(rows)), key=lambda i: rows[i][0])
        out: list[np.ndarray | None] = [None] * len(rows)
        for group in length_groups([rows[i][0] for i in order], self.max_batch):
            members = [order[i] for i in group]
            width = max(rows[i][0] for i in members)
            merged = {}
            for name in rows[0][1]:
                fill = self.pad_id if name == "input_ids" else 0
                block = np.full((len(members), width), fill, np.int64)
                for j, i in enumerate(members):
                    n = rows[i][0]
                    if self.left:
                        block[j, width - n:] = rows[i][1][name]
                    else:
                        block[j, :n] = rows[i][1][name]
                merged[name] = block
            vec = self.model.run(merged)[self.output]
            if vec.ndim == 3:  # mean over real tokens
                mask = merged["attention_mask"][..., None].astype(np.float32)
                vec = (vec * mask).sum(1) / np.maximum(mask.sum(1), 1)
            for j, i in enumerate(members):
                out[i] = vec[j]
        return np.stack(out)


WAIT_SLICE = 0.001
"""Seconds between looks at the queue while a batch with room waits (``max_wait_ms``) for more requests."""
PAD_SLACK = 1.25
"""A length group's padded tokens are at most this many times its real tokens."""


def length_groups(lengths: list[int], max_rows: int) -> list[list[int]]:
    """Cut ascending ``lengths`` into runs of at most ``max_rows`` whose padding to their longest stays within
    ``PAD_SLACK`` of their real tokens; returns index lists."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i, n in enumerate(lengths):
        if current and (len(current) >= max_rows or (len(current) + 1) * n > PAD_SLACK * (real + n)):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        groups.append(current)
    return groups
