"""Encoder-decoders (T5, BART): two graphs, cross K/V computed once, greedy output identical to HF generate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kiln.runtimes as kr

SOURCES = [[5, 9, 17, 33, 20, 60, 7, 8, 99], [12, 3, 44, 5], [7, 7, 8, 120, 11, 31, 45, 6, 90, 101, 13, 14, 15, 16]]


def right_padded(rows, pad):
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask


@pytest.mark.parametrize("family", ["t5", "bart", "marian"])
def test_manifest_and_verification(seq2seq_artifacts, family):
    manifest = json.loads((seq2seq_artifacts[family] / "manifest.json").read_text())
    assert manifest["model"]["kind"] == "seq2seq" and manifest["model"]["task"] == "text2text-generation"
    assert manifest["graphs"] == {"encoder": "encoder.onnx", "decoder": "decoder.onnx"}
    assert [o["name"] for o in manifest["outputs"]] == ["cross.0.key", "cross.0.value", "cross.1.key", "cross.1.value"]
    assert manifest["kv_cache"]["cross"] == ["cross.0.key", "cross.0.value", "cross.1.key", "cross.1.value"]
    gen = manifest["verification"]["generation"]
    assert manifest["verification"]["status"] == "passed" and gen["tokens_identical"] and gen["max_abs_over_atol"] <= 1
    assert {"encoder.onnx", "decoder.onnx", "report.json"} <= set(manifest["files"])
    mha = {p["graph"]: p for p in manifest["passes"] if p["name"] == "fuse-mha"}
    assert mha["encoder"]["coverage"] == {"expected": 2, "fused": 2}  # self-attention per encoder layer
    assert mha["decoder"]["coverage"] == {"expected": 4, "fused": 4}  # cached self + cross per decoder layer
    assert mha["decoder"]["stats"]["cached_self"] == 2 and mha["decoder"]["stats"]["cross"] == 2


@pytest.mark.parametrize("family", ["t5", "bart", "marian"])
def test_greedy_64_tokens_identical_to_hf_generate(seq2seq_artifacts, family):
    # the reference is the saved checkpoint as Hugging Face loads it (Marian recomputes its sinusoidal
    # position table on load, so the in-memory model that was saved is not the reference)
    import transformers

    source = json.loads((seq2seq_artifacts[family] / "manifest.json").read_text())["model"]["source"]["path"]
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(source).eval()
    pad = int(hf.config.pad_token_id)
    ids, mask = right_padded(SOURCES, pad)
    # random tiny models repeat one token; a strong repetition penalty (same on both sides) keeps the 64 tokens varied
    with torch.inference_mode():
        ref = hf.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=64,
                          do_sample=False, num_beams=1, eos_token_id=None, forced_eos_token_id=None, pad_token_id=pad,
                          repetition_penalty=5.0).numpy()
    with kr.load(seq2seq_artifacts[family], threads=2) as model:
        got = model.generate(SOURCES, max_new_tokens=64, stop_token_ids=[], pad_token_id=pad, repetition_penalty=5.0)
    assert got.shape == (3, 65) and len(set(got[0].tolist())) > 8
    np.testing.assert_array_equal(got, ref)


def test_encoder_runs_once_and_cross_kv_is_bound_once(seq2seq_artifacts, monkeypatch):
    with kr.load(seq2seq_artifacts["bart"], threads=2) as model:
        calls = []
        encoder = model.runtimes["encoder"]
        real_run = encoder.run
        monkeypatch.setattr(encoder, "run", lambda feeds: calls.append(1) or real_run(feeds))
        runner = model.seq2seq_runner(*right_padded(SOURCES, 1))
        bound = {k: v.data_ptr() for k, v in runner.fixed.items()}
        tokens = np.full((3, 1), 2, np.int64)
        for _ in range(5):
            logits = runner.step(tokens)
            tokens = logits[:, -1].argmax(-1)[:, None]
            assert {k: v.data_ptr() for k, v in runner.fixed.items()} == bound  # the same memory every step
        assert len(calls) == 1
        assert runner.past["past_key_values.0.key"].shape()[2] == 5  # the self cache grew by one per step


def test_stop_token_and_capacity(seq2seq_artifacts):
    with kr.load(seq2seq_artifacts["t5"], threads=2) as model:
        free = model.generate(SOURCES, max_new_tokens=6, stop_token_ids=[], pad_token_id=0)
        stop = int(free[0, 3])
        out = model.generate(SOURCES, max_new_tokens=6, stop_token_ids=[stop], pad_token_id=0)
        first = int(np.flatnonzero(out[0] == stop)[0])
        assert (out[0, first + 1:] == 0).all()
        with pytest.raises(kr.InputError, match="KV-cache capacity 128"):
            model.generate(SOURCES, max_new_tokens=200)


def test_stream_and_cli_generate(seq2seq_artifacts, capsys):
    from kiln.cli import main

    with kr.load(seq2seq_artifacts["bart"], threads=2) as model:
        text = "".join(model.stream("The cat sat on the mat.", max_new_tokens=12, stop_token_ids=[], repetition_penalty=5.0))
        feeds = model.encode(["The cat sat on the mat."])
        ids = model.generate(feeds["input_ids"], feeds["attention_mask"], max_new_tokens=12, stop_token_ids=[],
                             repetition_penalty=5.0)
        assert text == model.text_encoder.decode(ids[0, 1:].tolist())
    assert main(["generate", str(seq2seq_artifacts["t5"]), "--prompt", "The cat", "--max-new-tokens", "4"]) == 0


def test_cli_run_points_to_generate(seq2seq_artifacts, capsys):
    from kiln.cli import main

    assert main(["run", str(seq2seq_artifacts["bart"]), "--text", "hello"]) == 2
    assert "use kiln generate" in capsys.readouterr().err


def test_int8_encoder_decoder_is_refused(tmp_path, capsys):
    from conftest import save_checkpoint
    from kiln.cli import main

    ckpt = save_checkpoint(tmp_path / "t5", "t5", "text2text")
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "q"), "-q", "--precision", "int8"]) == 2
    assert "precision int8 is not available for seq2seq models" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
