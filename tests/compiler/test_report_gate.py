"""kiln report and kiln gate on the trained tiny reference decoder: FP32 passes, a 2-bit degraded copy
fails naming its metrics, a planted latency regression is caught, the HTML is self-contained, and
unusable inputs exit 2. The report's perplexity is checked against PyTorch computed here."""

from __future__ import annotations

import base64
import json
import re
import shutil

import numpy as np
import onnx
import pytest
from conftest import fast_options
from onnx import numpy_helper

from kiln.compiler import compile
from kiln.compiler.manifest import write as write_manifest
from kiln.cli import main

GATE = "[gate]\nmax_ppl_increase_pct = 2.0\nmin_top1_agreement = 0.95\nmax_kl_mean = 0.02\n"


def rtn_2bit(w: np.ndarray) -> np.ndarray:
    """Round-to-nearest onto 4 levels per output column (min..max): a deliberately ruined weight."""
    lo, hi = w.min(0), w.max(0)
    scale = np.where(hi > lo, (hi - lo) / 3.0, 1.0)
    return (np.rint((w - lo) / scale) * scale + lo).astype(w.dtype)


def degrade(artifact, out):
    shutil.copytree(artifact, out)
    model = onnx.load(str(out / "model.onnx"))
    for t in model.graph.initializer:
        w = numpy_helper.to_array(t)
        if w.ndim == 2 and w.dtype == np.float32 and min(w.shape) >= 32:
            t.CopyFrom(numpy_helper.from_array(rtn_2bit(w), t.name))
    onnx.save(model, str(out / "model.onnx"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("files")
    write_manifest(out, manifest)  # re-hash: the artifact is consistent, just bad
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import reference_models

    ckpt = reference_models.checkpoint("llama-tiny")
    root = tmp_path_factory.mktemp("reports")
    lines = [line for line in (ckpt / "heldout.txt").read_text().splitlines() if line.strip()]
    data = root / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 8])}) + "\n" for i in range(0, 8 * 24, 8)))
    fp32 = compile(ckpt, root / "fp32", fast_options())
    bad = degrade(fp32, root / "bad")
    reports = {}
    for name, art in (("fp32", fp32), ("bad", bad)):
        assert main(["report", str(art), "--reference", str(ckpt), "--data", str(data), "-o", str(root / f"r-{name}"),
                     "-q", "--max-texts", "16", "--latency-seconds", "0.3", "--threads", "2"]) == 0
        reports[name] = root / f"r-{name}"
    return {"ckpt": ckpt, "data": data, "reports": reports, "root": root}


def test_fp32_perplexity_agrees_with_pytorch(trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = json.loads((trained["reports"]["fp32"] / "report.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(trained["ckpt"]))
    model = AutoModelForCausalLM.from_pretrained(str(trained["ckpt"])).eval()
    texts = [json.loads(line)["text"] for line in trained["data"].read_text().splitlines()][:16]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for t in texts:
            ids = torch.tensor([tok(t)["input_ids"][:128]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            nll -= float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].sum())
            count += ids.shape[1] - 1
    direct = float(np.exp(nll / count))
    m = report["metrics"]
    assert m["positions"] == count
    assert m["ppl_reference"] == pytest.approx(direct, rel=1e-6)
    assert m["ppl_artifact"] == pytest.approx(direct, rel=1e-4)
    assert abs(m["ppl_increase_pct"]) < 0.01 and m["top1_agreement"] == 1.0 and m["kl_mean"] < 1e-6
    assert m["greedy_match_rate"] == 1.0 and 20 < direct < 400  # trained, not random (1024)
    assert [r["layer"] for r in report["layers"]] == [1, 2] and all(r["relative_error"] < 1e-4 for r in report["layers"])


def test_per_layer_table_locates_the_error(trained):
    fp32, bad = (json.loads((trained["reports"][n] / "report.json").read_text())["layers"] for n in ("fp32", "bad"))
    assert [r["layer"] for r in bad] == [1, 2]
    assert bad[0]["relative_error"] > 100 * fp32[0]["relative_error"] and bad[0]["relative_error"] > 0.01


def test_report_of_a_pruned_artifact_shows_the_cost_per_layer(trained, tmp_path):
    """Against the original checkpoint, a pruned artifact's per-layer error is the pruning cost in that layer (far
    above FP32 rounding), next to what each layer kept; the page says what was pruned and what compile measured."""
    out = compile(trained["ckpt"], tmp_path / "pruned", fast_options(prune="ffn=0.2"))
    assert main(["report", str(out), "--reference", str(trained["ckpt"]), "--data", str(trained["data"]), "-o",
                 str(tmp_path / "r"), "-q", "--max-texts", "8", "--latency-seconds", "0.2", "--threads", "2"]) == 0
    r = json.loads((tmp_path / "r" / "report.json").read_text())
    fp32 = json.loads((trained["reports"]["fp32"] / "report.json").read_text())["layers"]
    assert r["pruning"]["method"] == "flap" and r["pruning"]["compile_cost"]["ppl_increase_pct"] > 0
    assert [(x["layer"], x["ffn"], x["heads"]) for x in r["layers"]] == [(1, 138, 4), (2, 138, 4)]
    assert all(x["relative_error"] > 100 * f["relative_error"] for x, f in zip(r["layers"], fp32))
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Pruned (flap, uniform per-layer counts): heads 4 -> 4, FFN channels 172 -> 138" in md
    assert "| heads kept | FFN kept |" in md and "FFN kept</th>" in (tmp_path / "r" / "report.html").read_text()


def test_gate_passes_fp32_and_fails_the_degraded_artifact_naming_metrics(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kiln.toml").write_text(GATE)
    assert main(["gate", str(trained["reports"]["fp32"] / "report.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("pass") == 3 and "FAIL" not in out
    assert main(["gate", str(trained["reports"]["bad"] / "report.json")]) == 1
    printed = capsys.readouterr()
    for name in ("max_ppl_increase_pct", "min_top1_agreement", "max_kl_mean"):
        assert name in printed.err
    assert printed.out.count("FAIL") == 3
    bad = json.loads((trained["reports"]["bad"] / "report.json").read_text())["metrics"]
    assert bad["ppl_increase_pct"] > 10 and bad["greedy_match_rate"] < 1.0


def test_flags_override_files_and_pyproject_is_read(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n[tool.kiln.gate]\nmin_top1_agreement = 0.999\n")
    report = str(trained["reports"]["bad"] / "report.json")
    assert main(["gate", report]) == 1 and "min_top1_agreement" in capsys.readouterr().err
    assert main(["gate", report, "--min-top1-agreement", "0.0"]) == 0


def test_baseline_flags_a_planted_latency_regression(trained, tmp_path, capsys):
    current = trained["reports"]["fp32"] / "report.json"
    data = json.loads(current.read_text())
    data["latency"]["p50_ms"] = data["latency"]["p50_ms"] / 2  # the last release was twice as fast
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(data))
    assert main(["gate", str(current), "--baseline", str(baseline), "--max-latency-regression-pct", "20"]) == 1
    printed = capsys.readouterr()
    assert "max_latency_regression_pct (100" in printed.err and "FAIL" in printed.out
    assert main(["gate", str(current), "--baseline", str(current), "--max-latency-regression-pct", "20"]) == 0


def test_html_embeds_its_plots_and_needs_no_network(trained):
    page = (trained["reports"]["fp32"] / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) >= 3  # error histogram, KL per position, latency distribution
    assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    assert not re.search(r"(src|href)=\"(https?:)?//", page) and "<script" not in page
    md = (trained["reports"]["fp32"] / "report.md").read_text()
    assert "perplexity increase (%)" in md and "| logits |" in md and "Where the error enters" in md
    assert "Where the error enters" in page


def test_unusable_inputs_exit_2_with_a_clear_message(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    good = str(trained["reports"]["fp32"] / "report.json")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else", "metrics": {}}))
    (tmp_path / "bad.toml").write_text("[gate\nmin_top1_agreement = ")
    (tmp_path / "unknown.toml").write_text("[gate]\nmin_accuracy = 0.9\n")
    (tmp_path / "text.toml").write_text("[gate]\nmax_kl_mean = 'small'\n")
    (tmp_path / "nan.toml").write_text("[gate]\nmax_kl_mean = nan\n")  # NaN would fail every comparison silently
    (tmp_path / "empty.toml").write_text("[other]\nx = 1\n")
    cases = [
        (["gate", str(tmp_path / "broken.json"), "--max-kl-mean", "1"], "is not valid JSON"),
        (["gate", str(tmp_path / "other.json"), "--max-kl-mean", "1"], "is not a kiln report"),
        (["gate", str(tmp_path / "missing.json"), "--max-kl-mean", "1"], "does not exist"),
        (["gate", good, "--config", str(tmp_path / "bad.toml")], "is not valid TOML"),
        (["gate", good, "--config", str(tmp_path / "unknown.toml")], "unknown threshold 'min_accuracy'"),
        (["gate", good, "--config", str(tmp_path / "text.toml")], "is not a finite number"),
        (["gate", good, "--config", str(tmp_path / "nan.toml")], "max_kl_mean = nan is not a finite number"),
        (["gate", good, "--config", str(tmp_path / "empty.toml")], "has no [gate] table"),
        (["gate", good], "no thresholds"),
        (["gate", good, "--min-cosine", "0.9"], "has no cosine_min"),
        (["gate", good, "--max-latency-regression-pct", "10"], "pass --baseline"),
        (["gate", good, "--baseline", str(tmp_path / "broken.json"), "--max-kl-mean", "1"], "baseline"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_report_errors(trained, tmp_path, capsys, checkpoints):
    fp32 = str(trained["root"] / "fp32")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["report", fp32, "--reference", str(trained["ckpt"]), "--data", str(empty), "-o", str(tmp_path / "r")]) == 2
    assert "0 usable texts" in capsys.readouterr().err and not (tmp_path / "r" / "report.json").exists()
    assert main(["report", fp32, "--reference", str(checkpoints["bert"]), "--data", str(trained["data"]),
                 "-o", str(tmp_path / "r")]) == 2
    assert "give the checkpoint the artifact was compiled from" in capsys.readouterr().err


def test_encoder_report_has_cosine_and_gates_on_it(artifacts, checkpoints, tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("The cat sat on the mat.\nCompilers rewrite graphs into faster operations.\n")
    assert main(["report", str(artifacts["bert"]), "--reference", str(checkpoints["bert"]), "--data", str(data),
                 "-o", str(tmp_path / "r"), "-q", "--latency-seconds", "0.2"]) == 0
    m = json.loads((tmp_path / "r" / "report.json").read_text())["metrics"]
    assert m["cosine_min"] > 0.9999
    capsys.readouterr()
    assert main(["gate", str(tmp_path / "r" / "report.json"), "--min-cosine", "0.999"]) == 0


def test_report_refuses_encoder_decoders_for_now(seq2seq_artifacts, trained, tmp_path, capsys):
    art = seq2seq_artifacts["t5"]
    source = json.loads((art / "manifest.json").read_text())["model"]["source"]["path"]
    assert main(["report", str(art), "--reference", source, "--data", str(trained["data"]), "-o", str(tmp_path / "r")]) == 2
    assert "measures encoder and decoder artifacts" in capsys.readouterr().err and not (tmp_path / "r").exists()
