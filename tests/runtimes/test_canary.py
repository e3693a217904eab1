"""The artifact's canary: recorded at compile, re-run by ``load`` and ``kiln check``; planted bugs make both refuse."""

import json
import shutil

import numpy as np
import pytest
from onnx import numpy_helper

import kiln.runtimes as kr
from kiln.cli import main
from kiln.errors import ArtifactError
from kiln.runtimes import canary
from kiln.runtimes.onnxruntime import OnnxRuntime
from tests.conftest import planted


def bump_one_weight(factor):
    """Scale the largest element of the largest FP32 matrix a MatMul reads: one damaged weight, checksums recomputed."""
    def mutate(model):
        read = {n.input[1] for n in model.graph.node if n.op_type in ("MatMul", "Gemm", "FusedMatMul")}
        t = max((t for t in model.graph.initializer if t.name in read and t.data_type == 1), key=lambda t: np.prod(t.dims))
        a = numpy_helper.to_array(t).copy()
        flat = a.reshape(-1)
        flat[int(np.abs(flat).argmax())] *= factor
        t.CopyFrom(numpy_helper.from_array(a, t.name))
    return mutate


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_recorded_and_passes_where_compiled(artifacts, family):
    data = json.loads((artifacts[family] / "manifest.json").read_text())
    names = [e["name"] for e in data["canary"]["entries"]]
    assert names == (["decode_1", "decode_rows", "rows"] if family == "llama" else ["batch"])
    with kr.load(artifacts[family]) as model:
        assert model.canary is not None and model.canary.passed
        for e in model.canary.entries:  # the same machine: the error it had at compile, well inside the bound
            assert e["error"] <= e["bound"]
        if family == "llama":
            assert model.canary.rows_agree is True


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_one_damaged_weight_is_refused_at_load_and_by_check(artifacts, tmp_path, capsys, family):
    out = planted(artifacts[family], tmp_path, bump_one_weight(2.0))  # one element doubled
    with pytest.raises(kr.CanaryError) as e:
        kr.load(out)
    line = str(e.value)
    assert "\n" not in line and canary.isa() in line and "onnxruntime-cpu" in line and "canary entry" in line
    with kr.load(out, check=False):  # the caller's explicit choice runs it unchecked
        pass
    assert main(["check", str(out)]) == 1
    printed = capsys.readouterr()
    assert "FAILED" in printed.out and "kiln check: error:" in printed.err and "machine:" in printed.out
    assert main(["serve", str(out), "--port", "8999"]) == 1  # refused at start-up, before it binds
    assert "computes another answer on this machine" in capsys.readouterr().err


class WrongAtOneRow(OnnxRuntime):
    """A backend whose one-row decode (M = 1) computes a slightly different answer: what a wrong kernel path does."""

    def slot_cache(self, kv, slots, positions, pooled=False):
        cache = super().slot_cache(kv, slots, positions, pooled)
        decode = cache.decode

        def wrong(tokens, lengths):
            out = decode(tokens, lengths)
            if len(tokens) == 1:
                out = out + 1e-3 * np.abs(out).max()  # 10x the FP32 bound: a planted bug this small must fail
            return out
        cache.decode = wrong
        return cache


def test_a_wrong_one_row_kernel_is_refused(artifacts, monkeypatch):
    import kiln.runtimes.onnxruntime as ort_backend

    monkeypatch.setattr(ort_backend, "OnnxRuntime", WrongAtOneRow)
    with pytest.raises(kr.CanaryError, match="decode_1"):
        kr.load(artifacts["llama"])


def test_no_canary_loads_unchecked_and_check_says_so(artifacts, tmp_path, capsys):
    out = tmp_path / "old"
    shutil.copytree(artifacts["llama"], out)
    data = json.loads((out / "manifest.json").read_text())
    del data["canary"], data["files"]["canary.npz"]
    (out / "canary.npz").unlink()
    (out / "manifest.json").write_text(json.dumps(data))
    with kr.load(out) as model:
        assert model.canary is None
    assert main(["check", str(out)]) == 1
    assert "carries no canary" in capsys.readouterr().err


def test_hostile_canary_is_refused(artifacts, tmp_path):
    out = tmp_path / "hostile"
    shutil.copytree(artifacts["llama"], out)
    data = json.loads((out / "manifest.json").read_text())
    with open(out / "canary.npz", "wb") as f:  # an object array: a pickle, not numbers
        np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    from kiln.runtimes.artifact import sha256_file

    data["files"]["canary.npz"] = sha256_file(out / "canary.npz")
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="canary"):
        kr.load(out)
    data["canary"]["file"] = "../../etc/passwd"  # confined by the schema to its own name
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="malformed"):
        kr.load(out)


def test_encoder_decoders_carry_one(seq2seq_artifacts):
    for family, art in seq2seq_artifacts.items():
        data = json.loads((art / "manifest.json").read_text())
        assert [e["kind"] for e in data["canary"]["entries"]] == ["seq2seq", "seq2seq", "rows"], family
        with kr.load(art) as model:
            assert model.canary.passed, (family, model.canary.entries)
