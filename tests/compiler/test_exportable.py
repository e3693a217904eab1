"""Forms that run eagerly but failed the exporter (kiln/compiler/exportable.py): each traced as the same computation,
checked by running the exported graph against the eager module (both fail to export without kiln's translation:
checked by hand when written), and the patch gone after the context."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kiln.compiler.exportable import exportable


def exported(module: torch.nn.Module, args: tuple, path) -> ort.InferenceSession:
    with exportable(), torch.no_grad():
        program = torch.onnx.export(module, args, dynamo=True, verbose=False)
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


def test_the_patches_are_gone_after_the_context_even_when_export_fails():
    rsub, to = torch.Tensor.__rsub__, torch.nn.Module.to
    with pytest.raises(RuntimeError), exportable():
        assert torch.Tensor.__rsub__ is not rsub and torch.nn.Module.to is not to
        raise RuntimeError("the exporter failed")
    assert torch.Tensor.__rsub__ is rsub and torch.nn.Module.to is to
