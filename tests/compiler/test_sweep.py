"""The architecture sweep's representative slice (tools/sweep_architectures.py): architectures built tiny from
transformers' own config classes by the sweep's generic shrinker, one per way a layer can reach its lowering, each
compiled and verified (parity, and generation for decoders) with the manifest saying what runs fused and why not.
The whole sweep is a benchmark (docs/models.md)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from conftest import ROOT, fast_options
from kiln.compiler import compile
from kiln.errors import InputError

sys.path.insert(0, str(ROOT / "tools"))
import sweep_architectures as sweep  # noqa: E402

CASES = {
    # model type: (cache the decoder gets, attention blocks fused, a word the reasons must hold)
    "falcon": ("kv-cache", 2, None),  # multi-query heads the config names its own way
    "gemma2": ("kv-cache", 2, None),  # soft-capped scores, a sliding and a global layer: both in the kernel
    "gpt_oss": ("kv-cache", 2, "down projection"),  # attention sinks in the kernel; its experts stay dense
    "deepseek_v3": ("kv-cache-concat", 0, "keys have 32 features and values 16"),  # latent attention
    "bloom": (None, 0, "computes attention itself"),  # ALiBi, its own attention: no cache, generation recomputes
    "modernbert": (None, 2, None),  # a rotary encoder with local attention: MultiHeadAttention with its mask
    "whisper": ("kv-cache", 2, None),  # a forward without position_ids: the generation reference runs rows alone
    "trocr": (None, 0, "computes attention itself"),  # no position_ids and no cache: recompute aligns rows at 0
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_slice_compiles_verified_with_its_reasons(tmp_path, model_type):
    task = sweep.model_types()[model_type]
    why, kind = sweep.build(model_type, task, tmp_path / "ckpt")
    assert why is None
    out = compile(tmp_path / "ckpt", tmp_path / "art", fast_options(max_length=128, verify_max_length=32))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    cache, fused, reason = CASES[model_type]
    attention = manifest["attention"]
    assert attention["fused"] == fused and attention["layers"] == 2
    notes = " ".join(attention["why"] + attention.get("experts", {}).get("unfused_why", []))
    assert reason is None or reason in notes
    if kind == "decoder":
        assert attention["cache"] == cache
        gen = manifest["verification"]["generation"]
        assert gen["steps"] == 16 and gen["through"] == ("kv cache" if cache else "recompute (no KV cache)")
        assert gen["max_abs_over_atol"] <= 1


INT4_CASES = {
    # model type: the embedding table's precision in the artifact (where the graph reads what the reference rounds)
    "gpt2": "int8",  # ids reshaped before the lookup; Conv1D projections; a tied head
    "modernbert-decoder": "int8",  # a prediction head's transform (a Linear outside the blocks) before the vocabulary
    "jetmoe": "int8",  # experts stacked in one (experts, out, in) parameter, read one matrix at a time
}


@pytest.mark.parametrize("model_type", sorted(INT4_CASES))
def test_int4_rounds_the_reference_as_the_graph_does(tmp_path, model_type):
    """INT4 round-to-nearest: the fake-quantized model the codes are checked against rounds exactly the weights the
    graph quantized (the table only when the lookup was found, every Linear but the head, blocks or not, and the
    matrices of stacked parameters the graph multiplies), so the codes check at 1e-3 passes on families whose graph
    reads those weights in unusual places (each case failed it by 0.003-0.08 before)."""
    task = sweep.model_types()[model_type]
    why, _ = sweep.build(model_type, task, tmp_path / "ckpt")
    assert why is None
    out = compile(tmp_path / "ckpt", tmp_path / "art", fast_options(max_length=128, verify_max_length=32,
                                                                     precision="int4", quant_method="rtn"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    int4 = next(p for p in manifest["passes"] if p["name"] == "quantize-nbits")["int4"]
    assert int4["embedding"] == INT4_CASES[model_type]


DERIVED = {
    # model type: (a config key the built checkpoint must hold, its value) for sizes derived from other sizes
    "mistral4": ("head_dim", 2 * sweep.HEAD_DIM),  # latent attention: a head is its unrotated part beside its rotary one
    "deepseek_v2": ("num_experts_per_tok", 2),  # routed experts with the top-k left unset
    "layoutlmv3": ("coordinate_size", sweep.HIDDEN_BY_SIX // 6),  # four coordinates and two sizes make the hidden
    "lilt": ("hidden_size", sweep.HIDDEN_BY_SIX),  # embeds a box in sixths of the hidden: the second size
    "xmod": ("default_language", "en_XX"),  # language adapters: one picked by the config
    "bert-generation": ("is_decoder", True),  # a causal LM attends one way
    "gemma4_text": ("per_layer_config", {"1": {"head_dim": 2 * sweep.HEAD_DIM}}),  # the global layer's wider head
}


@pytest.mark.parametrize("model_type", sorted(DERIVED))
def test_the_shrinker_keeps_derived_sizes_consistent(tmp_path, model_type):
    """Each of these failed its own forward in transformers when shrunk with the plain size keys (or, for the
    decoder, attended both ways; or kept a 262k-row per-layer table and a 512-wide head); built by the sweep, each
    runs, with the derived key as stated."""
    why, _ = sweep.build(model_type, sweep.model_types()[model_type], tmp_path / "ckpt")
    assert why is None
    key, value = DERIVED[model_type]
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())[key] == value


def test_a_tiny_model_that_does_not_run_is_left_out_with_the_error(monkeypatch, tmp_path):
    monkeypatch.setattr(sweep, "runs", lambda model: "RuntimeError: shapes disagree")
    why, kind = sweep.build("llama", "causal-lm", tmp_path / "ckpt")
    assert why == "cannot be built tiny: the tiny model does not run in transformers (RuntimeError: shapes disagree)"
    assert kind == "" and not (tmp_path / "ckpt").exists()


def test_the_shrinker_keeps_the_layer_and_top_k_counts_when_heads_match_them():
    """A config with as many layers (and experts per token) as heads shrinks to ``LAYERS`` layers and top-k 2, and
    only the key-value heads follow the heads (no grouping stays none); a grouped config keeps its grouping."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    ungrouped = sweep.shrink(LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32))
    assert (ungrouped["num_hidden_layers"], ungrouped["num_key_value_heads"]) == (sweep.LAYERS, sweep.HEADS)
    grouped = sweep.shrink(Qwen3MoeConfig(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                          num_experts_per_tok=8))
    assert (grouped["num_hidden_layers"], grouped["num_key_value_heads"]) == (sweep.LAYERS, sweep.KV_HEADS)
    assert grouped["num_experts_per_tok"] == 2


def test_the_shrinker_builds_configs_whose_validators_tie_sizes_together(tmp_path):
    """A config with the head size unset that its model reads (ministral: derived as hidden over heads), and one
    whose validators tie a layer's own sizes together (dots3_note_text: a sliding layer's head is its unrotated plus
    rotated parts, which scaling each size alone breaks: built with every layer at the base sizes on the last try)."""
    from transformers import MinistralConfig

    assert sweep.shrink(MinistralConfig())["head_dim"] == sweep.HIDDEN // sweep.HEADS
    for model_type in ("ministral", "dots3_note_text"):
        assert sweep.build(model_type, "causal-lm", tmp_path / model_type) == (None, "decoder")
    assert json.loads((tmp_path / "dots3_note_text" / "config.json").read_text()).get("per_layer_config") in ({}, None)


@pytest.mark.parametrize("model_type", ["switch_transformers", "nllb-moe", "flint"])
def test_the_shrinker_keeps_the_routed_expert_layers(tmp_path, model_type):
    """Experts every k-th layer (a sparse step, or a count of sparse layers the step is derived from) and a list of
    dense-MLP layers must leave at least one routed layer among the tiny model's two: a tiny model without experts
    would report a mixture-of-experts family as compiled when its expert path was never traced."""
    from safetensors import safe_open

    task = sweep.model_types()[model_type]
    assert sweep.build(model_type, task, tmp_path / "ckpt")[0] is None
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert any("expert" in name for name in f.keys())


def test_a_model_whose_generate_feeds_more_than_tokens_is_named(tmp_path):
    """XLNet's generate appends a dummy token and feeds a permutation mask and target mapping: the plain forward's
    last logits are not its next token, and the failure says so instead of blaming padding."""
    from transformers import AutoModelForCausalLM

    from kiln.compiler.verify.generation import generation_inputs
    from kiln.compiler.verify.parity import failures

    got = {}
    for model_type in ("xlnet", "llama"):
        assert sweep.build(model_type, "causal-lm", tmp_path / model_type)[0] is None
        got[model_type] = generation_inputs(AutoModelForCausalLM.from_pretrained(tmp_path / model_type), [5, 6, 7])
    assert got == {"xlnet": ["perm_mask", "target_mapping"], "llama": []}
    gen = {"passed": False, "wrong_tokens": [(0, 0)], "max_abs_over_atol": 9.0, "cosine_min": 0.1,
           "tokens_identical": False, "reference": "rows alone", "through": "recompute (no KV cache)",
           "generate_inputs": got["xlnet"]}
    line = " ".join(failures({"generation": gen, "cases": []}))
    assert "feeds its forward perm_mask, target_mapping" in line and "left-padded" not in line


TRACE_FIXES = {
    # model type: what the trace had to fix, as the manifest records it (kiln/compiler/decided.py, trace_seq2seq.py)
    "led": "encoder",  # global attention decided on the mask, lengths padded to its attention window (Longformer's
    # encoder, as longformer itself has it): the decoder reads the padded source
    "prophetnet": "decoder",  # a cache that takes one new token at a time: the decoder graph steps one token
}


@pytest.mark.parametrize("model_type", sorted(TRACE_FIXES))
def test_a_forward_that_stops_the_exporter_compiles_with_what_the_trace_fixed(tmp_path, model_type):
    import kiln.runtimes as kr

    task = sweep.model_types()[model_type]
    assert sweep.build(model_type, task, tmp_path / "ckpt")[0] is None
    out = compile(tmp_path / "ckpt", tmp_path / "art", fast_options(max_length=128, verify_max_length=32))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    graph = TRACE_FIXES[model_type]
    notes = sweep.traced(manifest)  # the sweep table's reason column
    if graph == "decoder":
        assert notes == ["the cached decoder steps one token at a time"]
        assert manifest["decoder"]["inputs"][0]["shape"] == ["batch", 1] and "length_multiple" not in manifest
        assert manifest["verification"]["generation"]["tokens_identical"]
        return
    assert notes[0].startswith(f"traced for the branch at modeling_{model_type}.py:") and "blocks of" in notes[1]
    blocks = manifest["length_multiple"]
    assert blocks["axis"] == "source" and blocks["multiple"] > 1
    (assumption,) = manifest["assumptions"][graph]
    assert assumption["value"] is False and assumption["where"].startswith(f"modeling_{model_type}.py:")
    model = kr.load(out)
    ids = np.array([[5, 6, 7, 8, 9]])
    assert model.generate(ids, max_new_tokens=3, stop_token_ids=[]).shape == (1, 4)  # a 5-token source, padded
    with pytest.raises(InputError, match="other branch"):  # a global token (mask 2): the branch not traced
        model.run({"input_ids": ids, "attention_mask": np.array([[2, 1, 1, 1, 1]])})
