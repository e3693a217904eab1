"""Experts that loop over their own tokens (kiln/compiler/expert_loops.py): found by their form, run densely under
export with the routing folded into the sum, equal to the routed loop at lengths the trace never saw, and refused
with the module named when the positions are used some other way."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from conftest import ROOT, fast_options
from kiln.compiler import compile
from kiln.compiler.expert_loops import DenseLoops, dense_loops, loop_experts
from kiln.errors import UnsupportedModelError

sys.path.insert(0, str(ROOT / "tools"))
import sweep_architectures as sweep  # noqa: E402

HIDDEN, EXPERTS, TOP = 16, 4, 2


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class LoopExperts(nn.ModuleDict):
    """The legacy form: experts hit, (slot, token) pairs per expert, rows gathered, ``index_add_`` back; a dropout
    beside the experts, as some families keep one in the dict."""

    def __init__(self) -> None:
        super().__init__({f"expert_{i}": Mlp() for i in range(EXPERTS)} | {"drop": nn.Dropout(0.0)})

    def forward(self, hidden: torch.Tensor, top: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        mask = nn.functional.one_hot(top, num_classes=EXPERTS).permute(2, 1, 0)  # (E, k, T)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[e].squeeze(0))
            rows = self[f"expert_{e[0]}"](hidden[None, token].reshape(-1, HIDDEN)) * weights[token, slot, None]
            out.index_add_(0, token, rows)
        return out


class Block(nn.Module):
    """A router and the loop experts, with a ModuleList of layers elsewhere in the model (not experts)."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.router, self.experts = nn.Linear(HIDDEN, EXPERTS), experts
        self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        probs = self.router(x).softmax(-1)
        weights, top = probs.topk(TOP, dim=-1)
        return self.experts(x, top, weights)


def block(experts: nn.Module | None = None) -> Block:
    torch.manual_seed(0)
    return Block(experts or LoopExperts()).eval()


def exported(model: nn.Module) -> torch.export.ExportedProgram:
    x = torch.randn(7, HIDDEN)
    with torch.no_grad(), dense_loops(model):
        return torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("tokens")},), strict=False)


def test_only_the_loop_experts_are_found():
    model = block()
    assert loop_experts(model) == [model.experts]


def test_the_loop_exports_and_equals_the_routed_loop_at_other_lengths():
    model = block()
    program = exported(model)
    for tokens in (1, 3, 19):
        x = torch.randn(tokens, HIDDEN)
        with torch.no_grad():
            assert torch.allclose(program.module()(x), model(x), atol=1e-6)
    assert "forward" not in vars(model.experts)  # restored on exit


def test_without_the_mask_the_dense_run_is_not_the_routed_one(monkeypatch):
    """The test above can fail: the same export with the routing mask left out adds every expert's rows."""
    monkeypatch.setattr(DenseLoops, "_masked", lambda self, args: (self.consumed.update(self.masks), args)[1])
    model = block()
    program = exported(model)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        assert not torch.allclose(program.module()(x), model(x), atol=1e-3)


class ReversedPositions(LoopExperts):
    """Positions reach ``index_add`` through an op kiln does not follow (a flip), so their mask is unknown there."""

    def forward(self, hidden: torch.Tensor, top: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        mask = nn.functional.one_hot(top, num_classes=EXPERTS).permute(2, 1, 0)
        for e in mask.sum(dim=(-1, -2)).nonzero():
            slot, token = torch.where(mask[e].squeeze(0))
            rows = self[f"expert_{e[0]}"](hidden[token]) * weights[token, slot, None]
            out.index_add_(0, token.flip(0), rows.flip(0))
        return out


def test_positions_that_reach_index_add_untracked_fail_with_the_module_named():
    model = block(ReversedPositions())
    assert loop_experts(model) == [model.experts]
    with pytest.raises(UnsupportedModelError, match="ReversedPositions: the experts loop adds rows at positions"):
        exported(model)


def test_positions_no_index_add_consumes_are_reported():
    """Positions used only to gather (an indexed write instead of ``index_add``) would make the dense sum wrong;
    ``dense_loops`` fails the export on ``unused``."""
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    with DenseLoops("M") as mode:
        slot, token = torch.where(mask)
        torch.zeros(3)[token]
    assert mode.unused()
    with DenseLoops("M") as mode:
        slot, token = torch.where(mask)
        torch.zeros(3).index_add(0, token.long(), torch.ones(6))
    assert not mode.unused()


def test_an_encoder_decoder_with_loop_experts_compiles_verified(tmp_path):
    """End to end: a tiny switch_transformers (a top-1 router with an expert capacity that casts its classifier to
    its own dtype inside forward, the loop in its experts dict) traces, verifies its generation, and the manifest
    says its experts run dense (before: the export stopped at the loop, "GuardOnDataDependentSymNode")."""
    model_type = "switch_transformers"
    why, kind = sweep.build(model_type, sweep.model_types()[model_type], tmp_path / "ckpt")
    assert why is None and kind == "seq2seq"
    out = compile(tmp_path / "ckpt", tmp_path / "art", fast_options(max_length=64))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    assert manifest["verification"]["generation"]["tokens_identical"]
    experts = [s["experts"] for s in manifest["attention"].values() if "experts" in s]
    assert experts and all(e["fused"] == 0 and e["layers"] >= 1 and e["unfused_why"] for e in experts)
