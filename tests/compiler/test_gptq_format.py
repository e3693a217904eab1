"""GPTQ checkpoints in and out: packing round trips, checkpoints hand-packed in the test from the format
descriptions (AutoGPTQ v1/v2, AutoAWQ GEMM, compressed-tensors pack-quantized) read back to the same weights, kiln's export
imported again with the same codes, and bad checkpoints as one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import fast_options, packed_codes
from safetensors.numpy import save_file

from kiln.cli import main
from kiln.compiler import compile
from kiln.compiler.load import load_checkpoint
from kiln.compiler.quantize.gptq_format import from_gptq, pack_int32, to_gptq, unpack_int32
from kiln.passes.codes import Quantized, rtn

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_int32_packing_round_trips(bits, axis):
    rng = np.random.default_rng(0)
    v = rng.integers(0, 1 << bits, size=(16, 24), dtype=np.uint8)
    words = pack_int32(v, bits, axis)
    assert words.dtype == np.int32 and words.shape[axis] == v.shape[axis] * bits // 32
    np.testing.assert_array_equal(unpack_int32(words, bits, axis), v)


@pytest.mark.parametrize("grid", ["signed", "asym"])
@pytest.mark.parametrize("act_order", [False, True])
def test_kernel_codes_through_gptq_tensors_and_back(grid, act_order):
    rng = np.random.default_rng(1)
    k, n = 64, 32
    w = rng.standard_normal((k, n)).astype(np.float32)
    perm = rng.permutation(k) if act_order else None
    q = rtn(w if perm is None else w[perm], 4, 16, grid)
    q = Quantized(q.codes, q.scales.astype(np.float16).astype(np.float32), q.zeros, 4, 16, k, perm)
    back = from_gptq(to_gptq(q), 4, 16, grid != "asym", True, "test")
    # g_idx names each input's group, not its place inside the group: under act-order the codes come back in
    # input order within each group (the same weights); the groups and their codes are the same
    np.testing.assert_array_equal(np.sort(back.codes, -1), np.sort(q.codes, -1))
    if not act_order:
        np.testing.assert_array_equal(back.codes, q.codes)
    np.testing.assert_array_equal(back.scales, q.scales)
    np.testing.assert_array_equal(back.dequantize(), q.dequantize())
    assert (back.perm is None) == (not act_order)


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}"}


def hand_packed_gptq(tmp_path, checkpoints, v1=True, act_order=False, bits=4):
    """A GPTQ checkpoint written from the format description alone: q (K, N) in [0, 16), zero points z (G, N),
    scales s (G, N) fp16, g_idx (K,); W[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n]); qweight packs 8
    consecutive k of one n into an int32 (low nibble first), qzeros 8 consecutive n of one group, v1 storing z - 1."""
    rng = np.random.default_rng(2)
    src = checkpoints["llama"]
    model = load_checkpoint(src).model
    tensors = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    tensors.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    expected, orders = {}, {}
    gs = 16
    for name, m in linears(model).items():
        n_out, k = m.weight.shape
        groups = k // gs
        q = rng.integers(0, 16, size=(k, n_out))
        z = rng.integers(0, 16, size=(groups, n_out))
        s = (rng.random((groups, n_out)) * 0.02 + 0.001).astype(np.float16)
        g_idx = np.arange(k) // gs
        if act_order:  # one order per input width: Q, K and V share theirs, as GPTQ's shared Hessian gives
            g_idx = orders.setdefault(k, rng.permutation(g_idx))
        qweight = np.zeros((k // 8, n_out), np.uint32)
        for i in range(k):
            qweight[i // 8] |= (q[i].astype(np.uint32) & 0xF) << (4 * (i % 8))
        stored = (z - 1) & 0xF if v1 else z
        qzeros = np.zeros((groups, n_out // 8), np.uint32)
        for j in range(n_out):
            qzeros[:, j // 8] |= stored[:, j].astype(np.uint32) << (4 * (j % 8))
        tensors.pop(f"{name}.weight")
        tensors.update({f"{name}.qweight": qweight.view(np.int32), f"{name}.qzeros": qzeros.view(np.int32),
                        f"{name}.scales": s, f"{name}.g_idx": g_idx.astype(np.int32)})
        expected[name] = np.stack([s[g_idx[kk]].astype(np.float32) * (q[kk] - z[g_idx[kk]]) for kk in range(k)], 1)
    out = tmp_path / "gptq"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": gs, "desc_act": act_order,
                                  "sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            (out / f.name).write_bytes(f.read_bytes())
    return out, expected


@pytest.mark.parametrize("v1,act_order", [(True, False), (False, False), (True, True)], ids=["v1", "v2", "v1-desc-act"])
def test_hand_packed_gptq_reads_to_the_described_weights(tmp_path, checkpoints, v1, act_order):
    path, expected = hand_packed_gptq(tmp_path, checkpoints, v1, act_order)
    ckpt = load_checkpoint(path)
    assert ckpt.imported["format"] == f"gptq ({'v1' if v1 else 'v2'})" and ckpt.imported["layers"] == len(expected)
    got = linears(ckpt.model)
    for name, w in expected.items():
        np.testing.assert_allclose(got[name].weight.detach().numpy(), w, rtol=0, atol=1e-7)
        q = ckpt.codebook.find(np.ascontiguousarray(w.T))
        assert q is not None and q.zeros is not None and (q.perm is not None) == act_order


@pytest.mark.parametrize("fmt", ["gptq (v1)", "awq (gemm)"])
def test_hand_packed_checkpoint_compiles_with_its_own_codes(tmp_path, checkpoints, fmt):
    path, _ = (hand_packed_gptq(tmp_path, checkpoints, act_order=True) if fmt.startswith("gptq")
               else hand_packed_awq(tmp_path, checkpoints))
    out = compile(path, tmp_path / "art", fast_options())
    m = json.loads((out / "manifest.json").read_text())
    q = next(p for p in m["passes"] if p["name"] == "quantize-nbits")
    assert m["precision"] == "int4" and m["model"]["source"]["format"] == fmt
    assert q["int4"]["method"] == f"imported {fmt}" and q["stats"]["given"] == 2 * 5  # QKV packed per layer
    assert m["verification"]["status"] == "passed"


def in_two_shards(path):
    """The checkpoint's model.safetensors split into two shards with an index."""
    from safetensors.numpy import load_file

    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_streamed_import_reads_shard_by_shard_to_the_same_artifact(tmp_path, checkpoints, monkeypatch):
    """A sharded GPTQ checkpoint compiled with --stream: each Linear dequantized from its codes only when read, the
    codes kept in a directory-backed codebook; the artifact packs exactly the in-memory import's codes, verifies,
    and never held more than one layer plus the largest tensor of what it read."""
    from kiln.compiler import lazy

    path, expected = hand_packed_gptq(tmp_path, checkpoints, act_order=True)
    in_two_shards(path)
    made = []
    real_init = lazy.LazyWeights.__init__
    monkeypatch.setattr(lazy.LazyWeights, "__init__", lambda self, p: (real_init(self, p), made.append(self))[0])
    streamed = compile(path, tmp_path / "streamed", fast_options(stream=True))
    plain = compile(path, tmp_path / "plain", fast_options(stream=False))
    m = json.loads((streamed / "manifest.json").read_text())
    q = next(p for p in m["passes"] if p["name"] == "quantize-nbits")
    assert m["model"]["source"]["format"] == "gptq (v1)" and q["int4"]["method"] == "imported gptq (v1)"
    assert q["stats"]["given"] == 2 * 5 and m["verification"]["status"] == "passed"
    assert "layer by layer" in m["verification"]["reference"]
    assert packed_codes(streamed) == packed_codes(plain)
    ckpt = load_checkpoint(path, stream=True)
    for name, w in expected.items():
        np.testing.assert_allclose(ckpt.weights.numpy(f"{name}.weight"), w, rtol=0, atol=1e-7)
        assert f"{name}.qweight" not in ckpt.weights
    per_layer = max(sum(w.size * 4 for n, w in expected.items() if f".layers.{i}." in n) for i in range(2))
    largest = max(int(np.prod(e.shape)) * 4 for e in ckpt.weights.entries.values())
    assert max(w.peak_bytes for w in made if w.reads) <= 2 * per_layer + largest  # norms too; never the whole model


def test_compressed_tensors_pack_quantized(tmp_path, checkpoints):
    """llm-compressor's W4A16: weight_packed int32 (N, K / 8) along K, stored value = q + 8 for q in [-8, 8)."""
    rng = np.random.default_rng(3)
    src = checkpoints["llama"]
    model = load_checkpoint(src).model
    tensors = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    expected = {}
    for name, m in linears(model).items():
        n_out, k = m.weight.shape
        q = rng.integers(-8, 8, size=(n_out, k))
        s = (rng.random((n_out, k // 16)) * 0.02 + 0.001).astype(np.float16)
        packed = np.zeros((n_out, k // 8), np.uint32)
        for i in range(k):
            packed[:, i // 8] |= (q[:, i] + 8).astype(np.uint32) << (4 * (i % 8))
        tensors.pop(f"{name}.weight")
        tensors.update({f"{name}.weight_packed": packed.view(np.int32), f"{name}.weight_scale": s,
                        f"{name}.weight_shape": np.array([n_out, k], np.int64)})
        expected[name] = q * np.repeat(s.astype(np.float32), 16, axis=1)
    out = tmp_path / "ct"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 16}}}, "ignore": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(out)
    got = linears(ckpt.model)
    for name, w in expected.items():
        np.testing.assert_allclose(got[name].weight.detach().numpy(), w, rtol=0, atol=1e-7)
    assert ckpt.imported["format"] == "compressed-tensors pack-quantized"
    streamed = load_checkpoint(out, stream=True)  # read module by module instead
    assert streamed.imported == ckpt.imported
    for name, w in expected.items():
        np.testing.assert_allclose(streamed.weights.numpy(f"{name}.weight"), w, rtol=0, atol=1e-7)
        assert streamed.codebook.find(np.ascontiguousarray(w.T)) is not None


def hand_packed_awq(tmp_path, checkpoints, own_config=False):
    """An AutoAWQ GEMM checkpoint written from the format description alone: q (K, N) in [0, 16), zero points z (G, N)
    stored as they are, scales s (G, N) fp16, groups of 16 consecutive inputs; W[n, k] = s[k // 16, n] * (q[k, n] -
    z[k // 16, n]); qweight (K, N / 8) and qzeros (G, N / 8) pack 8 output columns per int32, value i of word c
    (bits 4i..4i+3) holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    rng = np.random.default_rng(5)
    src = checkpoints["llama"]
    model = load_checkpoint(src).model
    tensors = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    tensors.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    expected, gs = {}, 16

    def pack(values):  # (R, N) -> (R, N / 8), the interleaved order along N
        words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
        for c in range(words.shape[1]):
            for i in range(8):
                words[:, c] |= values[:, 8 * c + order[i]].astype(np.uint32) << (4 * i)
        return words.view(np.int32)

    for name, m in linears(model).items():
        n_out, k = m.weight.shape
        q = rng.integers(0, 16, size=(k, n_out))
        z = rng.integers(0, 16, size=(k // gs, n_out))
        s = (rng.random((k // gs, n_out)) * 0.02 + 0.001).astype(np.float16)
        tensors.pop(f"{name}.weight")
        tensors.update({f"{name}.qweight": pack(q), f"{name}.qzeros": pack(z), f"{name}.scales": s})
        expected[name] = (np.repeat(s.astype(np.float32), gs, 0) * (q - np.repeat(z, gs, 0))).T
    out = tmp_path / "awq"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if own_config:  # AutoAWQ's quant_config.json and its key names
        (out / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": gs, "w_bit": 4,
                                                           "version": "GEMM"}))
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True,
                                      "version": "gemm", "modules_to_not_convert": None}
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            (out / f.name).write_bytes(f.read_bytes())
    return out, expected


@pytest.mark.parametrize("own_config", [False, True], ids=["config.json", "quant_config.json"])
def test_hand_packed_awq_reads_to_the_described_weights(tmp_path, checkpoints, own_config):
    path, expected = hand_packed_awq(tmp_path, checkpoints, own_config)
    ckpt = load_checkpoint(path)
    assert ckpt.imported == {"format": "awq (gemm)", "bits": 4, "group_size": 16, "sym": False, "layers": len(expected)}
    got = linears(ckpt.model)
    for name, w in expected.items():
        np.testing.assert_allclose(got[name].weight.detach().numpy(), w, rtol=0, atol=1e-6)
        q = ckpt.codebook.find(np.ascontiguousarray(w.T))
        assert q is not None and q.zeros is not None and q.perm is None
    streamed = load_checkpoint(path, stream=True)  # module by module: the same weights and codes
    for name, w in expected.items():
        np.testing.assert_allclose(streamed.weights.numpy(f"{name}.weight"), w, rtol=0, atol=1e-6)
        assert streamed.codebook.find(np.ascontiguousarray(w.T)) is not None


def test_awq_pack_order_matters(tmp_path, checkpoints):
    """A planted bug: reading the words in plain order (GPTQ's) gives other weights, far beyond the 1e-6 bound."""
    from kiln.compiler.quantize import gptq_format

    path, expected = hand_packed_awq(tmp_path, checkpoints)
    name, w = next(iter(expected.items()))
    from safetensors.numpy import load_file

    t = {k.rsplit(".", 1)[1]: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith(name + ".")}
    good = gptq_format.from_awq(t, 4, 16, name).dequantize().T
    np.testing.assert_allclose(good, w, rtol=0, atol=1e-6)
    plain = gptq_format.AWQ_ORDER.copy()
    try:
        gptq_format.AWQ_ORDER[:] = np.arange(8)
        assert np.abs(gptq_format.from_awq(t, 4, 16, name).dequantize().T - w).max() > 1e-3
    finally:
        gptq_format.AWQ_ORDER[:] = plain


def test_export_then_import_gives_the_same_codes(tmp_path, checkpoints):
    out = tmp_path / "exported"
    assert main(["export-gptq", str(checkpoints["llama"]), "-o", str(out), "--group-size", "16", "-q"]) == 0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "gptq" and cfg["checkpoint_format"] == "gptq" and cfg["desc_act"] and cfg["sym"]
    assert json.loads((out / "quantize_config.json").read_text())["group_size"] == 16
    ckpt = load_checkpoint(out)
    assert ckpt.imported["layers"] == 2 * 7
    # the exported codes are kiln's: re-solving the original checkpoint gives them back bit for bit
    from kiln.compiler.facts import model_facts
    from kiln.compiler.options import int4_defaults
    from kiln.compiler.quantize.driver import QuantDriver

    src = load_checkpoint(checkpoints["llama"])
    options = int4_defaults(src.kind, fast_options(precision="int4", group_size=16, mixed_bits=False))
    driver = QuantDriver(src, model_facts(src), options, lambda m: None)  # export-gptq's recipe: one width
    driver.solve_gptq()
    for name, q in driver.named.items():
        mine = from_gptq(to_gptq(q), 4, 16, True, True, name)  # fp16 scales, as the checkpoint stores them
        assert any(np.array_equal(e.codes, mine.codes) and np.array_equal(e.scales, mine.scales)
                   for e in ckpt.codebook.whole.values()), name
        assert np.array_equal(np.sort(mine.codes, -1), np.sort(q.codes, -1))


def test_unsupported_quantized_checkpoints_are_one_line_errors(tmp_path, checkpoints, capsys):
    path, _ = hand_packed_gptq(tmp_path, checkpoints)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    code = main(["compile", str(path), "-o", str(tmp_path / "o1")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "3-bit" in err[-1] and not (tmp_path / "o1").exists()
    cfg["quantization_config"] = {"quant_method": "hqq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["compile", str(path), "-o", str(tmp_path / "o2")]) == 1
    assert "'hqq'" in capsys.readouterr().err
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemv"}
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["compile", str(path), "-o", str(tmp_path / "o4")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "version gemv" in err[-1] and "GEMM" in err[-1] and not (tmp_path / "o4").exists()
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 16, "checkpoint_format": "gptq"}
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["compile", str(path), "-o", str(tmp_path / "o3"), "--precision", "int8"]) == 2
    assert "already quantized" in capsys.readouterr().err and not (tmp_path / "o3").exists()
