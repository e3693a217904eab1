"""Routed experts that loop over their own tokens, run densely while the model is exported.

Families whose experts module predates transformers' experts registry (``kiln.compiler.experts`` handles those)
write the routing as a gather-scatter loop: the experts the batch hit (``mask.sum(...).nonzero()``), for each one
the (slot, token) pairs routed to it (``torch.where(mask[e])``), the expert on those tokens' rows, and the result
added back at those tokens (``out.index_add_(0, tokens, rows * weights)``). The number of pairs is data, so
``torch.export`` stops at the loop ("Could not guard on data-dependent expression").

``DenseLoops`` is a torch function mode that runs the same code on every pair instead of the routed ones, with the
routing folded into the sum: ``nonzero`` of the hit vector returns every expert, ``torch.where(mask)`` every
(slot, token) position with the mask remembered, and the ``index_add`` that consumes those positions multiplies
each row by its mask entry (1 where routed, 0 elsewhere). Unrouted pairs add exact zeros, so the sum is the routed
one and every shape follows the input's. Each expert runs on every token (``num_experts / top_k`` times the routed
work), as a registry model does before ``fuse-moe``; the compile summary says so.

The mode is active only inside the modules ``loop_experts`` finds (a bank of at least two modules of one class,
and a forward that gathers with ``nonzero`` / ``where`` and scatters with ``index_add``), and only while the
model is exported: the eager reference keeps its own loop. Positions used any other way than a row gather and an
``index_add`` fail the export with the module named, rather than compute something else.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from kiln.errors import UnsupportedModelError

# ops that carry a position vector through unchanged in value (a cast, a copy, a reshape of one axis)
CARRIES = {"long", "int", "to", "clone", "contiguous", "view", "reshape", "flatten", "squeeze", "unsqueeze"}
INDEX_ADDS = {torch.Tensor.index_add_, torch.Tensor.index_add, torch.index_add}


def _bank(module: nn.Module) -> bool:
    """Whether ``module`` is, or directly holds, a ModuleList / ModuleDict with two or more modules of one class
    (an experts dict may hold a dropout beside its experts)."""
    for c in (module, *module.children()):
        if isinstance(c, (nn.ModuleList, nn.ModuleDict)) and len(c) >= 2:
            members = [type(m) for m in (c.values() if isinstance(c, nn.ModuleDict) else c)]
            if max(members.count(t) for t in members) >= 2:
                return True
    return False


def _gather_scatter(cls: type) -> bool:
    """Whether ``cls.forward`` gathers positions (``nonzero`` / ``where``) and scatters with ``index_add``."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "index_add" in source and ("nonzero" in source or "where(" in source)


def loop_experts(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose experts loop over the tokens routed to each (outside transformers' experts
    registry, whose modules ``kiln.compiler.experts`` runs densely itself)."""
    return [m for m in model.modules()
            if not hasattr(m, "_is_expert_parallel") and _bank(m) and _gather_scatter(type(m))]


def _axes(shape: list, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One vector per axis of ``shape``: each position's index along that axis, positions in row-major order."""
    return tuple(torch.arange(n, device=device).view([n if j == i else 1 for j in range(len(shape))])
                 .expand(shape).reshape(-1) for i, n in enumerate(shape))


class DenseLoops(TorchFunctionMode):
    """Inside: the gather-scatter expert loop runs on every (slot, token) position, masked (module docstring).
    ``owner`` names the module in errors."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner
        self.masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(positions) -> (positions, mask)
        self.consumed: set[int] = set()
        self.constant: dict[int, torch.Tensor] = {}  # the expert list: real tensors, so a name can be made of one

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(id(t) in self.constant for t in tensors):
            return self._constant(func, args, kwargs)
        if func in (torch.nonzero, torch.Tensor.nonzero) or (func is torch.where and len(args) == 1 and not kwargs):
            return self._positions(args[0], as_tuple=func is torch.where or bool(kwargs.get("as_tuple")))
        if func in INDEX_ADDS:
            return func(*self._masked(args), **kwargs)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in CARRIES and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.masks \
                and isinstance(out, torch.Tensor) and out.numel() == args[0].numel():
            self.masks[id(out)] = (out, self.masks[id(args[0])][1])
        return out

    def _constant(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op on the expert list alone, run on real values (outside the tracer), so ``f"expert_{idx[0]}"`` and
        ``experts[idx]`` see a number."""
        with _disable_current_modes():
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.constant[id(t)] = t
        return out

    def _positions(self, x: torch.Tensor, as_tuple: bool) -> Any:
        """Every position of ``x`` (row-major, as ``nonzero`` orders them): real values for a fixed-size vector (the
        experts), else one symbolic vector per axis with ``x != 0`` remembered for the ``index_add`` to apply."""
        shape = list(x.shape)
        if not as_tuple:
            if not all(isinstance(s, int) for s in shape):
                raise UnsupportedModelError(
                    f"{self.owner}: the experts loop asks nonzero() for the positions of a tensor whose size is "
                    "data; kiln runs such loops densely only through torch.where / nonzero(as_tuple=True)")
            with _disable_current_modes():
                grid = torch.stack(_axes(shape, x.device), -1)
            self.constant[id(grid)] = grid
            return grid
        axes = _axes(shape, x.device)
        mask = (x != 0).reshape(-1)
        for a in axes:
            self.masks[id(a)] = (a, mask)
        return axes

    def _masked(self, args: tuple) -> tuple:
        """``index_add(target, dim, index, source, ...)`` with each of ``source``'s rows along ``dim`` scaled by the
        mask of the positions ``index`` came from."""
        target, dim, index, source, *rest = args
        if id(index) not in self.masks:
            if self.masks:
                raise UnsupportedModelError(
                    f"{self.owner}: the experts loop adds rows at positions kiln did not hand out (computed from "
                    "them by an op it does not follow); this experts module cannot be run densely yet")
            return args
        self.consumed.add(id(index))
        mask = self.masks[id(index)][1]
        shape = [1] * source.dim()
        shape[dim] = -1
        return (target, dim, index, source * mask.to(source.dtype).view(shape), *rest)

    def unused(self) -> bool:
        """Whether positions were handed out that no ``index_add`` (or carried copy) consumed: used some other way,
        so the dense run would not equal the routed one."""
        groups: dict[int, list[int]] = {}
        for key, (_, mask) in self.masks.items():
            groups.setdefault(id(mask), []).append(key)
        return any(not any(k in self.consumed for k in keys) for keys in groups.values())


@contextlib.contextmanager
def dense_loops(model: nn.Module) -> Iterator[int]:
    """Inside: each of ``model``'s ``loop_experts`` modules runs its forward under ``DenseLoops``; yields how many.
    Restored on exit."""
    found = loop_experts(model)
    for m in found:
        def forward(*args: Any, _m: nn.Module = m, _own: Any = type(m).forward, **kwargs: Any) -> Any:
            mode = DenseLoops(type(_m).__name__)
            with mode:
                out = _own(_m, *args, **kwargs)
            if mode.unused():
                raise UnsupportedModelError(
                    f"{type(_m).__name__}: the experts loop uses the positions routed to each expert other than to "
                    "gather rows and index_add them back; this experts module cannot be run densely yet")
            return out

        m.forward = forward
    try:
        yield len(found)
    finally:
        for m in found:
            del m.forward
