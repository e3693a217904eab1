"""Trained weights: the tiny reference decoder (trained and cached by tools/) keeps greedy top-1 on real text."""

from __future__ import annotations

import json

import numpy as np

import kiln.runtimes as kr
from conftest import fast_options
from kiln.compiler import compile


def test_trained_llama_tiny_parity_on_heldout_text(tmp_path):
    import reference_models

    ckpt = reference_models.checkpoint("llama-tiny")
    info = json.loads((ckpt / "train_info.json").read_text())
    assert info["heldout_perplexity"] < 200  # trained: a random model over 1024 tokens sits near 1024
    out = compile(ckpt, tmp_path / "ref", fast_options(verify_max_length=256))
    report = json.loads((out / "report.json").read_text())
    text_cases = [c for c in report["cases"] if c["source"] == "text"]
    assert text_cases and all(c["outputs"]["logits"]["top1_agreement"] == 1.0 for c in text_cases)

    heldout = (ckpt / "heldout.txt").read_text()[:2000]
    with kr.load(out) as model:
        feeds = model.encode([heldout], truncate=True)
        logits = model.run(feeds)["logits"]
    ids = feeds["input_ids"][0]
    # next-token accuracy on unseen stdlib code: about 100x chance (1/1024) for a trained model
    acc = float((logits[0, :-1].argmax(-1) == ids[1:]).mean())
    assert acc > 0.1, acc
    assert np.isfinite(logits).all()


def test_trained_mixture_of_experts_compiles_routed(tmp_path):
    """A newer family trained here (tools/reference_models.py qwen3-moe-tiny: per-head q/k norms, 4 routed experts,
    top 2): FP32 and INT4 artifacts route through ONNX Runtime's MoE / QMoE (fuse-moe on both layers), keep greedy
    top-1 on held-out text at FP32 and predict the next token far above chance at INT4."""
    import reference_models

    ckpt = reference_models.checkpoint("qwen3-moe-tiny")
    info = json.loads((ckpt / "train_info.json").read_text())
    assert info["heldout_perplexity"] < 200
    heldout = (ckpt / "heldout.txt").read_text()[:2000]
    for precision in ("fp32", "int4"):
        out = compile(ckpt, tmp_path / precision, fast_options(precision=precision, verify_max_length=256))
        manifest = json.loads((out / "manifest.json").read_text())
        passes = {p["name"]: p for p in manifest["passes"]}
        assert passes["fuse-moe"]["coverage"] == {"expected": 2, "fused": 2}
        assert manifest["verification"]["generation"]["tokens_identical"]
        if precision == "fp32":
            report = json.loads((out / "report.json").read_text())
            assert all(c["outputs"]["logits"]["top1_agreement"] == 1.0 for c in report["cases"] if c["source"] == "text")
        with kr.load(out) as model:
            feeds = model.encode([heldout], truncate=True)
            logits = model.run(feeds)["logits"]
        ids = feeds["input_ids"][0]
        acc = float((logits[0, :-1].argmax(-1) == ids[1:]).mean())
        assert acc > 0.1, (precision, acc)
