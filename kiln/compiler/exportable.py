"""What the ONNX exporter needs and transformers' models do not always give it: forms that run eagerly but fail
``torch.export`` or ``torch.onnx.export``, traced as the same computation in a form both take.

- Complex tensors: rotary embeddings written with ``torch.view_as_complex`` (a complex frequency table indexed with
  ``None`` to broadcast over heads) reach ``aten.unsqueeze`` on a complex tensor, which the exporter's op library has
  no complex translation for. The exporter represents a complex tensor as a real one with a trailing (real,
  imaginary) axis; the translation below inserts the axis counting from the front of that representation, as the
  library's own complex ``permute`` / ``transpose`` do. Registered once, on import, for ``aten::unsqueeze`` with
  complex inputs only.
- ``exportable()``: a number minus an integer tensor, and a module cast to what it already is (below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from onnxscript.function_libs.torch_lib.registration import torch_op
from onnxscript.function_libs.torch_lib.tensor_typing import TTensor
from onnxscript.onnx_opset import opset18 as op


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
    it, instead of swapping each parameter for the tracer's copy ("Cannot swap t1 because it has weakref"). The
    same numbers; restored on exit."""
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
        yield
    finally:
        torch.Tensor.__rsub__ = rsub
        torch.nn.Module.to = to  # type: ignore[method-assign]
