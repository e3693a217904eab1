"""What the ONNX exporter needs and transformers' models do not always give it: forms that run eagerly but fail
``torch.export`` or ``torch.onnx.export``, traced as the same computation in a form both take.

- Complex tensors: rotary embeddings written with ``torch.view_as_complex`` (a complex frequency table indexed with
  ``None`` to broadcast over heads) reach ``aten.unsqueeze`` on a complex tensor, which the exporter's op library has
  no complex translation for. The exporter represents a complex tensor as a real one with a trailing (real,
  imaginary) axis; the translation below inserts the axis counting from the front of that representation, as the
  library's own complex ``permute`` / ``transpose`` do. Registered once, on import, for ``aten::unsqueeze`` with
  complex inputs only.
- ``exportable()``: a number minus an integer tensor, a module cast to what it already is, ``as_strided`` of a
  view whose elements are not in row-major order, and ``torch.div`` of two sizes (below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from onnxscript.function_libs.torch_lib.registration import torch_op
from onnxscript.function_libs.torch_lib.tensor_typing import TTensor
from onnxscript.onnx_opset import opset18 as op
from torch.overrides import TorchFunctionMode


@torch_op("aten::unsqueeze", trace_only=True, complex=True)
def unsqueeze_complex(self: TTensor, dim: int) -> TTensor:
    """``unsqueeze`` of a complex tensor in its real form (the last axis holds the real and imaginary parts)."""
    rank = len(self.shape) - 1
    if dim < 0:
        dim = dim + rank + 1
    return op.Unsqueeze(self, op.Constant(value_ints=[dim]))


@contextlib.contextmanager
def exportable() -> Iterator[None]:
    """Inside: a Python number minus an integer tensor (``1.0 - attention_mask``) casts the tensor to the result's
    dtype first, as eager type promotion does, instead of leaving the ONNX exporter's type-promotion pass a
    scalar-first subtraction it cannot re-dispatch ("Cannot find a compatible OpOverload for aten.sub"); and
    ``module.to(...)`` inside a forward (a router casting its classifier to the dtype it has: ``self.classifier =
    self.classifier.to(self.dtype)``) returns the module when no parameter or buffer would change, as eager leaves
    it, instead of swapping each parameter for the tracer's copy ("Cannot swap t1 because it has weakref"); and
    ``as_strided`` reads a view's storage in storage order and ``torch.div`` of two sizes stays a size
    (``Forms``). The same numbers; restored on exit."""
    rsub = torch.Tensor.__rsub__
    to = torch.nn.Module.to

    def to_unchanged(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
                (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
                and (device is None or t.device == torch.device(device)) for t in tensors):
            return self
        return to(self, *args, **kwargs)

    def rsub_promoted(self: torch.Tensor, other: Any) -> torch.Tensor:
        if isinstance(other, (bool, int, float)) and not self.is_floating_point() and not self.is_complex():
            promoted = torch.result_type(self, other)
            if promoted != self.dtype:
                return rsub(self.to(promoted), other)
        return rsub(self, other)

    torch.Tensor.__rsub__ = rsub_promoted
    torch.nn.Module.to = to_unchanged  # type: ignore[method-assign]
    try:
        with Forms():
            yield
    finally:
        torch.Tensor.__rsub__ = rsub
        torch.nn.Module.to = to  # type: ignore[method-assign]


class Forms(TorchFunctionMode):
    """Two calls whose eager result the exporter gets wrong or cannot trace, in a form it takes:

    - ``x.as_strided(size, stride, offset)`` addresses ``x``'s storage, but ONNX has no storage: the exporter's
      translation gathers from ``x`` flattened in its logical (row-major) order, which is the storage order only when
      ``x`` is contiguous. A view that is a permutation of a contiguous block (Longformer's keys: seq-first
      projections viewed batch-first, then chunked with overlapping strides) is first permuted to storage order, the
      same tensor in eager; the strides then address its row-major flattening, and the translation is right. A view
      with gaps (no permutation makes it contiguous) is refused rather than traced wrong.
    - ``torch.div(length, 16, rounding_mode="trunc")`` of two Python (or symbolic) integers makes a tensor, which a
      shape then reads back with ``item()``: a value the tracer no longer knows. The integer quotient instead (the
      same number; eager code uses it the same way as a size)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.div and len(args) == 2 and all(isinstance(a, (int, torch.SymInt)) for a in args) \
                and kwargs.get("rounding_mode") in ("trunc", "floor") and not isinstance(args[0], bool):
            a, b = args
            if kwargs["rounding_mode"] == "floor" or (a >= 0) == (b > 0):
                return a // b
            return -(-a // b)
        if func not in (torch.Tensor.as_strided, torch.as_strided) or args[0].is_contiguous():
            return func(*args, **kwargs)
        x = args[0]
        order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)
        y = x.permute(order)
        if not y.is_contiguous():
            raise NotImplementedError(f"as_strided of a view with strides {tuple(x.stride())} and shape "
                                      f"{tuple(x.shape)}, not a permutation of a contiguous block: ONNX has no "
                                      "storage to address")
        return func(y, *args[1:], **kwargs)
