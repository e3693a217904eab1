"""Routed experts (Qwen3-MoE) export as one Linear pair per expert: the same function as transformers' routed
loop, quantizable like any Linear, the router left in FP32."""

from __future__ import annotations

import pytest

from conftest import make_model, save_checkpoint
from kiln.cli import main
from kiln.compiler import experts


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


def test_dense_experts_equal_the_routed_forward():
    """Every expert on every token, scaled by its routing weight (zero where not picked), equals transformers' own
    routed loop; a planted bug (the last expert's contribution dropped) is far outside the tolerance."""
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = make_model("qwen3_moe", "causal-lm")
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    routed = _logits(model, ids)
    assert experts.use_dense_experts(model) == 2
    blocks = [m for m in model.modules() if hasattr(m, "kiln_experts")]
    assert len(blocks) == 2 and all(len(m.kiln_experts) == 4 for m in blocks)
    up = blocks[0].kiln_experts[1].up.weight
    assert up.data_ptr() == blocks[0].gate_up_proj[1].data_ptr() and tuple(up.shape) == (64, 64)  # a view, no copy
    dense = _logits(model, ids)
    assert (dense - routed).abs().max().item() <= 1e-5

    def planted(self, hidden, index, weights):
        keep = self.kiln_experts
        self.kiln_experts = keep[:-1]
        try:
            return experts.dense_experts_forward(self, hidden, index, weights)
        finally:
            self.kiln_experts = keep

    ALL_EXPERTS_FUNCTIONS.register("kiln_planted", planted)
    for m in blocks:
        m.config._experts_implementation = "kiln_planted"
    assert (_logits(model, ids) - routed).abs().max().item() > 1e-2


def test_streaming_refuses_routed_experts_naming_why(tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "moe", "qwen3_moe", "causal-lm")
    rc = main(["compile", str(ckpt), "-o", str(tmp_path / "art"), "--stream", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("kiln compile: error:") == 1 and "its 4 routed experts are not streamed yet" in err
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("raw,n", [({"num_experts": 128}, 128), ({"num_local_experts": 8}, 8),
                                   ({"n_routed_experts": 64}, 64), ({"num_experts": 1}, 0), ({}, 0)])
def test_config_experts(raw, n):
    assert experts.config_experts(raw) == n
