"""Two ways a forward stops ``torch.export`` that kiln can trace soundly, retried after the export first fails:

- **A decision on tensor data.** ``if mask.any().item():`` branches in Python on a value the tracer does not have
  ("Could not guard on data-dependent expression"); Longformer decides so whether any token has global attention.
  The forward is run eagerly on the example inputs, recording each such boolean (``Decisions``); the export then
  replays them, and the graph gains one boolean output per decision: the condition computed from the inputs it is
  run on. The runtime compares each with the value the graph was traced for and refuses a run where one differs
  (``kiln.runtimes.base.check_assumptions``), so an input that would take the other branch is an error naming it,
  never a wrong answer.
- **A length the forward needs in whole blocks.** A model that pads its input to a multiple of a block (Longformer's
  attention window) computes shapes the exporter cannot prove for every length, and it fixes the length
  ("Constraints violated ... specialized"). The guards name the block (``% 16``); the length is then traced as
  blocks of it (``16 * sequence_blocks``), and the artifact's runtime pads a request to whole blocks itself
  (masked, as the model would) and cuts the outputs back (``kiln.runtimes.model``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kiln.errors import UnsupportedModelError

OUTPUT = "kiln_assumption_{}"
"""The graph output holding decision ``i``'s condition."""
MAX_DECISIONS = 64
"""More than this many decisions in one graph are refused (the manifest's schema bounds the list)."""


@dataclass(frozen=True)
class Decision:
    value: bool
    where: str
    """The line of the model's code that decided (file:line in function)."""


def _where() -> str:
    """The innermost frame outside torch and kiln: the model's line that asked for the value."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and "/kiln/" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"[:200]
    return "the model's forward"


def _is_decision(func: Any, args: tuple) -> bool:
    return (func in (torch.Tensor.item, torch.Tensor.__bool__) and isinstance(args[0], torch.Tensor)
            and args[0].dtype == torch.bool and args[0].numel() == 1)


class Decisions(TorchFunctionMode):
    """Records (``recorded`` None: eager) or replays the boolean a forward reads off a one-element tensor. A replayed
    decision takes the next value recorded at the same line of the model: transformers skips some checks while
    tracing (``is_tracing``), so the eager run may decide more often than the trace."""

    def __init__(self, recorded: list[Decision] | None = None) -> None:
        super().__init__()
        self.recorded = recorded
        self.seen: list[Decision] = []
        self.conditions: list[torch.Tensor] = []
        self.queues: dict[str, list[Decision]] = {}
        for d in recorded or ():
            self.queues.setdefault(d.where, []).append(d)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _is_decision(func, args):
            return func(*args, **kwargs)
        where = _where()
        if self.recorded is None:
            value = bool(func(*args, **kwargs))
            self.seen.append(Decision(value, where))
            return value
        queue = self.queues.get(where)
        if not queue:
            raise UnsupportedModelError(f"{where} decides on tensor data when traced but not when run: the branch "
                                        "cannot be replayed")
        self.seen.append(queue.pop(0))
        self.conditions.append(args[0].reshape(()))
        return self.seen[-1].value


def record(module: torch.nn.Module, args: tuple) -> list[Decision]:
    """The decisions ``module(*args)`` takes on tensor data, run eagerly."""
    mode = Decisions()
    with torch.no_grad(), mode:
        module(*args)
    return mode.seen


@contextlib.contextmanager
def replaying(module: torch.nn.Module, recorded: list[Decision]) -> Iterator[list[Decision]]:
    """Inside: ``module``'s forward takes the recorded branches and returns each decision's condition after its
    own outputs (the forward's signature, which the exporter reads, is unchanged). Yields the decisions the trace
    took, in the order of those outputs (filled once the forward has been traced)."""
    own = module.forward
    taken: list[Decision] = []

    @functools.wraps(own)
    def forward(*args: Any, **kwargs: Any) -> Any:
        mode = Decisions(recorded)
        with mode:
            out = own(*args, **kwargs)
        taken[:] = mode.seen
        return (*(out if isinstance(out, tuple) else (out,)), *mode.conditions)

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        del module.forward


def data_dependent(e: BaseException) -> bool:
    """The export stopped on a Python decision about tensor data."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "GuardOnDataDependentSymNode" or "data-dependent expression" in str(e):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def block(e: BaseException, dim: Any) -> int | None:
    """The block ``dim`` must come in when the export fixed it (a constraint violation) and its guards reduce it
    modulo whole numbers (``% 16``, ``Mod(s0, 16)``): their least common multiple, if it is below ``dim``'s
    maximum; else None."""
    text = str(e)
    name = getattr(dim, "__name__", None)
    if not name or "Constraints violated" not in text or name not in text:
        return None
    moduli = {int(m) for m in re.findall(r"%\s*(\d+)\b", text) + re.findall(r"Mod\([^()]*?,\s*(\d+)\)", text)}
    moduli = {m for m in moduli if m > 1}
    if not moduli:
        return None
    size = math.lcm(*moduli)
    top = getattr(dim, "max", None)
    return size if isinstance(top, int) and 2 * size <= top else None


def in_blocks(dynamic_shapes: Any, args: tuple, dim: Any, size: int) -> tuple[Any, tuple]:
    """``dynamic_shapes`` (by argument: an axes dict, or a tuple of them for a variadic argument) with ``dim``
    replaced by ``size * <dim>_blocks``, and ``args`` repeated along those axes to two blocks (one block would be
    traced as the size-one special case)."""
    blocks = torch.export.Dim(f"{dim.__name__}_blocks", min=1, max=dim.max // size)

    def swap(axes: Any) -> Any:
        return {a: size * blocks if d is dim else d for a, d in axes.items()} if isinstance(axes, dict) else axes

    specs = list(dynamic_shapes.values()) if isinstance(dynamic_shapes, dict) else list(dynamic_shapes)
    swapped = [type(s)(swap(x) for x in s) if isinstance(s, (tuple, list)) else swap(s) for s in specs]
    shapes = dict(zip(dynamic_shapes, swapped)) if isinstance(dynamic_shapes, dict) else type(dynamic_shapes)(swapped)
    per_arg = [x for s in specs for x in (s if isinstance(s, (tuple, list)) else (s,))]
    new = list(args)
    for i, axes in enumerate(per_arg[:len(new)]):
        for axis, d in axes.items() if isinstance(axes, dict) else ():
            if d is dim:
                t = new[i]
                reps = [-(-2 * size // t.shape[axis]) if a == axis else 1 for a in range(t.dim())]
                new[i] = t.repeat(*reps).narrow(axis, 0, 2 * size)
    return shapes, tuple(new)
