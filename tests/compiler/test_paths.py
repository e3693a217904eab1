"""The compile verifies the paths that run: batch-1 greedy decode, and continuous batching's row counts (1, 2, 4, 8
rows of different lengths) each row against itself alone; planted bugs on either path fail."""

import json

import numpy as np

import kiln.runtimes as kr
from kiln.compiler.load import load_checkpoint
from kiln.compiler.verify.cases import generation_prompts
from kiln.compiler.verify.generation import verify_generation, verify_rows
from kiln.compiler.verify.parity import failures
from kiln.runtimes.onnxruntime import SlotCache


def test_both_paths_are_in_the_report_and_manifest(artifacts):
    data = json.loads((artifacts["llama"] / "manifest.json").read_text())
    report = json.loads((artifacts["llama"] / "report.json").read_text())
    assert report["generation_1"]["batch"] == 1 and report["generation_1"]["passed"]
    assert report["rows"]["rows"] == [1, 2, 4, 8] and report["rows"]["passed"]
    assert len(set(report["rows"]["prompt_lengths"])) == 8  # every row its own length
    assert data["verification"]["generation_batch_1"]["tokens_identical"] is True
    assert set(data["verification"]["rows"]["max_abs_over_bound"]) == {"2", "4", "8"}


def test_a_row_that_depends_on_its_neighbours_fails(checkpoints, artifacts, monkeypatch):
    real = SlotCache.decode

    def leaky(self, tokens, lengths):  # row 0 sees the others: 1e-3 of the largest logit per extra row
        out = real(self, tokens, lengths)
        out[0] += 1e-3 * (len(tokens) - 1) * np.abs(out[0]).max()
        return out

    with kr.load(artifacts["llama"], threads=2) as model:
        prompts = generation_prompts(load_checkpoint(checkpoints["llama"]), 0)
        assert verify_rows(model, prompts, "fp32")["passed"]
        monkeypatch.setattr(SlotCache, "decode", leaky)
        report = verify_rows(model, prompts, "fp32")
    assert not report["passed"] and report["max_abs_over_bound"]["2"] > 1
    line = failures({"rows": report, "cases": []})[0]
    assert line.startswith("continuous batching:") and "alone" in line


def test_a_wrong_one_row_decode_fails_the_batch_1_check(checkpoints, artifacts, monkeypatch):
    import kiln.runtimes.onnxruntime as ort_backend

    class WrongAtOneRow(ort_backend.OnnxRuntime):
        def slot_cache(self, kv, slots, positions, pooled=False):
            cache = super().slot_cache(kv, slots, positions, pooled)
            decode = cache.decode
            cache.decode = lambda tokens, lengths: decode(tokens, lengths) + (1e-2 if len(tokens) == 1 else 0.0)
            return cache

    ckpt = load_checkpoint(checkpoints["llama"])
    prompts = generation_prompts(ckpt, 0)
    monkeypatch.setattr(ort_backend, "OnnxRuntime", WrongAtOneRow)
    with kr.load(artifacts["llama"], threads=2, check=False) as model:
        pad = model.manifest.data["generation"]["pad_token_id"]
        batch = verify_generation(ckpt.model, model, prompts, 4, "fp32", pad)
        alone = verify_generation(ckpt.model, model, prompts[:1], 4, "fp32", pad)
    assert batch["passed"] and not alone["passed"]  # the batch of 3 never decodes one row
