"""AWQ: the scaled model computes the same function, a fold that would change it is refused, the scales lower the
rounding error where activations have outlier channels, and ``--quant-method awq|awq+gptq`` compile end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import fast_options

from kiln.cli import main
from kiln.compiler import compile
from kiln.compiler.load import load_checkpoint
from kiln.compiler.quantize import awq, gptq

pytestmark = pytest.mark.slow

SETTINGS = gptq.Settings(bits=4, group_size=16, grid="signed")


def windows(vocab: int, n: int = 4, length: int = 48, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2]), "use_cache": False}
            for i in range(0, n, 2)]


def logits(model, feeds) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**f).logits for f in feeds])


def rtn_all(model, num_layers: int) -> None:
    """Every block Linear replaced by its values on the pass's grid (what --quant-method rtn/awq compile)."""
    with torch.no_grad():
        for block in gptq.transformer_blocks(model, num_layers):
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(awq.fake_quantize(m.weight.detach().float(), SETTINGS))


def outlier_llama(checkpoints):
    """The tiny Llama with two planted activation outlier channels (x30) after every input norm, compensated in the
    Q/K/V columns: the same function, and inputs AWQ exists for."""
    model = load_checkpoint(checkpoints["llama"]).model
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, linears in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                           layer.self_attn.v_proj)),
                                  (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj))):
                norm.weight[[3, 17]] *= 30
                for lin in linears:
                    lin.weight[:, [3, 17]] /= 30
    return model


def test_scaled_model_computes_the_same_function(checkpoints):
    model = load_checkpoint(checkpoints["llama"]).model
    feeds = windows(model.config.vocab_size)
    before = logits(model, feeds)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    summary = awq.scale_model(model, feeds, model.config.num_hidden_layers, SETTINGS, lambda m: None)
    after = logits(model, feeds)
    assert summary["scaled"] >= 2 * model.config.num_hidden_layers  # Q/K/V and gate/up (and down) of every layer
    assert float((after - before).abs().max()) <= 1e-4 * float(before.abs().max())
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, weights[n])]
    assert any("input_layernorm" in n for n in changed) and any("q_proj" in n for n in changed)
    assert all(r <= 1.0 for r in summary["error_ratio"])  # the unscaled weights are always a candidate


def test_a_fold_that_changes_the_block_is_undone(checkpoints, monkeypatch):
    """A planted bug: every group's divisor folded into the input norm, whatever reads it. The block check catches
    the groups where that is wrong (gate/up, down, o_proj do not read the input norm) and leaves them unscaled."""
    model = load_checkpoint(checkpoints["llama"]).model
    feeds = windows(model.config.vocab_size)
    before = logits(model, feeds)
    monkeypatch.setattr(awq, "_fold_target", lambda modules, linears, stage, producers: ("input_layernorm", "norm")
                        if gptq.in_features(linears[stage[0]]) == model.config.hidden_size else None)
    summary = awq.scale_model(model, feeds, model.config.num_hidden_layers, SETTINGS, lambda m: None)
    refused = [w for w, why in summary["unscaled"].items() if "changed the block output" in why]
    assert any("gate_proj" in w for w in refused) and not any("q_proj" in w for w in refused)
    after = logits(model, feeds)
    assert float((after - before).abs().max()) <= 1e-4 * float(before.abs().max())


def test_awq_lowers_the_rounding_error_on_outlier_channels(checkpoints):
    model = outlier_llama(checkpoints)
    feeds = windows(model.config.vocab_size)
    exact = logits(model, feeds)
    layers = model.config.num_hidden_layers
    plain = copy.deepcopy(model)
    rtn_all(plain, layers)
    scaled = copy.deepcopy(model)
    summary = awq.scale_model(scaled, feeds, layers, SETTINGS, lambda m: None)
    rtn_all(scaled, layers)
    err_rtn = float(((logits(plain, feeds) - exact) ** 2).mean())
    err_awq = float(((logits(scaled, feeds) - exact) ** 2).mean())
    assert summary["scaled"] >= 2 * layers and err_awq < 0.7 * err_rtn, (err_awq, err_rtn)


@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_compiles_verified_with_the_method_recorded(checkpoints, tmp_path, method):
    out = compile(checkpoints["llama"], tmp_path / "art", fast_options(precision="int4", quant_method=method,
                                                                        group_size=16))
    m = json.loads((out / "manifest.json").read_text())
    q = next(p for p in m["passes"] if p["name"] == "quantize-nbits")
    assert m["verification"]["status"] == "passed" and q["int4"]["method"] == method
    a = q["int4"]["awq"]
    assert a["scaled"] >= 2 and a["groups"] == a["scaled"] + len(a["unscaled"]) and a["windows"] >= 1
    assert (q["int4"]["gptq"] is not None) == (method == "awq+gptq")
    assert (q["stats"]["given"] > 0) == (method == "awq+gptq")  # the solver's codes, packed as they are


def test_streaming_and_encoder_decoders_are_refused(checkpoints, tmp_path, capsys):
    code = main(["compile", str(checkpoints["llama"]), "-o", str(tmp_path / "o"), "--precision", "int4",
                 "--quant-method", "awq", "--stream"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "scales the whole model in memory" in err[-1] and not (tmp_path / "o").exists()
