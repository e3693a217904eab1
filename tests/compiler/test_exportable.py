"""Forms that run eagerly but failed the exporter (kiln/compiler/exportable.py): each traced as the same computation,
checked by running the exported graph against the eager module (both fail to export without kiln's translation:
checked by hand when written), and the patch gone after the context."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kiln.compiler import exportable as exportable_lib
from kiln.compiler.exportable import exportable


def exported(module: torch.nn.Module, args: tuple, path, dynamic_shapes=None) -> ort.InferenceSession:
    with exportable(), torch.no_grad():
        program = torch.onnx.export(module, args, dynamo=True, verbose=False, dynamic_shapes=dynamic_shapes)
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


class InvertedMask(torch.nn.Module):
    """``1.0 - mask`` on an integer mask, as XLNet and ProphetNet write it."""

    def forward(self, x, mask):
        return x * (1.0 - mask)[..., None]


class ComplexRotary(torch.nn.Module):
    """Rotary embedding through complex numbers with a frequency table indexed by ``None`` (an unsqueeze on a
    complex tensor), as Llama 4 and DeepSeek-V2 write it."""

    def forward(self, q, angles):
        freqs = torch.polar(torch.ones_like(angles), angles)  # (seq, dim / 2) complex
        pairs = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))  # (batch, seq, heads, dim / 2)
        return torch.view_as_real(pairs * freqs[:, None, :]).flatten(3)


class OverlappingChunks(torch.nn.Module):
    """Overlapping chunks of a batch-first view of seq-first states (``as_strided`` on a non-contiguous view), as
    Longformer's sliding-window attention chunks its keys: the strides address the storage, not the view's order."""

    def forward(self, x):  # (L, B, E)
        y = (x * 2).transpose(0, 1)  # (B, L, E): a view, not contiguous
        b, length, e = y.shape
        return y.as_strided((b, length // 2 - 1, 4, e), (y.stride(0), 2 * y.stride(1), y.stride(1), y.stride(2))) + 1


class SizeQuotient(torch.nn.Module):
    """A length divided with ``torch.div(..., rounding_mode="trunc")`` and used as a size of a view of a
    non-contiguous tensor, as Longformer counts its chunks (eager makes a tensor of the quotient, which the view
    reads back: the tracer no longer knows it when it computes the view's strides)."""

    def forward(self, x):  # (L, B, E), L even
        y = x.transpose(0, 1)
        return y.view(y.shape[0], torch.div(y.shape[1], 2, rounding_mode="trunc"), 2, y.shape[2]).sum(-2)


class CastingRouter(torch.nn.Module):
    """A router that casts its classifier to its own dtype inside forward, as Switch Transformers' and NLLB-MoE's do;
    a cast to float64 (a real change) still happens. (Inside a loaded model the exporter fails to swap the weight
    for its traced copy; tests/compiler/test_sweep.py checks that on Switch Transformers.)"""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(8, 4)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        return torch.softmax(self.classifier(x), -1)


def test_a_module_cast_to_what_it_is_inside_forward_exports(tmp_path):
    torch.manual_seed(0)
    module, x = CastingRouter(), torch.randn(3, 8)
    session = exported(module, (x,), tmp_path / "m.onnx")
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, module(x).detach().numpy(), rtol=1e-6, atol=1e-7)
    with exportable():
        assert module.to(torch.float32) is module
        assert module.to(torch.float64).classifier.weight.dtype == torch.float64


def test_a_number_minus_an_integer_tensor_exports_as_eager_computes_it(tmp_path):
    x, mask = torch.randn(2, 5, 3), torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 1, 1]])
    session = exported(InvertedMask(), (x, mask), tmp_path / "m.onnx")
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, dict(zip(names, (x.numpy(), mask.numpy()))))[0]
    np.testing.assert_allclose(got, InvertedMask()(x, mask).numpy(), rtol=0, atol=0)


def test_a_complex_rotary_exports_as_eager_computes_it(tmp_path):
    torch.manual_seed(0)
    q, angles = torch.randn(2, 6, 4, 16), torch.randn(6, 8)
    session = exported(ComplexRotary(), (q, angles), tmp_path / "m.onnx")
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, dict(zip(names, (q.numpy(), angles.numpy()))))[0]
    np.testing.assert_allclose(got, ComplexRotary()(q, angles).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("forms", [True, False])
def test_overlapping_chunks_of_a_view_export_as_eager_computes_them(tmp_path, monkeypatch, forms):
    """Every batch size matches eager; without kiln's storage-order permute the exporter's translation gathers the
    view's row-major order instead (the planted bug: off by whole values from batch 2)."""
    if not forms:
        monkeypatch.setattr(exportable_lib.Forms, "__torch_function__",
                            lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=16)
    session = exported(OverlappingChunks(), (torch.randn(8, 3, 5),), tmp_path / "m.onnx", {"x": {1: batch}})
    errors = []
    for b in (1, 2, 4):
        x = torch.randn(8, b, 5)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        errors.append(float(np.abs(got - OverlappingChunks()(x).numpy()).max()))
    assert max(errors) == 0 if forms else max(errors[1:]) > 1


def test_a_non_dense_view_is_refused_rather_than_strided_wrong():
    class Gapped(torch.nn.Module):
        def forward(self, x):
            y = x[:, ::2]  # every other column: no permutation makes it contiguous
            return y.as_strided((2, 2), (1, 1))

    with pytest.raises(Exception, match="not a permutation of a contiguous block"), exportable(), torch.no_grad():
        torch.onnx.export(Gapped(), (torch.randn(4, 6),), dynamo=True, verbose=False)


def test_a_length_divided_as_a_size_exports_for_every_length(tmp_path, monkeypatch):
    torch.manual_seed(0)
    batch, pairs = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("pairs", min=1, max=32)
    session = exported(SizeQuotient(), (torch.randn(8, 2, 3),), tmp_path / "m.onnx", {"x": {1: batch, 0: 2 * pairs}})
    for length in (2, 6, 14):
        x = torch.randn(length, 3, 3)
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        np.testing.assert_allclose(got, SizeQuotient()(x).numpy(), rtol=1e-6, atol=1e-6)
    with exportable():  # a negative quotient truncates toward zero, as torch.div does
        assert torch.div(-7, 2, rounding_mode="trunc") == -3 and torch.div(-7, 2, rounding_mode="floor") == -4
    monkeypatch.setattr(exportable_lib.Forms, "__torch_function__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    with pytest.raises(Exception, match="data-dependent"):  # the eager quotient: the exporter stops on it
        exported(SizeQuotient(), (torch.randn(8, 2, 3),), tmp_path / "n.onnx", {"x": {1: batch, 0: 2 * pairs}})


def test_the_patches_are_gone_after_the_context_even_when_export_fails():
    rsub, to = torch.Tensor.__rsub__, torch.nn.Module.to
    with pytest.raises(RuntimeError), exportable():
        assert torch.Tensor.__rsub__ is not rsub and torch.nn.Module.to is not to
        raise RuntimeError("the exporter failed")
    assert torch.Tensor.__rsub__ is rsub and torch.nn.Module.to is to
