"""GPTQ in torch: the lazy-batch solver against a float64 transcription of the algorithm, act-order, grids,
a planted outlier RTN ruins and GPTQ keeps, and codes that are exactly what the artifact multiplies by."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.compiler.quantize import gptq
from kiln.compiler.quantize.gptq import Settings, solve
from kiln.passes.codes import rtn


def correlated_inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, k, generator=g) @ torch.randn(k, k, generator=g) * 0.3 + 0.1 * torch.randn(t, k, generator=g)


def hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 / x.shape[0] * x.T @ x


def reference_gptq(w: np.ndarray, h: np.ndarray, bits: int, group: int, damp: float = 0.01) -> np.ndarray:
    """Column by column in float64, no lazy batches: quantize, then spread the error over the columns not yet
    quantized with the Cholesky factor of the inverse Hessian (Frantar et al., Algorithm 1), signed grid, each
    group's scale rounded to FP16 as kiln stores it."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    n, k = w.shape
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper factor of H^-1
    mid, top = 1 << (bits - 1), (1 << bits) - 1
    q = np.zeros_like(w)
    for j in range(k):
        if j % group == 0:
            g = w[:, j:j + group]
            extreme = g[np.arange(n), np.abs(g).argmax(1)]
            scale = np.where(extreme == 0, 1.0, extreme / -mid).astype(np.float16).astype(np.float64)  # FP16 scales
        codes = np.clip(np.rint(w[:, j] / scale) + mid, 0, top)
        q[:, j] = (codes - mid) * scale
        err = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j:] -= np.outer(err, u[j, j:])
    return q


@pytest.mark.parametrize("group", [16, 32, 64])
def test_solver_matches_a_float64_transcription(group):
    torch.manual_seed(0)
    n, k = 24, 160  # K spans two lazy blocks of 128 and a partial one
    w = torch.randn(n, k)
    h = hessian(correlated_inputs(800, k))
    q, deq = solve(w, h, Settings(bits=4, group_size=group, act_order=False))
    ref = reference_gptq(w.numpy(), h.numpy(), 4, group)
    step = np.abs(q.scales).max()
    # float32 vs float64: a rounding can flip by one code where a value sits on a boundary; the rest agree exactly
    diff = np.abs(deq.numpy() - ref)
    assert (diff < 1e-4).mean() > 0.97 and diff.max() <= step * 1.01
    np.testing.assert_array_equal(q.dequantize().T, deq.numpy())  # the codes are the solver's weights, bit for bit


def test_a_handed_over_hessian_solves_alike_and_a_lent_one_is_left_as_it_was():
    """``own=True`` (the streamed solver's: no (K, K) copy) overwrites the Hessian and gives the same codes as a
    lent one, which stays untouched; a Hessian that is not positive definite is dampened further, not refused."""
    torch.manual_seed(2)
    w = torch.randn(16, 96)
    h = hessian(correlated_inputs(400, 96, seed=2))
    kept = h.clone()
    for act_order in (False, True):
        s = Settings(group_size=32, act_order=act_order, static_groups=False)
        lent_q, lent = solve(w, h, s)
        assert torch.equal(h, kept)
        given = h.clone()
        own_q, owned = solve(w, given, s, own=True)
        assert act_order or not torch.equal(given, kept)  # dampened in place: it was not copied
        assert torch.equal(lent, owned) and np.array_equal(lent_q.codes, own_q.codes)
    singular = hessian(correlated_inputs(20, 96, seed=3))  # rank 20 of 96: no Cholesky factor without damping
    assert int(torch.linalg.cholesky_ex(singular)[1]) != 0
    _, dampened = solve(w, singular, Settings(group_size=32, act_order=False, damp=0.0))
    assert torch.isfinite(dampened).all()


def output_error(x: torch.Tensor, w: torch.Tensor, deq: torch.Tensor) -> float:
    return float(((x @ (deq - w).T) ** 2).mean())


def test_gptq_beats_rtn_on_correlated_inputs_and_act_order_keeps_its_promise():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    x = correlated_inputs(2000, 256, seed=1)
    h = hessian(x)
    _, plain = solve(w, None, Settings(method="rtn", group_size=32))
    q, gptq = solve(w, h, Settings(group_size=32, act_order=False))
    qa, ordered = solve(w, h, Settings(group_size=32, act_order=True, static_groups=False))
    qs, static = solve(w, h, Settings(group_size=32, act_order=True))  # the default: static groups
    e_rtn, e_gptq, e_ao = output_error(x, w, plain), output_error(x, w, gptq), output_error(x, w, ordered)
    assert e_gptq < 0.6 * e_rtn and e_ao < 0.6 * e_rtn  # measured 0.50x
    # static groups: solved in act-order, codes in the input order (no Gather in the graph), as good
    assert qs.perm is None and output_error(x, w, static) < 0.6 * e_rtn
    np.testing.assert_array_equal(qs.dequantize().T, static.numpy())
    # act-order: the solver's column order is recorded; codes in that order dequantize to the returned weight
    assert qa.perm is not None and sorted(qa.perm.tolist()) == list(range(256))
    d = torch.diag(h)
    assert torch.all(d[qa.perm[:-1]] >= d[qa.perm[1:]])
    np.testing.assert_array_equal(qa.dequantize().T, ordered.numpy())
    assert q.perm is None


def test_planted_outlier_channel_rtn_ruins_and_gptq_keeps():
    """One input channel carries 30x larger activations (as small LLMs' outlier channels do) and an outlier weight
    column sets every row's scale: RTN rounds the salient channel's weights coarsely and the 30x gain turns that
    into a fifth of the output's energy; GPTQ spreads the error over the correlated channels."""
    torch.manual_seed(2)
    k = 128
    x = correlated_inputs(3000, k, seed=2)
    x[:, 7] *= 30
    w = torch.randn(48, k) * 0.05
    w[:, 20] = torch.randn(48) * 0.8
    _, plain = solve(w, None, Settings(method="rtn", group_size=128))
    _, kept = solve(w, hessian(x), Settings(group_size=128, act_order=True))
    ref = float((x @ w.T).pow(2).mean())
    e_rtn, e_gptq = output_error(x, w, plain) / ref, output_error(x, w, kept) / ref
    assert e_rtn > 0.15  # measured 0.217
    assert e_gptq < 0.3 * e_rtn  # measured 0.045


@pytest.mark.parametrize("grid", ["signed", "positive", "asym"])
def test_rtn_method_is_the_passes_round_to_nearest(grid):
    torch.manual_seed(3)
    w = torch.randn(40, 96)
    q, deq = solve(w, None, Settings(method="rtn", group_size=32, grid=grid))
    ref = rtn(w.numpy().T, 4, 32, grid)
    np.testing.assert_array_equal(q.codes, ref.codes)
    np.testing.assert_allclose(q.scales, ref.scales, rtol=1e-6)
    assert (q.zeros is None) == (grid != "asym")


def test_per_row_group_pads_to_a_power_of_two_with_the_zero_point():
    torch.manual_seed(4)
    w = torch.randn(8, 80)
    q, deq = solve(w, hessian(correlated_inputs(400, 80)), Settings(group_size=0, act_order=False))
    assert q.block_size == 128 and q.codes.shape == (8, 1, 128) and q.scales.shape == (8, 1)
    assert np.all(q.codes[:, 0, 80:] == 8)  # padding dequantizes to exactly zero
    np.testing.assert_array_equal(q.dequantize().T, deq.numpy())


@pytest.mark.parametrize("group", [0, 32])
def test_per_row_act_order_codes_come_back_in_input_order(group):
    """One group per row (group 0, or a group as wide as the row): its scale does not depend on the solve order, so
    act-order's codes are returned in input order with no permutation (no Gather; QMoE, which takes none, can use
    them) and are still exactly what the solver dequantized."""
    torch.manual_seed(6)
    w = torch.randn(8, 32)
    q, deq = solve(w, hessian(correlated_inputs(300, 32)), Settings(group_size=group, act_order=True))
    assert q.perm is None
    np.testing.assert_array_equal(q.dequantize().T, deq.numpy())


def test_dead_columns_are_zero():
    torch.manual_seed(5)
    w = torch.randn(16, 64)
    x = correlated_inputs(500, 64)
    x[:, 3] = 0  # never active: its weights cannot matter, GPTQ zeroes them
    q, deq = solve(w, hessian(x), Settings(group_size=32, act_order=False))
    assert torch.all(deq[:, 3] == 0)


def test_lm_head_is_solved_on_the_quantized_blocks_outputs():
    """head=True: the tied lm_head is untied (the embedding table keeps its FP32 weights), solved on the final
    hidden states, and its logits on the calibration windows are closer to FP32 than round-to-nearest's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    table = model.get_input_embeddings().weight.detach().clone()
    ids = torch.randint(0, 512, (8, 32))
    windows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}]
    settings = Settings(bits=4, group_size=32, act_order=True)
    book = gptq.quantize_model(model, windows, 2, settings, lambda m: None, head=True)
    assert torch.equal(model.get_input_embeddings().weight, table)
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert book.find(table.numpy().T.copy()) is not None and len(book) == 2 * 7 + 1
    with torch.no_grad():
        hidden = model.model(**{k: v for k, v in windows[0].items()}).last_hidden_state
        solved = hidden @ model.lm_head.weight.T
        exact = hidden @ table.T
        rounded = hidden @ torch.from_numpy(rtn(table.numpy().T, 4, 32).dequantize())
    assert (solved - exact).pow(2).mean() < 0.8 * (rounded - exact).pow(2).mean()


def test_more_bits_layers_are_llama_cpps():
    """llama.cpp's use_more_bits (src/llama-quant.cpp): i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2."""
    assert [i for i in range(30) if gptq.more_bits_layer(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [i for i in range(2) if gptq.more_bits_layer(i, 2)] == [1]
    assert [i for i in range(32) if gptq.more_bits_layer(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28,
                                                                     29, 30, 31]


def test_more_bits_linears_are_the_attention_inputs_and_the_down_projection():
    llama = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
             ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    assert gptq.more_bits_linears(llama) == {*llama[0], "mlp.down_proj"}
    gpt2 = [["attn.c_attn"], ["attn.c_proj"], ["mlp.c_fc"], ["mlp.c_proj"]]
    assert gptq.more_bits_linears(gpt2) == {"attn.c_attn", "mlp.c_proj"}
    moe = llama[:2] + [["mlp.gate", "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj"], ["mlp.experts.0.down_proj"],
                       ["mlp.experts.1.down_proj"]]
    assert gptq.more_bits_linears(moe) == set(llama[0])  # QMoE takes one width for every expert


def test_a_more_bits_block_solves_its_attention_inputs_and_down_at_8_bits():
    """quantize_block with ``Settings.more_bits``: in a more-bits layer the chosen Linears are solved at 8 bits (their
    weights become the 8-bit solution), the others at 4; outside one every Linear stays at 4."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    rotary = LlamaRotaryEmbedding(cfg)
    for index, expect8 in ((1, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"}),
                           (0, set())):
        block = LlamaDecoderLayer(cfg, 0).eval()
        x = torch.randn(1, 24, 64)
        pos = rotary(x, torch.arange(24)[None])
        states = [(x, (), {"position_embeddings": pos, "attention_mask": None})]
        got = {}
        n = gptq.quantize_block(block, states, Settings(group_size=32, more_bits=8),
                                lambda name, w, q: got.update({name: q}), layer=(index, 2))
        assert n == 7 and {name for name, q in got.items() if q.bits == 8} == expect8
        assert {q.bits for name, q in got.items() if name not in expect8} == {4}
