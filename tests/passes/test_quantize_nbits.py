"""quantize-nbits: blocked weight-only INT8/INT4 -> MatMulNBits; numpy reference, ONNX Runtime agrees, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from graphs import op_types, run_unoptimised
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import run_passes
from kiln.passes.codes import Codebook, Quantized, dequantize_blocks, pack, pack_zeros, quantize_blocks, rtn, unpack
from kiln.passes.quantize_nbits import QuantizeBlockwise, int_tensor


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_keeps_each_blocks_extreme_weight_exact(bits):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 5)).astype(np.float32)  # K not a multiple of the block: padded
    codes, scales = quantize_blocks(w, bits, 32)
    assert codes.shape == (5, 3, 32) and scales.shape == (5, 3) and codes.max() < 2 ** bits
    back = dequantize_blocks(codes, scales, bits, 70)
    for n in range(5):
        for b in range(3):
            block = w[32 * b:32 * (b + 1), n]
            i = np.abs(block).argmax()
            # maps to the most negative code exactly; its scale is an FP16 number, so the weight is FP16-exact
            assert back[32 * b + i, n] == pytest.approx(block[i], rel=2 ** -11)
            assert float(np.float16(scales[n, b])) == scales[n, b]
            step = np.abs(scales[n, b])
            err = np.abs(back[32 * b:32 * (b + 1), n] - block)
            # the grid is asymmetric by one code: weights of the other sign near the extreme clip by < 1 step
            clipped = np.sign(block) != np.sign(block[i])
            assert err[~clipped].max() <= step / 2 + 1e-6 and err.max() <= step + 1e-6
    np.testing.assert_array_equal(unpack(pack(codes, bits), bits), codes)


def test_one_large_weight_costs_only_its_block():
    w = np.full((64, 1), 0.01, np.float32)
    w[3, 0] = 10.0  # an outlier in block 0
    back = dequantize_blocks(*quantize_blocks(w, 8, 32), 8, 64)
    assert np.abs(back[32:, 0] - 0.01).max() < 1e-4  # block 1 keeps its resolution
    assert np.abs(back[:32, 0] - w[:32, 0]).max() <= 10.0 / 128 / 2 + 1e-6


def matmul_graph(k=64, n=48, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"]),
                           helper.make_node("MatMul", ["y", "y_t"], ["scores"], name="scores")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k]),
                                helper.make_tensor_value_info("y_t", TensorProto.FLOAT, ["B", n, "S"])],
                          [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", "S", "S"])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m, w


@pytest.mark.parametrize("bits", [4, 8])
def test_onnxruntime_matches_the_reference(bits):
    model, w = matmul_graph()
    out, record = run_passes(model, [QuantizeBlockwise(bits=bits, block_size=32, accuracy_level=0)])
    assert record[0]["stats"]["quantized"] == 1 and op_types(out).count("MatMulNBits") == 1
    assert "scores" in record[0]["skipped"][0]["where"]  # activations x activations: reported, not quantized
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    y_t = np.random.default_rng(2).standard_normal((2, 48, 3)).astype(np.float32)
    wq = dequantize_blocks(*quantize_blocks(w, bits, 32), bits, 64)
    h = np.maximum(x @ wq, 0)
    np.testing.assert_allclose(run_unoptimised(out, {"x": x, "y_t": y_t})[0], h @ y_t, rtol=1e-4, atol=1e-4)


def test_kept_weight_second_run_and_bad_settings():
    model, _ = matmul_graph()
    out, record = run_passes(model, [QuantizeBlockwise(keep_fp32=("w",))])
    assert record[0]["modified"] is False and any("kept in FP32" in r["why"] for r in record[0]["skipped"])
    assert out.SerializeToString() == model.SerializeToString()
    once, _ = run_passes(model, [QuantizeBlockwise()])
    twice, record = run_passes(once, [QuantizeBlockwise()])
    assert record[0]["modified"] is False and twice.SerializeToString() == once.SerializeToString()
    with pytest.raises(ValueError, match="power-of-two block size"):
        QuantizeBlockwise(block_size=48)


def tied_graph(seed: int):
    """Embedding Gather and a tied head, MatMul(h, Transpose(E)), reading one (vocab 40, hidden 32) table."""
    e = np.random.default_rng(seed).standard_normal((40, 32)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["h"]),
                           helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
                           helper.make_node("MatMul", ["h", "Et"], ["logits"], name="head")],
                          "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", 40])],
                          [numpy_helper.from_array(e, "E")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model, e


def test_tied_head_through_a_transpose_is_quantized():
    """MatMul(h, Transpose(E)) with E also read by the embedding Gather: the head is quantized, E stays."""
    model, e = tied_graph(0)
    out, record = run_passes(model, [QuantizeBlockwise(bits=8, block_size=16, accuracy_level=0)])
    assert record[0]["stats"]["quantized"] == 1 and op_types(out) == ["Gather", "Cast", "MatMulNBits"]
    ids = np.array([[0, 5, 39]], np.int64)
    wq = dequantize_blocks(*quantize_blocks(e.T, 8, 16), 8, 32)
    np.testing.assert_allclose(run_unoptimised(out, {"ids": ids})[0], e[ids] @ wq, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias_shape,is_head", [((40,), True), ((1, 1, 40), True), ((3, 1, 40), False)])
def test_head_is_found_through_its_bias(bias_shape, is_head):
    """Phi-2's lm_head adds a bias before ``logits``: still the head (lowered at ``head_bits``), while an Add whose
    constant varies along another axis is not a bias and hides the head."""
    rng = np.random.default_rng(5)
    w1, wh = (rng.standard_normal(s).astype(np.float32) for s in ((64, 64), (64, 40)))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"], name="block"),
                           helper.make_node("MatMul", ["h", "wh"], ["z"], name="head"),
                           helper.make_node("Add", ["z", "b"], ["logits"], name="bias")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "S", 64])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, "S", 40])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(wh, "wh"),
                           numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, head_bits=8, accuracy_level=0)])
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert bits == ([4, 8] if is_head else [4, 4])
    assert record[0]["stats"]["head"] == ("int8" if is_head else None)


# --- INT4: grids, formats, codes handed in, act-order, the DequantizeLinear (TensorRT) form ---------------------


@pytest.mark.parametrize("grid", ["signed", "positive", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_every_grid_round_trips_and_bounds_the_error(grid, bits):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((70, 6)).astype(np.float32)
    q = rtn(w, bits, 32, grid)
    back = q.dequantize()
    assert q.codes.max() < 2 ** bits and (q.zeros is None) == (grid != "asym")
    step = np.repeat(np.abs(q.scales), 32, axis=1)[:, :70].T
    assert np.all(np.abs(back - w) <= step + 1e-6)
    if grid == "positive":
        assert np.all(q.scales > 0)  # TensorRT's DequantizeLinear takes positive scales
    np.testing.assert_array_equal(unpack(pack(q.codes, bits), bits), q.codes)


def test_zero_points_pack_two_per_byte_with_odd_block_counts():
    z = np.arange(15, dtype=np.uint8).reshape(5, 3) % 16
    packed = pack_zeros(z, 4)
    assert packed.shape == (5, 2)
    np.testing.assert_array_equal(unpack(packed, 4)[:, :3], z)
    assert pack_zeros(z, 8) is z


def int4_values(t) -> np.ndarray:
    """Signed INT4 initializer -> int8 values, read straight from the format description (two's complement
    nibbles, low nibble first, row-major)."""
    raw = np.frombuffer(t.raw_data, np.uint8)
    nib = np.empty(raw.size * 2, np.uint8)
    nib[0::2], nib[1::2] = raw & 0x0F, raw >> 4
    vals = nib[:int(np.prod(t.dims))].astype(np.int8)
    return np.where(vals > 7, vals - 16, vals).reshape(tuple(t.dims))


def test_int4_initializer_matches_the_format_description():
    vals = np.array([[-8, 7, 0], [1, -1, 5]], np.int8)
    t = int_tensor("w", vals, 4)
    assert t.data_type == TensorProto.INT4
    np.testing.assert_array_equal(int4_values(t), vals)
    np.testing.assert_array_equal(numpy_helper.to_array(t).astype(np.int8), vals)  # onnx reads the same values


def fake_quantized_layer(x: np.ndarray, q: Quantized) -> np.ndarray:
    """The torch layer a solver's codes stand for: a Linear with the dequantized weight."""
    import torch

    lin = torch.nn.Linear(q.k, q.codes.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(q.dequantize().T))
        return lin(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("form,grid", [("matmulnbits", "signed"), ("matmulnbits", "asym"), ("dequantize", "positive")])
@pytest.mark.parametrize("act_order", [False, True])
def test_lowered_graph_equals_the_fake_quantized_layer(form, grid, act_order):
    """Codes handed in (as GPTQ hands them) are packed as they are: MatMulNBits (accuracy level 0) and blocked
    DequantizeLinear + MatMul equal the fake-quantized torch layer to 1e-5; act-order reads inputs through a Gather."""
    rng = np.random.default_rng(4)
    k, n = 80, 48  # K not a multiple of the block: padded
    model, w = matmul_graph(k=k, n=n)
    model.opset_import[0].version = 21
    q = rtn(w, 4, 16, grid)
    if act_order:
        perm = rng.permutation(k)
        p = rtn(w[perm], 4, 16, grid)
        q = Quantized(p.codes, p.scales, p.zeros, 4, 16, k, perm)
    book = Codebook()
    book.add(w, q)
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, accuracy_level=0, grid=grid,
                                                       given=book, form=form)])
    stats = record[0]["stats"]
    assert stats["given"] == 1 and stats["act_order_gathers"] == int(act_order)
    ops = op_types(out)
    assert ("MatMulNBits" in ops) == (form == "matmulnbits") and ("DequantizeLinear" in ops) == (form == "dequantize")
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    y_t = rng.standard_normal((2, n, 3)).astype(np.float32)
    h = np.maximum(fake_quantized_layer(x, q), 0)
    got = run_unoptimised(out, {"x": x, "y_t": y_t})[0]
    np.testing.assert_allclose(got, h @ y_t, rtol=1e-5, atol=1e-5 * np.abs(h @ y_t).max())


def test_codebook_finds_codes_inside_a_packed_weight():
    """Q, K and V solved separately, then packed by the attention fusion along N: found and concatenated."""
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal((64, n)).astype(np.float32) for n in (32, 16, 16)]
    book = Codebook()
    qs = [rtn(p, 4, 32) for p in parts]
    for p, q in zip(parts, qs):
        book.add(p, q)
    packed = np.concatenate(parts, 1)
    got = book.find(packed)
    np.testing.assert_array_equal(got.dequantize(), np.concatenate([q.dequantize() for q in qs], 1))
    assert book.find(packed[:, ::-1].copy()) is None and book.find(parts[0] + 1) is None


def test_embedding_table_and_head_precision():
    """The embedding Gather's table -> GatherBlockQuantized; the tied head kept FP32 when asked (head_bits 0)."""
    model, e = tied_graph(6)
    ids = np.array([[0, 5, 39]], np.int64)
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, head_bits=0, embedding_bits=8,
                                                       accuracy_level=0)])
    assert sorted(op_types(out)) == ["GatherBlockQuantized", "MatMul", "Transpose"]
    assert record[0]["stats"]["head"] == "fp32" and record[0]["stats"]["embedding"] == "int8"
    table = rtn(e.T, 8, 32).dequantize().T
    np.testing.assert_allclose(run_unoptimised(out, {"ids": ids})[0], table[ids] @ e.T, rtol=1e-5, atol=1e-4)
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, head_bits=8, embedding_bits=4,
                                                       accuracy_level=0)])
    assert sorted(op_types(out)) == ["Cast", "GatherBlockQuantized", "MatMulNBits"] and record[0]["stats"]["head"] == "int8"
    table = rtn(e.T, 4, 32).dequantize().T
    np.testing.assert_allclose(run_unoptimised(out, {"ids": ids})[0], table[ids] @ rtn(e.T, 8, 32).dequantize(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("via, found", [("Reshape", True), ("Add", False)])
def test_embedding_lookup_of_reshaped_ids_is_the_table(via, found):
    """Ids only reshaped before the lookup (GPT-2 and OPT flatten them to (-1, length)) are still the input's ids:
    the table is quantized; ids computed from the input (here shifted by one) are not a token lookup: left FP32."""
    e = np.random.default_rng(2).standard_normal((40, 32)).astype(np.float32)
    make = (helper.make_node("Reshape", ["ids", "shape"], ["ids2"]) if via == "Reshape"
            else helper.make_node("Add", ["ids", "one"], ["ids2"]))
    g = helper.make_graph([make, helper.make_node("Gather", ["E", "ids2"], ["h"]),
                           helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0)],
                          "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(e, "E"), numpy_helper.from_array(np.array([-1, 3], np.int64), "shape"),
                           numpy_helper.from_array(np.array(1, np.int64), "one")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, embedding_bits=8, accuracy_level=0)])
    assert ("GatherBlockQuantized" in op_types(out)) == found
    assert record[0]["stats"]["embedding"] == ("int8" if found else None)
    ids = np.array([[0, 5, 38]], np.int64)
    table = rtn(e.T, 8, 32).dequantize().T if found else e
    looked_up = ids.reshape(-1, 3) if found else ids + 1
    np.testing.assert_allclose(run_unoptimised(out, {"ids": ids})[0], table[looked_up].sum(), rtol=1e-5, atol=1e-4)
    if not found:
        assert out.SerializeToString() == model.SerializeToString()


def test_dequantize_form_needs_opset_21_and_symmetric_codes():
    model, w = matmul_graph()
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, grid="positive", form="dequantize")])
    assert record[0]["modified"] is False and "opset 21" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()
    with pytest.raises(ValueError, match="positive"):
        QuantizeBlockwise(bits=4, grid="asym", form="dequantize")


@pytest.mark.parametrize("act_order,asym", [(False, False), (True, True)])
def test_weight_over_part_bytes_is_lowered_in_parts(monkeypatch, act_order, asym):
    """A weight whose packed codes exceed PART_BYTES becomes MatMulNBits over slices of its outputs, concatenated:
    the same function as one MatMulNBits (each part's initializers are slices of the whole's), and logits-to-keep
    still slices the hidden states all parts read."""
    from kiln.passes import quantize_nbits
    from kiln.passes.logits_to_keep import INPUT, LogitsToKeep

    rng = np.random.default_rng(5)
    k, n = 64, 50
    w = rng.standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", n])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    q = rtn(w, 4, 16, "asym" if asym else "signed")
    if act_order:
        perm = rng.permutation(k)
        p = rtn(w[perm], 4, 16, "asym" if asym else "signed")
        q = Quantized(p.codes, p.scales, p.zeros, 4, 16, k, perm)
    book = Codebook()
    book.add(w, q)
    make = lambda: QuantizeBlockwise(bits=4, block_size=16, accuracy_level=0, given=book,  # noqa: E731
                                     grid="asym" if asym else "signed")
    whole, _ = run_passes(model, [make()])
    monkeypatch.setattr(quantize_nbits, "PART_BYTES", -(-q.codes.size // 2 // 3))  # three parts (17, 17, 16 outputs)
    parts, record = run_passes(model, [make(), LogitsToKeep()])
    assert record[0]["stats"]["split"] == 1 and record[0]["stats"]["quantized"] == 1
    assert op_types(parts).count("MatMulNBits") == 3 and "Concat" in op_types(parts)
    assert record[1]["stats"] == {"sliced": 1}
    x = rng.standard_normal((2, 5, k)).astype(np.float32)
    want = run_unoptimised(whole, {"x": x})[0]
    np.testing.assert_array_equal(run_unoptimised(parts, {"x": x, INPUT: np.array(0, np.int64)})[0], want)
    np.testing.assert_array_equal(run_unoptimised(parts, {"x": x, INPUT: np.array(2, np.int64)})[0], want[:, -2:])


def test_codebook_on_disk_gives_back_what_it_was_given(tmp_path):
    """A directory-backed codebook (streamed GPTQ, streamed imports) writes each entry (two 4-bit codes a byte) and
    reads it back exactly; found by the weight, whole or packed along N."""
    rng = np.random.default_rng(6)
    w1, w2 = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((64, 16)).astype(np.float32)
    q1 = rtn(w1, 4, 16, "asym")
    p = rtn(w2[rng.permutation(64)], 4, 32, "signed")
    q2 = Quantized(p.codes, p.scales, None, 4, 32, 64, rng.permutation(64))
    book = Codebook(tmp_path)
    key = book.add(w1, q1)
    book.add(w2, q2)
    assert len(list(tmp_path.iterdir())) == 2
    with np.load(tmp_path / f"{key}.npz") as stored:
        assert stored["codes"].nbytes * 2 == q1.codes.nbytes
    for w, q in ((w1, q1), (w2, q2)):
        got = book.find(w)
        for field in ("codes", "scales", "zeros", "perm"):
            a, b = getattr(got, field), getattr(q, field)
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))
        assert (got.bits, got.block_size, got.k) == (q.bits, q.block_size, q.k)
    q3 = rtn(w2, 4, 16, "asym")
    book.add(w2[:, :8].copy(), Quantized(q3.codes[:8], q3.scales[:8], q3.zeros[:8], 4, 16, 64))
    book.add(w2[:, 8:].copy(), Quantized(q3.codes[8:], q3.scales[8:], q3.zeros[8:], 4, 16, 64))
    packed = book.find(np.concatenate([w2[:, :8], w2[:, 8:]], 1) + 0)  # Q/K/V-style: side by side
    assert packed is not None


@pytest.mark.parametrize("pass_", [QuantizeBlockwise(bits=4, block_size=32), QuantizeBlockwise(bits=8)],
                         ids=["int4", "int8"])
def test_mixture_of_experts_router_stays_fp32(pass_):
    """A MatMul whose logits reach a TopK (through Softmax) picks experts: it is left as it was, while an expert's
    MatMul of the same shape beside it is quantized."""
    rng = np.random.default_rng(0)
    router, expert = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2))
    nodes = [helper.make_node("MatMul", ["x", "router"], ["logits"], name="router"),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["top", "picked"], axis=-1),
             helper.make_node("MatMul", ["x", "expert"], ["h"], name="expert")]
    g = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 64])],
                          [helper.make_tensor_value_info("top", TensorProto.FLOAT, ["T", 2]),
                           helper.make_tensor_value_info("picked", TensorProto.INT64, ["T", 2]),
                           helper.make_tensor_value_info("h", TensorProto.FLOAT, ["T", 32])],
                          [numpy_helper.from_array(router, "router"), numpy_helper.from_array(expert, "expert"),
                           numpy_helper.from_array(np.array([2], np.int64), "k")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    out, record = run_passes(model, [pass_])
    assert record[0]["stats"]["quantized"] == 1 and op_types(out).count("MatMulNBits") == 1
    kept = next(n for n in out.graph.node if n.name == "router")
    assert kept.op_type == "MatMul" and list(kept.input) == ["x", "router"]
    x = rng.standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_array_equal(run_unoptimised(out, {"x": x})[1], np.argsort(-(x @ router), axis=-1)[:, :2])


def test_tied_table_is_stored_once_at_8_bits():
    """An 8-bit tied head and an 8-bit embedding get the same codes (round-to-nearest of the same table, same block):
    the embedding gathers the head's rows, (code - 128) * scale, instead of a GatherBlockQuantized copy; exactly
    what the copy computed, with one table's bytes fewer."""
    model, e = tied_graph(6)
    ids = np.array([[0, 5, 39], [7, 7, 1]], np.int64)
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, head_bits=8, embedding_bits=8,
                                                       accuracy_level=0)])
    assert "GatherBlockQuantized" not in op_types(out) and record[0]["stats"]["embedding_shared"] == 1
    mm = next(n for n in out.graph.node if n.op_type == "MatMulNBits")
    gathers = [n for n in out.graph.node if n.op_type == "Gather"]
    casts = {n.output[0]: n.input[0] for n in out.graph.node if n.op_type == "Cast"}
    assert casts[mm.input[2]] in {t.name for t in out.graph.initializer}  # the head's FP16 scales, cast at load
    # the head's codes and (the FP32 cast of) the same FP16 scales initializer
    assert {casts.get(n.input[0], n.input[0]) for n in gathers} == {mm.input[1], casts[mm.input[2]]}
    table = rtn(e.T, 8, 32).dequantize().T
    np.testing.assert_allclose(run_unoptimised(out, {"ids": ids})[0], table[ids] @ table.T, rtol=1e-5, atol=1e-4)
    copy, _ = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, head_bits=8, embedding_bits=8,
                                                   accuracy_level=0, grid="asym")])  # asym head: not shared
    assert "GatherBlockQuantized" in op_types(copy)
    size = lambda m: sum(len(t.raw_data) for t in m.graph.initializer)  # noqa: E731
    assert size(copy) - size(out) >= e.size  # the 8-bit copy of the table (e.size bytes) is gone


@pytest.mark.parametrize("bits,block,grid,expected", [(4, 32, "signed", 4 + 16 / 32), (4, 32, "asym", 4 + 1 + 4 / 32),
                                                      (8, 128, "signed", 8 + 16 / 128)])
def test_bits_per_weight_counts_codes_scales_and_zero_points(bits, block, grid, expected):
    """Scales are FP16 (16 bits a block) when FP16 holds every one (the asym grid keeps FP32: 32 bits a block); a
    weight with a scale below FP16's normal range keeps FP32 scales, with its codes and output unchanged."""
    model, _ = matmul_graph(k=256, n=48)
    _, record = run_passes(model, [QuantizeBlockwise(bits=bits, block_size=block, grid=grid, accuracy_level=0)])
    assert record[0]["stats"]["bits_per_weight"] == pytest.approx(expected)
    tiny = onnx.ModelProto()
    tiny.CopyFrom(model)
    w = next(t for t in tiny.graph.initializer if len(t.dims) == 2)
    small = numpy_helper.to_array(w).copy()
    small[:, 0] *= 1e-6  # one output column's scales under 2^-14
    w.CopyFrom(numpy_helper.from_array(small, w.name))
    out, record = run_passes(tiny, [QuantizeBlockwise(bits=bits, block_size=block, grid=grid, accuracy_level=0)])
    assert record[0]["stats"]["bits_per_weight"] == pytest.approx(expected + (16 / block if grid != "asym" else 0))
    assert "Cast" not in op_types(out)
    rng = np.random.default_rng(1)
    x, y_t = rng.standard_normal((1, 3, 256)).astype(np.float32), rng.standard_normal((1, 48, 3)).astype(np.float32)
    want = np.maximum(x @ rtn(small, bits, block, grid).dequantize(), 0) @ y_t
    np.testing.assert_allclose(run_unoptimised(out, {"x": x, "y_t": y_t})[0], want, rtol=1e-4, atol=1e-5)


def test_a_table_not_a_whole_number_of_blocks_wide_stays_fp32_and_the_stats_name_each_quantized_table():
    """Two tables read at the ids (a token embedding and a per-layer embedding beside it, as Gemma 3n / 4 have):
    each one a whole number of blocks wide is quantized and named in the stats (the fake-quantized reference rounds
    exactly those); one that is not stays FP32 with the reason, since its gathered rows would come back padded to
    whole blocks (a Reshape after it failed at run time before)."""
    rng = np.random.default_rng(3)
    e, p = rng.standard_normal((40, 32)).astype(np.float32), rng.standard_normal((40, 48)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("Gather", ["P", "ids"], ["q"])],
                          "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", 32]),
                           helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", "S", 48])],
                          [numpy_helper.from_array(e, "E"), numpy_helper.from_array(p, "P")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    out, record = run_passes(model, [QuantizeBlockwise(bits=4, block_size=16, embedding_bits=8, head_block_size=32,
                                                       accuracy_level=0)])
    stats = record[0]["stats"]
    assert stats["embedding_tables"] == [["E", 40, 32]]
    assert any("48 columns" in s["why"] for s in record[0]["skipped"])
    ids = np.array([[0, 5, 38]], np.int64)
    h, q = run_unoptimised(out, {"ids": ids})
    np.testing.assert_allclose(h, rtn(e.T, 8, 32).dequantize().T[ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(q, p[ids])
