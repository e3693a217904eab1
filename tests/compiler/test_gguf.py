"""A .gguf file as the checkpoint: dequantized through transformers, the source recorded with its sha256;
bad files are one-line errors."""

from __future__ import annotations

import pytest

from kiln.cli import main
from kiln.compiler.load import load_checkpoint
from kiln.runtimes.artifact import sha256_file


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04not gguf at all")
    assert main(["compile", str(bad), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "is not a GGUF file" in err[-1] and not (tmp_path / "out").exists()
    assert main(["compile", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_gguf_loads_as_the_real_model():
    """SmolLM2-135M-Instruct's GGUF (Q4_1 linears, Q8_0 embeddings) from the package index: the dequantized
    model answers like the real one, and the source is the GGUF file with its digest."""
    import reference_models
    import torch

    gguf = reference_models.smollm2() / "model.gguf"
    ckpt = load_checkpoint(gguf)
    assert ckpt.source == {"format": "gguf", "path": str(gguf.absolute()), "sha256": sha256_file(gguf)}
    assert ckpt.sha256 == ckpt.source["sha256"] and ckpt.kind == "decoder"
    cfg = ckpt.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    ids = ckpt.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = ckpt.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in ckpt.tokenizer.decode(out[0, ids.shape[1]:])
