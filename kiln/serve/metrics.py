"""Prometheus text exposition (format 0.0.4) for the server: request counts, latency and batch-size
histograms, queue depth. Kept here (a few counters) rather than a client library dependency."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{upper:g}"}} {n}' for upper, n in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.total}')
        wrap = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{wrap} {self.sum:.6f}", f"{name}_count{wrap} {self.total}"]


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = {}
        self.batch = Histogram(BATCH_BUCKETS)
        self.queue_depth = 0
        self.in_flight = 0
        # continuous batching (decoders): rows per decode step and per prefill, time to first token, inter-token
        # latency
        self.generation = {"batch_size": Histogram(BATCH_BUCKETS), "prefill_rows": Histogram(BATCH_BUCKETS),
                           "ttft": Histogram(LATENCY_BUCKETS), "itl": Histogram(TOKEN_BUCKETS)}
        self.generation_queue: Callable[[], int] | None = None

    def generated(self, name: str, value: float) -> None:
        """A scheduler observation (``kiln.runtimes.scheduler.Stats`` hook): batch_size, prefill_rows, ttft or itl."""
        with self.lock:
            self.generation[name].observe(value)

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1
            self.latency.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batched(self, size: int) -> None:
        with self.lock:
            self.batch.observe(size)

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP kiln_requests_total HTTP requests by endpoint and status.",
                     "# TYPE kiln_requests_total counter"]
            lines += [f'kiln_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            lines += ["# HELP kiln_request_seconds Request latency (streams: until the last chunk).",
                      "# TYPE kiln_request_seconds histogram"]
            for endpoint, h in sorted(self.latency.items()):
                lines += h.lines("kiln_request_seconds", f'endpoint="{endpoint}"')
            lines += ["# HELP kiln_batch_size Texts per model run (encoders: dynamic batching).",
                      "# TYPE kiln_batch_size histogram", *self.batch.lines("kiln_batch_size"),
                      "# HELP kiln_queue_depth Requests waiting for the model.", "# TYPE kiln_queue_depth gauge",
                      f"kiln_queue_depth {self.queue_depth}",
                      "# HELP kiln_in_flight Requests being served.", "# TYPE kiln_in_flight gauge",
                      f"kiln_in_flight {self.in_flight}"]
            if self.generation_queue is not None:
                g = self.generation
                lines += ["# HELP kiln_decode_batch_size Requests decoded together per decode step (continuous "
                          "batching).", "# TYPE kiln_decode_batch_size histogram",
                          *g["batch_size"].lines("kiln_decode_batch_size"),
                          "# HELP kiln_prefill_batch_size Requests prefilled together (joining in the same step).",
                          "# TYPE kiln_prefill_batch_size histogram",
                          *g["prefill_rows"].lines("kiln_prefill_batch_size"),
                          "# HELP kiln_time_to_first_token_seconds From a request's arrival to its first token.",
                          "# TYPE kiln_time_to_first_token_seconds histogram",
                          *g["ttft"].lines("kiln_time_to_first_token_seconds"),
                          "# HELP kiln_inter_token_latency_seconds Between two tokens of one request.",
                          "# TYPE kiln_inter_token_latency_seconds histogram",
                          *g["itl"].lines("kiln_inter_token_latency_seconds"),
                          "# HELP kiln_generation_queue_depth Requests waiting for a decode slot.",
                          "# TYPE kiln_generation_queue_depth gauge",
                          f"kiln_generation_queue_depth {self.generation_queue()}"]
        return "\n".join(lines) + "\n"
