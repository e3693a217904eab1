"""Structured pruning: planted useless heads and channels are the ones removed, FLAP's bias compensation is exact
for inputs that never vary, GQA grouping is kept, the artifact matches the pruned model, bad input fails clearly."""

from __future__ import annotations

import copy
import json

import onnx
import pytest
import torch
from conftest import fast_options

from kiln.cli import main
from kiln.compiler import compile
from kiln.compiler import prune as P
from kiln.compiler.options import PRUNE_METHODS, PruneSpec

pytestmark = pytest.mark.slow


def bert(seed=0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    return BertModel(BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128)).eval()


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def feeds(n=2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200, (8, 24), generator=g)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for _ in range(n)]


@pytest.mark.parametrize("method", PRUNE_METHODS)
def test_planted_useless_head_and_channels_are_removed(method):
    """Head 2 of every layer writes through zero output columns; FFN channels 0-31 too: every method removes them."""
    model = bert()
    with torch.no_grad():
        for layer in P.layers(model, 2):
            layer.out.weight[:, 32:48] = 0
            layer.ffn_out.weight[:, :32] = 0
    rec = P.prune(model, 2, 4, 4, 16, PruneSpec(0.25, 0.25, method), feeds(), lambda m: None)
    assert all(r["heads_removed"] == [2] and r["ffn_removed"] == 32 for r in rec["layers"])
    assert model.config.num_attention_heads == 3 and model.config.intermediate_size == 96
    assert model(**feeds(1)[0])[0].shape == (8, 24, 64)


def test_flap_bias_compensation_is_exact_for_constant_inputs():
    """FFN channels 0-31 get a constant input (their intermediate rows zeroed, bias kept): removing them and folding
    their mean contribution into the output bias leaves the model's output unchanged (magnitude has no bias fold)."""
    model = bert()
    with torch.no_grad():
        for layer in P.layers(model, 2):
            layer.ffn_in[0].weight[:32] = 0
            layer.ffn_in[0].bias[:32] = torch.linspace(0.5, 2.0, 32)
            layer.ffn_out.weight[:, :32] *= 50  # large weights: magnitude would keep them
    f = feeds(1)[0]
    ref = model(**f)[0]
    flap, mag = copy.deepcopy(model), copy.deepcopy(model)
    rec = P.prune(flap, 2, 4, 4, 16, PruneSpec(0.0, 0.25, "flap"), feeds(), lambda m: None)
    assert rec["ffn_per_layer"] == [96, 96] and rec["original"]["ffn"] == 128
    flap_err = (flap(**f)[0] - ref).abs().max().item()
    assert flap_err < 1e-4
    P.prune(mag, 2, 4, 4, 16, PruneSpec(0.0, 0.25, "magnitude"), [], lambda m: None)  # keeps the big constant ones
    assert (mag(**f)[0] - ref).abs().max().item() > 10 * max(flap_err, 1e-5)


def test_gqa_groups_are_kept():
    """4 query heads over 2 KV heads, heads=0.5: one query head goes from each group, both KV heads stay."""
    model = llama()
    rec = P.prune(model, 2, 4, 2, 16, PruneSpec(0.5, 0.0, "wanda"), feeds(), lambda m: None)
    for r in rec["layers"]:
        assert len([h for h in r["heads_removed"] if h < 2]) == 1 and len([h for h in r["heads_removed"] if h >= 2]) == 1
    a = model.model.layers[0].self_attn
    assert a.q_proj.out_features == 32 and a.k_proj.out_features == 32 and a.num_key_value_groups == 1
    assert model.config.num_key_value_heads == 2 and model(**feeds(1)[0]).logits.shape == (8, 24, 200)


def test_adaptive_counts_follow_the_standardised_scores():
    """Layer 0's FFN scores hold 8 dead channels, layer 1's a smooth ramp: uniform takes 4 from each layer, adaptive
    the same total where the standardised score is lowest, all 8 dead ones."""
    heads = [torch.ones(64) for _ in range(2)]
    ch = [torch.cat([torch.zeros(8), torch.ones(120)]), torch.linspace(1, 2, 128)]
    for adaptive, want in ((False, [4, 4]), (True, [8, 0])):
        plan = P.Plan.make(PruneSpec(0.0, 4 / 128, "flap", adaptive=adaptive), heads, ch, 4, 4, 16, kv_cache=False)
        assert [128 - len(c) for c in plan.channels] == want
    plan = P.Plan.make(PruneSpec(0.0, 4 / 128, "flap", adaptive=True), heads, ch, 4, 4, 16, kv_cache=False)
    assert plan.channels[0] == list(range(8, 128))


def planted_checkpoint(tmp_path, family):
    """Heads 2 and 3 of layer 0 write through zero columns; layer 1's four query heads are copies of its head 0, so
    their standardised scores are all 0 and layer 0's dead heads are the lowest in the model by construction."""
    from conftest import make_model, make_tokenizer

    model = make_model(family, "base" if family == "bert" else "causal-lm")
    with torch.no_grad():
        first, second = P.layers(model, 2)
        width = first.out.weight.shape[1] // 4
        first.out.weight[:, 2 * width:] = 0
        q = second.qkv if family == "bert" else second.qkv[:1]  # BERT: Q, K and V per head; Llama: Q (one KV head)
        for h in range(1, 4):
            cols = slice(h * width, (h + 1) * width)
            for lin in q:
                lin.weight[cols] = lin.weight[:width]
                if lin.bias is not None:
                    lin.bias[cols] = lin.bias[:width]
            second.out.weight[:, cols] = second.out.weight[:, :width]
    path = tmp_path / family
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer("encoder" if family == "bert" else "decoder").save_pretrained(path)
    return path


@pytest.mark.parametrize("family,ratio", [("bert", 0.25), ("llama-gqa", 0.25)])
def test_adaptive_heads_compile_with_per_layer_counts(tmp_path, family, ratio):
    """--prune-layers adaptive takes both planted heads from layer 0 and none from layer 1 (uniform would take one
    from each); the fusion passes read the per-layer counts (every layer fused) and the artifact passes parity.
    Llama: 4 query heads over 1 KV head, so layer 0 keeps 2 and layer 1 all 4 (one KV-cache layout)."""
    if family == "llama-gqa":
        import conftest

        real = conftest.make_model

        def one_kv(f, head):
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            return LlamaForCausalLM(LlamaConfig(vocab_size=conftest.VOCAB, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=1, intermediate_size=128,
                                                max_position_embeddings=128)).eval()
        conftest.make_model = one_kv
        try:
            ckpt = planted_checkpoint(tmp_path, "llama")
        finally:
            conftest.make_model = real
    else:
        ckpt = planted_checkpoint(tmp_path, family)
    out = compile(ckpt, tmp_path / "o", fast_options(prune=f"heads={ratio}", prune_layers="adaptive"))
    m = json.loads((out / "manifest.json").read_text())
    p = m["pruning"]
    assert p["adaptive"] is True and p["heads_per_layer"] == [2, 4] and p["layers"][0]["heads_removed"] == [2, 3]
    fusion = "fuse-attention" if family == "bert" else "fuse-gqa"
    assert next(x for x in m["passes"] if x["name"] == fusion)["stats"]["fused"] == 2
    assert m["verification"]["status"] == "passed"


def test_one_head_left_per_layer_is_fused(checkpoints, tmp_path):
    """The exporter writes an extra identity Reshape for a one-head layer; fuse-attention matches it (no partial
    fusion allowed here) and the artifact passes FP32 parity."""
    out = compile(checkpoints["bert"], tmp_path / "o", fast_options(prune="heads=0.75", prune_method="magnitude"))
    m = json.loads((out / "manifest.json").read_text())
    assert m["pruning"]["heads_per_layer"] == [1, 1] and m["verification"]["status"] == "passed"
    assert next(x for x in m["passes"] if x["name"] == "fuse-attention")["stats"]["fused"] == 2


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_pruning_composes_with_quantization(tmp_path, precision):
    """The trained reference Llama, FFN 172 -> 138 channels (not a multiple of the INT4 group of 32): pruned first,
    then quantized and verified against the pruned eager model at the precision's tolerance; the pruning cost
    against the original is recorded next to the quantization."""
    import reference_models

    out = compile(reference_models.checkpoint("llama-tiny"), tmp_path / precision,
                  fast_options(prune="ffn=0.2", precision=precision, group_size=32, gptq_windows=8))
    m = json.loads((out / "manifest.json").read_text())
    assert m["verification"]["status"] == "passed" and m["pruning"]["ffn_per_layer"] == [138, 138]
    assert m["precision"] == precision and m["pruning"]["cost"]["ppl_increase_pct"] > 0
    graph = onnx.load(out / "model.onnx", load_external_data=False)
    bits = {next(a.i for a in n.attribute if a.name == "bits") for n in graph.graph.node if n.op_type == "MatMulNBits"}
    assert bits == {4 if precision == "int4" else 8} or (precision == "int4" and 4 in bits)


def test_pruned_artifact_matches_the_pruned_model(checkpoints, tmp_path):
    texts = tmp_path / "texts.txt"  # --calibration serves --prune at FP32 too
    texts.write_text("\n".join(f"the {w} sat on the mat and looked at the {v}" for w in ("cat", "dog", "bird")
                               for v in ("door", "window", "garden", "sky")) + "\n")
    out = compile(checkpoints["bert"], tmp_path / "p", fast_options(prune="heads=0.5,ffn=0.25", calibration=str(texts)))
    m = json.loads((out / "manifest.json").read_text())
    assert m["verification"]["status"] == "passed" and m["pruning"]["method"] == "flap"
    h = m["pruning"]["heads_per_layer"]
    assert sum(h) == 4 and next(p for p in m["passes"] if p["name"] == "fuse-attention")["stats"]["fused"] >= 1
    # the cost is the pruned model against the original on the calibration texts: recomputed here from the artifact
    # (which matches the pruned model) and the original eager model; pruning half the heads costs something
    import numpy as np
    import transformers

    import kiln.runtimes as kr
    from kiln.compiler.corpus import split

    lines = split(texts.read_text().splitlines())[1]  # the held-out texts
    with kr.load(out) as model:
        feeds = model.encode(lines)
        got = model.run(feeds)["last_hidden_state"].astype(np.float64)
    with torch.no_grad():
        ref = transformers.AutoModel.from_pretrained(checkpoints["bert"]).eval()(
            **{k: torch.from_numpy(v) for k, v in feeds.items()})[0].double().numpy()
    w = feeds["attention_mask"][..., None]
    a, b = (ref * w).sum(1) / w.sum(1), (got * w).sum(1) / w.sum(1)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    c = m["pruning"]["cost"]

    assert c["texts"] == len(lines) and cos.min() < 1 - 1e-7
    assert 1 - c["cosine_min"] == pytest.approx(1 - cos.min(), rel=1e-3)
    assert 1 - c["cosine_mean"] == pytest.approx(1 - cos.mean(), rel=1e-3)
    # the compile summary: the cost next to the speed against the original eager model
    v = json.loads((out / "report.json").read_text())["pruning"]
    assert v["cost"] == m["pruning"]["cost"] and v["original_eager_ms"] > 0 and v["speedup_vs_original_eager"] > 0
    from kiln.cli import parity_table

    line = next(x for x in parity_table(m).splitlines() if "pruned (flap, uniform)" in x)
    assert "heads 4 -> 2, FFN 64 -> 48 per layer; cost vs the original on" in line and "x the original eager" in line


def test_pruned_decoder_compiles(checkpoints, tmp_path):
    out = compile(checkpoints["llama"], tmp_path / "d", fast_options(prune="ffn=0.5", prune_method="magnitude"))
    m = json.loads((out / "manifest.json").read_text())
    assert m["verification"]["status"] == "passed" and m["pruning"]["ffn_per_layer"] == [64, 64]
    assert "ppl_increase_pct" in m["pruning"]["cost"]


def test_prune_auto_meets_the_budget_on_heldout_text(checkpoints, tmp_path):
    out = compile(checkpoints["bert"], tmp_path / "a", fast_options(prune="auto", max_drop="cosine=0.999"))
    p = json.loads((out / "manifest.json").read_text())["pruning"]
    a = p["auto"]
    assert a["ffn"] > 0 and a["heldout"] >= 0.999 and a["calibration"] >= 0.9995 and 1 <= a["candidates"] <= 6
    assert p["ffn_removed_total"] == 2 * round(a["ffn"] * p["original"]["ffn"])


@pytest.mark.parametrize("flags,message", [
    (["--prune", "auto"], "add --max-drop"),
    (["--prune", "auto", "--max-drop", "cosine=0.99", "--precision", "int8"], "give --prune ratios"),
    (["--prune", "heads=1.0"], "in [0, 1)"),
    (["--prune", "heads=-0.1"], "in [0, 1)"),
    (["--prune", "layers=0.2"], "components heads, ffn"),
    (["--prune", "ffn=0.2", "--prune-method", "obs"], "invalid choice"),
    (["--prune-method", "wanda"], "add --prune"),
    (["--prune-layers", "adaptive"], "add --prune"),
    (["--prune", "ffn=0.2", "--prune-layers", "global"], "invalid choice"),
    (["--prune", "heads=0.99"], "no attention heads"),
])
def test_bad_prune_input(checkpoints, tmp_path, capsys, flags, message):
    out = tmp_path / "bad"
    code = main(["compile", str(checkpoints["bert"]), "-o", str(out), *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not out.exists()
