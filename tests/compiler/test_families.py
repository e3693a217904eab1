"""Architectures kiln has no code for by name compile when their graphs are the patterns kiln fuses:
coverage and parity decide. An unsupported pattern fails naming the rule and the reason."""

from __future__ import annotations

import json

import pytest

from conftest import fast_options, save_checkpoint
from kiln.cli import main
from kiln.compiler import compile

NEW = [("electra", "base", "fuse-attention"), ("xlm-roberta", "base", "fuse-attention"),
       ("granite", "causal-lm", "fuse-gqa"), ("olmo", "causal-lm", "fuse-gqa"), ("starcoder2", "causal-lm", "fuse-gqa"),
       ("qwen3", "causal-lm", "fuse-gqa"), ("gemma3_text", "causal-lm", "fuse-gqa"), ("phi3", "causal-lm", "fuse-gqa"),
       ("stablelm", "causal-lm", "fuse-gqa"), ("gpt_neox", "causal-lm", "fuse-gqa"), ("phi", "causal-lm", "fuse-gqa"),
       ("qwen3_moe", "causal-lm", "fuse-gqa")]


@pytest.mark.parametrize("family,head,rule", NEW, ids=[f for f, _, _ in NEW])
def test_new_family_compiles_with_full_coverage(tmp_path, family, head, rule):
    ckpt = save_checkpoint(tmp_path / family, family, head)
    out = compile(ckpt, tmp_path / "art", fast_options())
    manifest = json.loads((out / "manifest.json").read_text())
    passes = {p["name"]: p for p in manifest["passes"]}
    assert manifest["model"]["model_type"] == family and manifest["verification"]["status"] == "passed"
    assert passes[rule]["coverage"] == {"expected": 2, "fused": 2}
    if head == "causal-lm":  # a KV cache for every layer, and greedy tokens identical to Hugging Face generate
        assert passes["kv-cache"]["coverage"] == {"expected": 2, "fused": 2}
        moe = 2 if family == "qwen3_moe" else 0  # every routed-experts layer one MoE node (kiln/passes/fuse_moe.py)
        assert passes["fuse-moe"]["coverage"] == {"expected": moe, "fused": moe}
        gen = manifest["verification"]["generation"]
        assert gen["tokens_identical"] and gen["steps"] == 16 and gen["max_abs_over_atol"] <= 1
    else:
        assert manifest["verification"]["summary"]["last_hidden_state"]["max_abs"] <= 1e-4


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3", "stablelm", "gpt_neox", "phi", "qwen3_moe"])
def test_new_decoder_families_quantize(tmp_path, family, precision):
    """The newer decoder families quantize with full coverage, parity and the KV-cache generation check: Q/K norms
    (Gemma 3 with a sliding and a global layer), packed projections (Phi-3's Slices, GPT-NeoX's per-head layout),
    partial rotary, an lm_head with a bias (Phi-2), which is still found and lowered as the head, and routed experts
    (Qwen3-MoE: every expert's Linears quantized, GPTQ's codes for them at INT4)."""
    ckpt = save_checkpoint(tmp_path / family, family, "causal-lm")
    out = compile(ckpt, tmp_path / "art", fast_options(precision=precision))
    manifest = json.loads((out / "manifest.json").read_text())
    passes = {p["name"]: p for p in manifest["passes"]}
    assert manifest["verification"]["status"] == "passed" and manifest["verification"]["generation"]["steps"] == 16
    assert passes["fuse-gqa"]["coverage"] == {"expected": 2, "fused": 2}
    assert passes["kv-cache"]["coverage"] == {"expected": 2, "fused": 2}
    q = passes["quantize-nbits"]["stats"]
    assert q["bits"] == (8 if precision == "int8" else 4) and q["quantized"] >= 2 * 4 and q["head"] == "int8"
    assert passes["logits-to-keep"]["stats"]["sliced"] == 1
    if family == "qwen3_moe":  # 2 layers x (4 attention + 4 experts x 2) Linears, all solved by GPTQ at INT4
        assert q["quantized"] == 2 * 12 + 1
        assert passes["fuse-moe"]["coverage"] == {"expected": 2, "fused": 2} and q["moe"] == 2  # both layers QMoE
        if precision == "int4":
            assert manifest["verification"]["quantization"]["int4"]["from_solver"] == 24


def test_a_rotary_the_kernel_cannot_fold_stays_in_the_graph(tmp_path, capsys):
    """Rotary over 8 of each head's 32 features (the kernel rotates multiples of 16): the family's own rotary ops stay
    in the graph, GroupQueryAttention takes Q and K already rotated, and the compile verifies generation through the
    cache; the manifest says why the rotary was not folded."""
    ckpt = save_checkpoint(tmp_path / "stablelm", "stablelm-rd8", "causal-lm")
    rc = main(["compile", str(ckpt), "-o", str(tmp_path / "art"), "-q", "--threads", "2", "--verify-max-length", "32"])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    gqa = next(p for p in manifest["passes"] if p["name"] == "fuse-gqa")
    assert gqa["stats"]["fused"] == 2 and gqa["stats"]["rotary"] == 0
    assert any("rotary stays in the graph" in r["why"] and "8 of 32" in r["why"] for r in gqa["skipped"])
    kv = next(p for p in manifest["passes"] if p["name"] == "kv-cache")
    assert kv["stats"]["layers"] == 2 and kv["stats"]["sliced_positions"] >= 1  # the graph's positions cut to the new
    gen = manifest["verification"]["generation"]
    assert gen["steps"] == 16 and gen["max_abs_over_atol"] <= 1
