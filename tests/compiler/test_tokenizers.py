"""Checkpoints without a usable tokenizer: compiled and verified on random ids, never a silent failure."""

from __future__ import annotations

import json

import pytest

from conftest import fast_options, save_checkpoint
from kiln.compiler import compile


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_decoder_saved_without_tokenizer_files_compiles(tmp_path, family):
    """transformers builds an empty tokenizer for such a directory; kiln treats it as none."""
    ckpt = save_checkpoint(tmp_path / family, family, "causal-lm", tokenizer=False)
    lines: list[str] = []
    out = compile(ckpt, tmp_path / "art", fast_options(), progress=lines.append)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] is None and "tokenizer_warning" not in manifest  # none shipped: nothing to warn of
    assert manifest["verification"]["status"] == "passed" and manifest["verification"]["generation"]["tokens_identical"]
    report = json.loads((out / "report.json").read_text())
    assert {c["source"] for c in report["cases"]} == {"random"}
    assert not [line for line in lines if "warning" in line]


def test_broken_tokenizer_is_a_visible_warning_and_recorded(tmp_path):
    ckpt = save_checkpoint(tmp_path / "bert", "bert", "base")
    (ckpt / "tokenizer.json").write_text("{ this is not json")
    lines: list[str] = []
    out = compile(ckpt, tmp_path / "art", fast_options(), progress=lines.append)
    warned = [line for line in lines if line.startswith("warning:")]
    assert len(warned) == 1 and "tokenizer" in warned[0] and "random token ids" in warned[0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] is None and "could not be loaded" in manifest["tokenizer_warning"]
    assert not (out / "tokenizer.json").exists()


def test_tokenizer_that_yields_no_tokens_is_no_tokenizer(tmp_path):
    """A tokenizer.json whose vocabulary is empty loads fine and encodes every text to nothing."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    ckpt = save_checkpoint(tmp_path / "llama", "llama", "causal-lm", tokenizer=False)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(ckpt)
    lines: list[str] = []
    out = compile(ckpt, tmp_path / "art", fast_options(), progress=lines.append)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "gives no tokens" in manifest["tokenizer_warning"]
    assert any("gives no tokens" in line for line in lines)
