"""kiln.runtimes: loads without torch, refuses tampered artifacts, validates feeds before running."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kiln.runtimes as kr
from conftest import ROOT
from kiln.cli import main
from kiln.errors import ArtifactError, InputError


@pytest.fixture()
def copy(artifacts, tmp_path):
    def _copy(family: str):
        dst = tmp_path / family
        shutil.copytree(artifacts[family], dst)
        return dst
    return _copy


def test_runtime_runs_with_torch_absent(artifacts):
    """A fresh interpreter that cannot import torch (or transformers) loads, encodes, runs and builds the server."""
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "onnx", "onnxscript", "kiln.compiler"):
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        import kiln.runtimes as kr
        m = kr.load({str(artifacts['llama'])!r})
        out = m.run(m.encode(["def f(x):", "import os"]))
        assert out["logits"].shape[0] == 2
        assert m.generate([[5, 6, 7], [8]], max_new_tokens=4).shape == (2, 7)
        assert "".join(m.stream("import os", max_new_tokens=4, stop_token_ids=[]))
        m = kr.load({str(artifacts['bert'])!r})
        out = m.run(m.encode("The cat sat on the mat."))
        from kiln.cli import main  # the CLI's run path stays torch-free too
        assert main(["run", {str(artifacts['bert'])!r}, "--text", "hello", "--json"]) == 0
        assert main(["generate", {str(artifacts['llama'])!r}, "--prompt", "import", "--max-new-tokens", "3"]) == 0
        from kiln.serve import create_app  # the server stays torch-free too
        create_app({str(artifacts['bert'])!r})
        assert not any(k.split(".")[0] in ("torch", "transformers") for k in sys.modules), sorted(sys.modules)
        print("TORCH-FREE OK")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "TORCH-FREE OK" in res.stdout, res.stderr


def test_tampered_file_is_refused(copy):
    art = copy("bert")
    data = bytearray((art / "model.onnx").read_bytes())
    data[-10] ^= 0xFF
    (art / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its sha256.*recompile"):
        kr.load(art)


def test_missing_file_and_manifest(copy, tmp_path):
    art = copy("bert")
    (art / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        kr.load(art)
    (art / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="has no manifest.json"):
        kr.load(art)
    with pytest.raises(ArtifactError, match="does not exist"):
        kr.load(tmp_path / "nowhere")


def test_unknown_schema_version(copy):
    art = copy("bert")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="schema_version 99"):
        kr.load(art)


@pytest.fixture(scope="module")
def bert(artifacts):
    with kr.load(artifacts["bert"], threads=1) as model:
        yield model


IDS = np.array([[2, 10, 11, 3]], dtype=np.int64)


@pytest.mark.parametrize("feeds,message", [
    ({"input_ids": IDS, "attention_masks": np.ones_like(IDS)}, "unknown input.*attention_masks.*takes input_ids"),
    ({"attention_mask": np.ones_like(IDS)}, "missing input.*input_ids"),
    ({"input_ids": IDS.astype(np.float32)}, "dtype float32, expected int64"),
    ({"input_ids": IDS[0]}, "rank 1.*expected rank 2"),
    ({"input_ids": IDS, "attention_mask": np.ones((2, 4), dtype=np.int64)}, "batch size 2 but input_ids has 1"),
    ({"input_ids": np.zeros((1, 65), dtype=np.int64)}, "sequence length 65, longer than the model's maximum 64"),
    ({"input_ids": np.zeros((1, 0), dtype=np.int64)}, "empty sequence axis"),
])
def test_bad_feeds_are_rejected(bert, feeds, message):
    with pytest.raises(InputError, match=message):
        bert.run(feeds)


def test_optional_inputs_default(bert):
    full = bert.run({"input_ids": IDS, "attention_mask": np.ones_like(IDS), "token_type_ids": np.zeros_like(IDS)})
    short = bert.run({"input_ids": IDS.astype(np.int32)})  # int32 ids are widened, masks default to ones
    np.testing.assert_array_equal(full["last_hidden_state"], short["last_hidden_state"])


def test_encode_matches_the_checkpoint_tokenizer(bert, artifacts, checkpoints):
    from transformers import AutoTokenizer

    texts = ["The cat sat on the mat.", "Compilers rewrite graphs."]
    feeds = bert.encode(texts)
    hf = AutoTokenizer.from_pretrained(checkpoints["bert"])(texts, padding=True, return_tensors="np")
    np.testing.assert_array_equal(feeds["input_ids"], hf["input_ids"])
    np.testing.assert_array_equal(feeds["attention_mask"], hf["attention_mask"])
    with kr.load(artifacts["llama"]) as llama:
        feeds = llama.encode(["The cat", "The cat sat on the mat."])
        assert feeds["attention_mask"][0, 0] == 0 and feeds["attention_mask"][0, -1] == 1  # decoders pad left


def test_too_long_text(bert):
    long = "The cat sat on the mat. " * 40
    with pytest.raises(InputError, match="longer than the model's maximum 64.*--truncate"):
        bert.encode(long)
    assert bert.encode(long, truncate=True)["input_ids"].shape == (1, 64)


def test_cli_run(artifacts, capsys):
    assert main(["run", str(artifacts["bert"]), "--text", "a sentence"]) == 0
    assert "mean-pooled dim 32" in capsys.readouterr().out
    assert main(["run", str(artifacts["llama"]), "--text", "def f(x):", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["next_token"][0]) == 5 and out["shapes"]["logits"][2] == 128
    # the labels in the model's own order, each with its softmax probability (a wrong order or label map fails)
    with kr.load(artifacts["roberta"]) as model:
        logits = model.run({"input_ids": np.array([[2, 5, 6, 3]], np.int64)})["logits"][0].astype(np.float64)
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    names = {0: "neg", 1: "neutral", 2: "pos"}
    want = ", ".join(f"{names[int(i)]!r} {p[i]:.3f}" for i in np.argsort(-p)[:2])
    assert main(["run", str(artifacts["roberta"]), "--ids", "2,5,6,3", "--top", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "[0] labels: " + want
    assert main(["run", str(artifacts["bert"]), "--ids", "1,x"]) == 2
    assert main(["run", str(artifacts["bert"]), "--text", "The cat sat. " * 50]) == 1
    assert "--truncate" in capsys.readouterr().err
    assert main(["run", str(artifacts["bert"]) + "-missing", "--text", "x"]) == 1


def test_encode_ids_takes_long_text_without_special_tokens(artifacts):
    with kr.load(artifacts["bert"]) as model:
        long = "The cat sat on the mat. " * 200  # far past the model's maximum: scoring tools cut it themselves
        ids = model.text_encoder.encode_ids(long)
        assert len(ids) > model.max_sequence_length
        assert model.text_encoder.encode_ids("The cat")[0] == model.encode("The cat")["input_ids"][0, 1]  # no [CLS]
