"""Streamed compiles (``--stream``): the checkpoint read one tensor at a time, the graph traced without weights,
weights never inside a protobuf, the reference run one layer at a time; bad shards fail in one line."""

from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, fast_options, make_tokenizer, packed_codes

sys.path.insert(0, str(ROOT / "tools"))

import scale_checkpoints  # noqa: E402


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A 3-layer Llama in FP16 safetensors shards with an index (untied head), with a tokenizer."""
    root = tmp_path_factory.mktemp("scale")
    scale_checkpoints.SHARD_BYTES, old = 200_000, scale_checkpoints.SHARD_BYTES
    try:
        path = scale_checkpoints.make("tiny", root, grid=False)
    finally:
        scale_checkpoints.SHARD_BYTES = old
    make_tokenizer("decoder").save_pretrained(path)
    return path


def layer_and_largest_bytes(path: Path) -> tuple[int, int]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = json.loads((path / "config.json").read_text())
    shapes = dict(scale_checkpoints.tensors(cfg))
    assert set(shapes) == set(index)
    per_layer = [sum(int(np.prod(s)) * 4 for n, s in shapes.items() if n.startswith(f"model.layers.{i}."))
                 for i in range(cfg["num_hidden_layers"])]
    return max(per_layer), max(int(np.prod(s)) * 4 for s in shapes.values())


def test_streamed_fp32_matches_the_in_memory_artifact(sharded, tmp_path):
    import kiln.runtimes as kr
    from kiln.compiler import compile

    streamed = compile(sharded, tmp_path / "streamed", fast_options(stream=True))
    plain = compile(sharded, tmp_path / "plain", fast_options(stream=False))
    m = json.loads((streamed / "manifest.json").read_text())
    v = m["verification"]
    assert v["status"] == "passed" and "layer by layer" in v["reference"]
    assert v["generation"]["tokens_identical"] and "teacher-forced" in v["generation"]["reference"]
    assert v["summary"]["logits"]["max_abs"] < 1e-4
    # batch 1 and continuous batching's rows are verified, and the canary recorded, as in memory
    assert v["generation_batch_1"]["tokens_identical"] and v["rows"]["rows"] == [1, 2, 4, 8]
    assert [e["name"] for e in m["canary"]["entries"]] == ["decode_1", "decode_rows", "rows"]
    ids = np.random.default_rng(1).integers(0, 512, (2, 19))
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    with kr.load(streamed) as a, kr.load(plain) as b:
        assert a.canary.passed and a.canary.rows_agree
        got, want = a.run(feeds)["logits"], b.run(feeds)["logits"]
        assert np.abs(got - want)[mask.astype(bool)].max() < 1e-5
        prompt = [[5, 9, 11, 3], [7, 8]]
        assert np.array_equal(a.generate(prompt, max_new_tokens=8), b.generate(prompt, max_new_tokens=8))
    # the same passes fired: streaming changes where the weights are, not the graph
    assert [p["stats"] for p in m["passes"]] == \
        [p["stats"] for p in json.loads((plain / "manifest.json").read_text())["passes"]]


def test_at_most_one_layer_and_the_largest_tensor_are_ever_in_memory(sharded, tmp_path, monkeypatch):
    """Every FP32 tensor read from the checkpoint is counted from its read until nothing references it; the peak
    over the whole compile (trace, weights written, passes, reference) is one layer plus the largest tensor. And no
    protobuf a pass sees carries weights: every initializer over 1 KiB is a reference into external data."""
    from kiln.compiler import compile, lazy
    from kiln.passes import base

    made: list[lazy.LazyWeights] = []
    real_init = lazy.LazyWeights.__init__

    def spy_init(self, path):
        real_init(self, path)
        made.append(self)

    inline: list[int] = []
    real_check = base._check

    def spy_check(model):
        inline.append(sum(len(t.raw_data) for t in model.graph.initializer))
        real_check(model)

    monkeypatch.setattr(lazy.LazyWeights, "__init__", spy_init)
    monkeypatch.setattr(base, "_check", spy_check)
    out = compile(sharded, tmp_path / "out", fast_options(stream=True))
    layer, largest = layer_and_largest_bytes(sharded)
    weights = [w for w in made if w.reads]
    assert weights and max(w.peak_bytes for w in weights) <= layer + largest
    assert all(w.live_bytes == 0 for w in weights)  # nothing read is still held
    total = sum(int(np.prod(s)) * 4 for _, s in scale_checkpoints.tensors(json.loads((sharded / "config.json").read_text())))
    assert inline and max(inline) < 64 << 10 < total  # the passes' protobufs hold shapes and scalars only

    import onnx

    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer if t.ByteSize() > 2048)
    # one data file; the spill file and the traced graph's data are gone
    assert not [p.name for p in out.iterdir() if p.name.startswith(("spill", "kiln-")) or p.name.endswith(".kiln-new")]
    assert [p.name for p in out.iterdir() if ".onnx" in p.name] == ["model.onnx", "model.onnx.data"] or \
        sorted(p.name for p in out.iterdir() if ".onnx" in p.name) == ["model.onnx", "model.onnx.data"]


def test_no_protobuf_ever_holds_the_weights(sharded, tmp_path, monkeypatch):
    """Protobuf's 2 GB limit, lowered to half the checkpoint's FP32 weights (a graph's structure alone is a third of
    that for this 3-layer model): no model kiln serializes during a streamed INT4 compile (trace, passes, checker,
    quantizer, verification) reaches it, and the artifact verifies; the in-memory compile of the same checkpoint
    breaks it, as the 1.1B model broke the real limit."""
    import onnx

    from kiln.compiler import compile

    limit = sum(int(np.prod(s)) * 4 for _, s in scale_checkpoints.tensors(
        json.loads((sharded / "config.json").read_text()))) // 2
    real = onnx.ModelProto.SerializeToString
    largest = [0]

    def limited(self, *args, **kwargs):
        data = real(self, *args, **kwargs)
        largest[0] = max(largest[0], len(data))
        if len(data) > limit:
            raise ValueError(f"Failed to serialize proto: {len(data)} bytes, over the lowered limit of {limit}")
        return data

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", limited)
    out = compile(sharded, tmp_path / "streamed", fast_options(stream=True, precision="int4", quant_method="rtn"))
    assert json.loads((out / "report.json").read_text())["passed"] and 0 < largest[0] <= limit
    with pytest.raises(Exception, match="Failed to serialize proto"):
        compile(sharded, tmp_path / "plain", fast_options(stream=False))
    assert not (tmp_path / "plain").exists()


def test_streamed_int4_codes_are_verified(sharded, tmp_path):
    from kiln.compiler import compile

    out = compile(sharded, tmp_path / "int4", fast_options(stream=True, precision="int4", quant_method="rtn"))
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["codes"]["passed"]
    assert report["codes"]["summary"]["logits"]["max_abs"] < 1e-4  # the packed kernel computes the codes
    assert report["generation"]["passed"] and report["generation_1"]["passed"] and report["rows"]["passed"]
    import kiln.runtimes as kr

    with kr.load(out) as model:  # the canary: the codes' reference, bounds measured on the shipped graph
        assert json.loads((out / "manifest.json").read_text())["canary"]["reference"] == "codes"
        assert model.canary.passed
    sizes = {p.name: p.stat().st_size for p in out.iterdir()}
    assert sizes["model.onnx.data"] < 0.45 * layer_and_largest_bytes(sharded)[0] * 3 + 2 * 512 * 64 * 4


def test_streamed_gptq_solves_what_the_in_memory_gptq_solves(sharded, tmp_path, monkeypatch):
    """GPTQ layer by layer from the checkpoint (FP32 calibration forward) writes the same codes as GPTQ on the whole
    model, with the lm_head solved too; the codes live on disk while the compile runs; the artifact is verified
    against the reference computing with those codes. The peak of weights read stays one layer plus the largest."""
    from kiln.compiler import compile, lazy
    from kiln.compiler.quantize import gptq
    from kiln.passes import codes

    import torch

    monkeypatch.setattr(gptq, "calibration_dtype", lambda: torch.float32)
    made: list[lazy.LazyWeights] = []
    real_init = lazy.LazyWeights.__init__
    monkeypatch.setattr(lazy.LazyWeights, "__init__", lambda self, path: (real_init(self, path), made.append(self))[0])
    stored: list[Path] = []
    real_save = codes._save
    monkeypatch.setattr(codes, "_save", lambda q, path: stored.append(real_save(q, path)) or path)
    opts = dict(precision="int4", gptq_windows=4, gptq_window=32, lm_head="int4")
    streamed = compile(sharded, tmp_path / "streamed", fast_options(stream=True, **opts))
    plain = compile(sharded, tmp_path / "plain", fast_options(stream=False, **opts))
    assert len(stored) == 7 * 3 + 1  # q, k, v, o, gate, up, down per layer; the head
    assert not any(p.exists() for p in stored)  # the codebook's scratch directory is gone with the compile
    m = json.loads((streamed / "manifest.json").read_text())
    q = next(p for p in m["passes"] if p["name"] == "quantize-nbits")
    assert q["int4"]["method"] == "gptq" and q["int4"]["gptq"]["streamed"]
    assert q["stats"]["given"] == 5 * 3 + 1  # every weight from the solver: QKV packed, o, gate, up, down; the head
    report = json.loads((streamed / "report.json").read_text())
    assert report["passed"] and report["codes"]["summary"]["logits"]["max_abs"] < 1e-4
    assert report["generation"]["passed"]
    assert packed_codes(streamed) == packed_codes(plain)
    layer, largest = layer_and_largest_bytes(sharded)
    weights = [w for w in made if w.reads]
    assert weights and max(w.peak_bytes for w in weights) <= layer + largest


def test_planted_reference_bug_fails(sharded, tmp_path, monkeypatch):
    """The streamed reference is a real reference: one layer left out of it fails FP32 parity."""
    from torch import nn

    from kiln.compiler import compile
    from kiln.compiler.verify import streamed
    from kiln.errors import ParityError

    real = streamed.lazy.layer_stack

    def short(shell):
        layers, name = real(shell)
        return nn.ModuleList(list(layers)[:-1]), name

    monkeypatch.setattr(streamed.lazy, "layer_stack", short)
    with pytest.raises(ParityError, match="max abs error"):
        compile(sharded, tmp_path / "bad", fast_options(stream=True))
    assert not (tmp_path / "bad").exists()


def test_planted_codes_bug_fails(sharded, tmp_path, monkeypatch):
    """One Linear the reference does not quantize (the artifact does): the codes check catches it."""
    from kiln.compiler import compile
    from kiln.compiler.quantize import driver as driver_lib
    from kiln.errors import ParityError

    real = driver_lib.QuantDriver.codes_transform

    def planted(self):
        transform = real(self)
        return lambda name, value: value if name.endswith("layers.1.mlp.down_proj.weight") else transform(name, value)

    monkeypatch.setattr(driver_lib.QuantDriver, "codes_transform", planted)
    with pytest.raises(ParityError, match="fake-quantized"):
        compile(sharded, tmp_path / "bad", fast_options(stream=True, precision="int4", quant_method="rtn"))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def run_cli(args: list[str], capsys) -> tuple[int, list[str]]:
    from kiln.cli import main

    code = main(args)
    return code, [line for line in capsys.readouterr().err.splitlines() if line]


@pytest.mark.parametrize("damage, message", [
    ("missing shard", "lacks shard"),
    ("truncated shard", "truncated"),
    ("index names a tensor no shard has", "does not hold it"),
])
def test_bad_shards_are_one_line_with_nothing_written(sharded, tmp_path, capsys, damage, message):
    ckpt = copy_checkpoint(sharded, tmp_path / "ckpt")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    if damage == "missing shard":
        shards[-1].unlink()
    elif damage == "truncated shard":
        with open(shards[0], "r+b") as fh:
            fh.truncate(shards[0].stat().st_size - 1000)
    else:
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shards[0].name
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    code, err = run_cli(["compile", str(ckpt), "-o", str(out), "-q", "--stream", "--threads", "1"], capsys)
    assert code == 1 and len(err) == 1 and message in err[0] and str(ckpt) in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.kiln-*"))


def test_full_disk_while_streaming_weights_is_one_line(sharded, tmp_path, capsys, monkeypatch):
    import onnx_ir

    def full(model, path, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".data")

    monkeypatch.setattr(onnx_ir, "save", full)
    out = tmp_path / "out"
    code, err = run_cli(["compile", str(sharded), "-o", str(out), "-q", "--stream", "--threads", "1"], capsys)
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0] and "nothing was written" in err[0]
    assert not out.exists() and not list(tmp_path.glob(".out.kiln-*"))


def test_stream_refuses_what_it_cannot_stream(checkpoints, tmp_path, capsys):
    from conftest import save_checkpoint

    t5 = save_checkpoint(tmp_path / "t5", "t5", "text2text")
    capsys.readouterr()  # the checkpoint writer's progress bar
    code, err = run_cli(["compile", str(t5), "-o", str(tmp_path / "o"), "-q", "--stream"], capsys)
    assert code == 2 and len(err) == 1 and "encoder-decoders are not streamed yet" in err[0]
    assert "without --stream" in err[0] and not (tmp_path / "o").exists()
    code, err = run_cli(["compile", str(checkpoints["llama"]), "-o", str(tmp_path / "o"), "-q", "--stream",
                         "--precision", "int8", "--static"], capsys)
    assert code == 2 and len(err) == 1 and "int8 with these settings is not streamed yet" in err[0]


def test_streamed_int8_splits_the_outliers_the_in_memory_compile_splits(sharded, tmp_path):
    """Dynamic INT8 with outlier splitting: a streamed compile measures its activation statistics layer by layer in
    torch (no FP32 graph in a session) and splits the same channels as the in-memory compile, whose statistics come
    from ONNX Runtime over the FP32 graph. Two outlier channels are planted through the norms' weights."""
    from safetensors.numpy import load_file, save_file

    from kiln.compiler import compile

    ckpt = tmp_path / "outliers"
    shutil.copytree(sharded, ckpt)
    planted = {"model.layers.0.input_layernorm.weight": 5, "model.layers.1.post_attention_layernorm.weight": 7}
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if planted.keys() & tensors.keys():
            for name, channel in planted.items():
                if name in tensors:
                    tensors[name][channel] *= 40
            save_file(tensors, str(shard), metadata={"format": "pt"})
    splits = []
    for stream in (True, False):
        out = compile(ckpt, tmp_path / f"int8-{stream}", fast_options(stream=stream, precision="int8"))
        m = json.loads((out / "manifest.json").read_text())
        assert m["verification"]["status"] == "passed"
        q = next(p for p in m["passes"] if p["name"] == "quantize-nbits")
        assert q["stats"]["quantized"] >= 5 * 3 + 1 and q["stats"]["bits"] == 8
        splits.append(next(p["stats"] for p in m["passes"] if p["name"] == "split-outliers"))
    assert splits[0] == splits[1] and splits[0]["activations"] >= 2 and splits[0]["channels"] >= 2


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_tied_head_streams(tmp_path, precision):
    """A tied lm_head (one checkpoint tensor for the table and the head, quantized apart at INT4) streams and
    verifies; the tied table is stored once."""
    from kiln.compiler import compile

    ckpt = scale_checkpoints.make("tiny-tied", tmp_path, grid=False)
    assert "lm_head.weight" not in json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    extra = dict(quant_method="rtn") if precision == "int4" else {}
    out = compile(ckpt, tmp_path / "tied", fast_options(stream=True, precision=precision, **extra))
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["generation"]["tokens_identical"]
    if precision == "int4":
        assert report["codes"]["summary"]["logits"]["max_abs"] < 1e-4
    else:
        assert (out / "model.onnx.data").stat().st_size < 1.1 * sum(
            int(np.prod(s)) * 4 for _, s in scale_checkpoints.tensors(scale_checkpoints.SHAPES["tiny-tied"]))


@pytest.mark.parametrize("family, precision", [("bert", "fp32"), ("roberta", "fp32"), ("distilbert", "fp32"),
                                               ("sentence", "int8"), ("bert", "int4")])
def test_encoders_stream(checkpoints, sentence_checkpoint, tmp_path, monkeypatch, family, precision):
    """Encoders go through the streamed path too (position and type tables, embedding norm and pooler outside the
    layer stack; feature extraction with pooling, sequence and token classification): the streamed artifact
    verifies layer by layer and computes what the in-memory one computes, with the same passes fired. INT4 is
    the default GPTQ: the streamed solver writes the in-memory solver's codes."""
    import torch

    import kiln.runtimes as kr
    from kiln.compiler import compile
    from kiln.compiler.quantize import gptq

    monkeypatch.setattr(gptq, "calibration_dtype", lambda: torch.float32)  # BF16 would round other codes
    ckpt = sentence_checkpoint if family == "sentence" else checkpoints[family]
    outs = [compile(ckpt, tmp_path / f"{family}-{stream}", fast_options(stream=stream, precision=precision))
            for stream in (True, False)]
    m = [json.loads((o / "manifest.json").read_text()) for o in outs]
    v = m[0]["verification"]
    assert v["status"] == "passed" and "layer by layer" in v["reference"]
    assert [p["stats"] for p in m[0]["passes"]] == [p["stats"] for p in m[1]["passes"]]
    assert [e["name"] for e in m[0]["canary"]["entries"]] == ["batch"]  # recorded from the same reference pass
    if precision == "int4":
        q = next(p for p in m[0]["passes"] if p["name"] == "quantize-nbits")
        assert q["int4"]["gptq"]["streamed"] and packed_codes(outs[0]) == packed_codes(outs[1])
        assert json.loads((outs[0] / "report.json").read_text())["codes"]["passed"]
    ids = np.random.default_rng(2).integers(5, 100, (2, 13))
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    with kr.load(outs[0]) as a, kr.load(outs[1]) as b:
        got, want = a.run({"input_ids": ids, "attention_mask": mask}), b.run({"input_ids": ids, "attention_mask": mask})
        assert got.keys() == want.keys()
        for name in got:
            assert np.abs(got[name] - want[name]).max() < (1e-5 if precision == "fp32" else 1e-3), name
