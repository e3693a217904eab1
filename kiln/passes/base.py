"""The pass contract and the runner that applies a list of passes and records their stats."""

from __future__ import annotations

import abc
import contextvars
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from kiln.errors import KilnError
from kiln.passes import weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reason:
    """Why a candidate was not rewritten: where (a node or layer name) and why."""

    where: str
    why: str


class NoMatch(Exception):
    """The one way a pass refuses a candidate: raised by a matcher or a check with the reason, caught by
    the pass and reported as a ``Reason``. Any other exception is a bug and fails the compile."""


@dataclass
class PassResult:
    model: onnx.ModelProto
    modified: bool
    stats: dict[str, int] = field(default_factory=dict)
    skipped: list[Reason] = field(default_factory=list)


_PROGRESS: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("kiln_pass_progress",
                                                                                        default=None)


class Progress:
    """Progress of a long pass over ``total`` items: a line every ``every`` seconds with elapsed time and an
    estimate of what is left, to the runner's progress callback (nothing when there is none)."""

    def __init__(self, what: str, total: int, every: float = 10.0) -> None:
        self.what, self.total, self.every = what, total, every
        self.start = self.last = time.perf_counter()

    def step(self, done: int) -> None:
        say = _PROGRESS.get()
        now = time.perf_counter()
        if say is None or (now - self.last < self.every and done < self.total) or not done:
            return
        self.last = now
        elapsed = now - self.start
        say(f"  {self.what} {done}/{self.total}: {elapsed:.0f} s elapsed, ~{elapsed / done * (self.total - done):.0f} s left")


class PassError(KilnError):
    """A pass raised, or left a graph that does not check; names the pass and those before it."""


class Pass(abc.ABC):
    """One graph rewrite. ``name`` is what ``--disable-pass`` and the manifest use."""

    name: str = ""

    @abc.abstractmethod
    def run(self, model: onnx.ModelProto) -> PassResult: ...


def _check(model: onnx.ModelProto) -> None:
    store = weights.current()
    if store is not None:  # external weights resolve against the file's directory: check from a file beside them
        path = store.base_dir / "kiln-check.onnx"
        onnx.save_model(model, str(path))
        try:
            onnx.checker.check_model(str(path))
        finally:
            path.unlink(missing_ok=True)
    # Graphs over 2 GB can only be checked from a path; the exporter already checked those.
    elif model.ByteSize() < (2 << 30) - (1 << 20):
        onnx.checker.check_model(model)


def structure(model: onnx.ModelProto) -> bytes:
    """A digest of what the checker reads, without the weights' bytes: the nodes, the graph's inputs and outputs, and
    each initializer's name, type, shape and size. Milliseconds where the checker takes seconds on a 135M model."""
    h = hashlib.sha256()
    g = model.graph
    for part in (*g.node, *g.input, *g.output, *model.opset_import):
        h.update(part.SerializeToString())
    for t in g.initializer:
        h.update(f"{t.name}|{t.data_type}|{list(t.dims)}|{len(t.raw_data)}|{t.data_location}".encode())
    return h.digest()


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def check_disabled(passes: Sequence[Pass], disabled: Sequence[str]) -> None:
    """A misspelt ``--disable-pass`` must fail loudly, not silently disable nothing."""
    known = {p.name for p in passes}
    unknown = sorted(set(disabled) - known)
    if unknown:
        raise PassError(
            f"--disable-pass {', '.join(unknown)}: no such pass in this pipeline; "
            f"passes: {', '.join(sorted(known)) or '(none)'}"
        )


def run_passes(model: onnx.ModelProto, passes: Sequence[Pass], disabled: Sequence[str] = (),
               progress: Callable[[str], None] | None = None) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """Apply ``passes`` in order, skipping those named in ``disabled``; return the model and the record.

    The caller's model is left untouched (passes edit in place, so they get a copy): a test can
    compare the input with the output, and a caller can fall back to the input."""
    check_disabled(passes, disabled)
    model = copy_model(model)
    record: list[dict[str, Any]] = []
    done: list[str] = []
    for p in passes:
        if p.name in disabled:
            record.append({"name": p.name, "disabled": True, "stats": {}})
            continue
        if progress:
            progress(f"pass {p.name}")
        token = _PROGRESS.set(progress)
        try:
            before = structure(model)
            result = p.run(model)
            # the checker reads the graph, not the weights: a pass that left the graph as it was (most passes, on
            # most models: nothing of theirs to rewrite) is not checked again; one that changed it always is
            if result.modified or structure(result.model) != before:
                _check(result.model)
        except KilnError:
            raise
        except Exception as e:
            after = f" after {', '.join(done)}" if done else ""
            detail = " ".join(str(e).split())  # checker messages span lines; errors are one line
            raise PassError(f"pass {p.name} failed{after}: {detail}; disable it with --disable-pass {p.name}") from e
        finally:
            _PROGRESS.reset(token)
        model = result.model
        done.append(p.name)
        entry: dict[str, Any] = {"name": p.name, "modified": result.modified, "stats": dict(result.stats)}
        if result.skipped:
            entry["skipped"] = [{"where": r.where, "why": r.why} for r in result.skipped]
        record.append(entry)
        log.info("pass %s: %s", p.name, result.stats)
    return model, record
