"""kiln report and kiln gate on the trained tiny reference decoder: FP32 passes, a 2-bit degraded copy
fails naming its metrics, a planted latency regression is caught, the HTML is self-contained, and
unusable inputs exit 2. The report's perplexity is checked against PyTorch computed here."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import fast_options
from onnx import numpy_helper

from kiln.compiler import compile
from kiln.compiler.manifest import write as write_manifest
from kiln.cli import main

GATE = "[gate]\nmax_ppl_increase_pct = 2.0\nmin_top1_agreement = 0.95\nmax_kl_mean = 0.02\n"


def entry(report_dir, i: int = 0) -> dict:
    """One artifact's entry of a report (schema 2: one per artifact)."""
    return json.loads((report_dir / "report.json").read_text())["artifacts"][i]


def rtn_2bit(w: np.ndarray, per_tensor: bool = False) -> np.ndarray:
    """Round-to-nearest onto 4 levels per output column (min..max), or one set of 4 levels for the whole tensor: a
    deliberately ruined weight."""
    lo, hi = (w.min(), w.max()) if per_tensor else (w.min(0), w.max(0))
    scale = np.where(hi > lo, (hi - lo) / 3.0, 1.0)
    return (np.rint((w - lo) / scale) * scale + lo).astype(w.dtype)


def degrade(artifact, out, per_tensor: bool = False):
    """A copy of ``artifact`` whose every graph (a decoder's one, an encoder-decoder's two) has 2-bit weights."""
    shutil.copytree(artifact, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for graph in sorted(set(manifest["graphs"].values())):
        model = onnx.load(str(out / graph))
        for t in model.graph.initializer:
            w = numpy_helper.to_array(t)
            if w.ndim == 2 and w.dtype == np.float32 and min(w.shape) >= 32:
                t.CopyFrom(numpy_helper.from_array(rtn_2bit(w, per_tensor), t.name))
        onnx.save(model, str(out / graph))
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
    int8 = compile(ckpt, root / "int8", fast_options(precision="int8"))
    reports = {}
    for name, art in (("fp32", fp32), ("bad", bad)):
        assert main(["report", str(art), "--reference", str(ckpt), "--data", str(data), "-o", str(root / f"r-{name}"),
                     "-q", "--max-texts", "16", "--latency-seconds", "0.3", "--threads", "2"]) == 0
        reports[name] = root / f"r-{name}"
    (root / "gate.toml").write_text(GATE)
    assert main(["report", str(fp32), str(int8), str(bad), "--reference", str(ckpt), "--data", str(data), "-o",
                 str(root / "r-compare"), "-q", "--max-texts", "16", "--latency-seconds", "0.6", "--threads", "2",
                 "--config", str(root / "gate.toml")]) == 0
    reports["compare"] = root / "r-compare"
    return {"ckpt": ckpt, "data": data, "reports": reports, "root": root,
            "artifacts": {"fp32": fp32, "int8": int8, "bad": bad}}


def test_fp32_perplexity_agrees_with_pytorch(trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = entry(trained["reports"]["fp32"])
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
    fp32, bad = (entry(trained["reports"][n])["layers"] for n in ("fp32", "bad"))
    assert [r["layer"] for r in bad] == [1, 2]
    assert bad[0]["relative_error"] > 100 * fp32[0]["relative_error"] and bad[0]["relative_error"] > 0.01


def test_report_of_a_pruned_artifact_shows_the_cost_per_layer(trained, tmp_path):
    """Against the original checkpoint, a pruned artifact's per-layer error is the pruning cost in that layer (far
    above FP32 rounding), next to what each layer kept; the page says what was pruned and what compile measured."""
    out = compile(trained["ckpt"], tmp_path / "pruned", fast_options(prune="ffn=0.2"))
    assert main(["report", str(out), "--reference", str(trained["ckpt"]), "--data", str(trained["data"]), "-o",
                 str(tmp_path / "r"), "-q", "--max-texts", "8", "--latency-seconds", "0.2", "--threads", "2"]) == 0
    r = entry(tmp_path / "r")
    fp32 = entry(trained["reports"]["fp32"])["layers"]
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
    bad = entry(trained["reports"]["bad"])["metrics"]
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
    last = data["artifacts"][0]["latency"]
    last["p50_ms"] = last["p50_ms"] / 2  # the last release was twice as fast
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
    (tmp_path / "unknown.toml").write_text("[gate]\nmin_acuracy = 0.9\n")
    (tmp_path / "text.toml").write_text("[gate]\nmax_kl_mean = 'small'\n")
    (tmp_path / "nan.toml").write_text("[gate]\nmax_kl_mean = nan\n")  # NaN would fail every comparison silently
    (tmp_path / "empty.toml").write_text("[other]\nx = 1\n")
    cases = [
        (["gate", str(tmp_path / "broken.json"), "--max-kl-mean", "1"], "is not valid JSON"),
        (["gate", str(tmp_path / "other.json"), "--max-kl-mean", "1"], "is not a kiln report"),
        (["gate", str(tmp_path / "missing.json"), "--max-kl-mean", "1"], "does not exist"),
        (["gate", good, "--config", str(tmp_path / "bad.toml")], "is not valid TOML"),
        (["gate", good, "--config", str(tmp_path / "unknown.toml")], "unknown threshold 'min_acuracy'"),
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
    m = entry(tmp_path / "r")["metrics"]
    assert m["cosine_min"] > 0.9999
    capsys.readouterr()
    assert main(["gate", str(tmp_path / "r" / "report.json"), "--min-cosine", "0.999"]) == 0


def test_encoder_decoder_report_checks_steps_and_greedy_tokens(seq2seq_artifacts, trained, tmp_path, capsys):
    """T5: the decoder fed Hugging Face's greedy tokens agrees on every step's top-1 and its own greedy tokens match
    generate's; the same artifact with one decoder weight ruined does not, and the gate names it."""
    art = seq2seq_artifacts["t5"]
    source = json.loads((art / "manifest.json").read_text())["model"]["source"]["path"]
    broken = tmp_path / "broken"
    shutil.copytree(art, broken)
    model = onnx.load(str(broken / "decoder.onnx"))
    big = max((t for t in model.graph.initializer if t.data_type == 1), key=lambda t: numpy_helper.to_array(t).size)
    big.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(big)[::-1].copy(), big.name))
    onnx.save(model, str(broken / "decoder.onnx"))
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest.pop("files")
    write_manifest(broken, manifest)
    (tmp_path / "gate.toml").write_text("[gate]\nmin_top1_agreement = 0.99\nmax_kl_mean = 0.001\n")
    assert main(["report", str(art), str(broken), "--reference", source, "--data", str(trained["data"]), "-o",
                 str(tmp_path / "r"), "-q", "--max-texts", "4", "--latency-seconds", "0.3",
                 "--config", str(tmp_path / "gate.toml")]) == 0
    good, bad = json.loads((tmp_path / "r" / "report.json").read_text())["artifacts"]
    assert good["model"]["kind"] == "seq2seq" and good["metrics"]["steps"] == 16 and good["metrics"]["texts"] == 4
    assert good["metrics"]["top1_agreement"] == 1.0 and good["metrics"]["greedy_match_rate"] == 1.0
    assert good["metrics"]["kl_mean"] < 1e-6 and good["verdict"]["passed"] is True
    assert bad["verdict"]["passed"] is False and "max_kl_mean" in bad["verdict"]["failing"]
    assert "encoder + 16 greedy decoder steps" in good["latency"]["what"]
    layers = json.loads((art / "manifest.json").read_text())["model"]["num_layers"]
    assert [r["layer"] for r in good["layers"]] == list(range(1, layers + 1))  # the encoder's, each matched
    assert all(r["relative_error"] < 1e-4 for r in good["layers"])
    assert "| artifact | precision | size | p50 latency | speed-up | top-1 per step |" in (tmp_path / "r" / "report.md").read_text()
    capsys.readouterr()
    assert main(["gate", str(tmp_path / "r" / "report.json"), "--config", str(tmp_path / "gate.toml")]) == 1
    assert f"FAILED: {broken}:" in capsys.readouterr().err


def test_comparison_report_leads_with_verdicts_and_names_the_failing_metrics(trained, capsys):
    """FP32, INT8 and a 2-bit copy of the trained reference decoder in one report: the first two pass the gate's
    thresholds, the 2-bit one fails naming each metric; the page and the markdown lead with that table."""
    r = json.loads((trained["reports"]["compare"] / "report.json").read_text())
    assert r["schema_version"] == 2 and r["thresholds"] == {"max_ppl_increase_pct": 2.0, "min_top1_agreement": 0.95,
                                                            "max_kl_mean": 0.02}
    fp32, int8, bad = r["artifacts"]
    assert [e["name"] for e in r["artifacts"]] == ["fp32", "int8", "bad"]
    assert fp32["verdict"]["passed"] is True and int8["verdict"]["passed"] is True
    assert bad["verdict"]["passed"] is False
    assert bad["verdict"]["failing"] == ["max_ppl_increase_pct", "min_top1_agreement", "max_kl_mean"]
    assert fp32["speedup_vs_first"] == 1.0 and int8["size_bytes"] < fp32["size_bytes"]
    assert all(e["latency"]["rounds"] == 5 and e["latency"]["runs"] >= 15 for e in r["artifacts"])
    assert int8["metrics"]["ppl_increase_pct"] < 1.0 and bad["metrics"]["ppl_increase_pct"] > 10
    md = (trained["reports"]["compare"] / "report.md").read_text()
    head = md.split("\n## ")[0]  # everything before the per-artifact details
    assert "| artifact | precision | size | p50 latency | speed-up | perplexity change | top-1 | KL mean |" in head
    (bad_row,) = [line for line in head.splitlines() if line.startswith("| bad |")]
    assert "FAIL: perplexity increase (%) +" in bad_row and "next-token top-1 agreement" in bad_row
    assert "KL divergence, mean" in bad_row and head.count("| pass |") == 2
    page = (trained["reports"]["compare"] / "report.html").read_text()
    assert page.index('class="verdict"') < page.index("<img") < page.index("<h2>Details</h2>")
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 5  # scatter, layers, logits errors, latency, KL


def test_the_reference_runs_once_for_every_artifact(trained, tmp_path, monkeypatch):
    from kiln.compiler.trace import EagerRunner
    from kiln.evaluate import report as R
    from kiln.evaluate.options import ReportOptions

    calls = []
    real = EagerRunner.run
    monkeypatch.setattr(EagerRunner, "run", lambda self, feeds: calls.append(1) or real(self, feeds))
    arts = trained["artifacts"]
    out = R.report([arts["fp32"], arts["int8"]], trained["ckpt"], trained["data"], tmp_path / "r",
                   ReportOptions(max_texts=4, latency_s=0.2, threads=2))
    assert len(calls) == out["data"]["texts"] == 4  # not once per artifact
    assert out["thresholds"] == {} and all(e["verdict"]["passed"] is None for e in out["artifacts"])
    assert "no thresholds" in (tmp_path / "r" / "report.md").read_text()
    with pytest.raises(Exception, match="given twice"):
        R.report([arts["fp32"], arts["fp32"]], trained["ckpt"], trained["data"], tmp_path / "r2")


def test_gate_one_artifact_or_every_artifact_of_a_comparison(trained, capsys):
    report = str(trained["reports"]["compare"] / "report.json")
    arts = trained["artifacts"]
    config = ["--config", str(trained["root"] / "gate.toml")]
    assert main(["gate", report, "--artifact", str(arts["int8"]), *config]) == 0
    assert "FAIL" not in capsys.readouterr().out
    assert main(["gate", report, "--artifact", str(arts["bad"]), *config]) == 1
    err = capsys.readouterr().err
    assert f"FAILED: {arts['bad']}: max_ppl_increase_pct (" in err and "min_top1_agreement" in err
    assert main(["gate", report, *config]) == 1  # every entry: the 2-bit one fails, and is named
    printed = capsys.readouterr()
    assert printed.err.count("FAILED:") == 1 and str(arts["bad"]) in printed.err
    assert "1 of 3 artifacts failed" in printed.err and printed.out.count("FAIL") == 3
    assert main(["gate", report, "--artifact", "elsewhere/none", *config]) == 2
    assert "--artifact elsewhere/none is not in the report" in capsys.readouterr().err
    assert main(["gate", report, "--artifact", "int8", *config]) == 0  # a directory name is enough when unique


def chromium() -> str:
    """Debian's headless browser: found, or installed (root with apt-get), or the test is skipped saying why."""
    import os
    import subprocess

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe:
        return exe
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        pytest.skip("chromium is missing and cannot be installed here (needs root and apt-get): "
                    "apt-get install chromium to run the browser check")
    print("chromium is missing: installing Debian's chromium package for the report.html browser check")
    for cmd in (["apt-get", "install", "-y", "-q", "chromium"], ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "chromium"]):
        subprocess.run(cmd, capture_output=True, timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        exe = shutil.which("chromium")
        if exe:
            return exe
    pytest.skip("apt-get could not install chromium here (no package index reachable)")


PROBE = """<script>window.__errors=[];
window.addEventListener('error',function(e){window.__errors.push(String(e.message||(e.target&&e.target.tagName)||e.type))},true);
var __ce=console.error;console.error=function(){window.__errors.push([].join.call(arguments,' '));__ce.apply(console,arguments)};
window.addEventListener('load',function(){var im=[].slice.call(document.images);
document.title='KILN images='+im.length+' decoded='+im.filter(function(i){return i.complete&&i.naturalWidth>0}).length
+' errors='+window.__errors.length+' '+window.__errors.join('|')})</script>"""


def test_report_renders_in_a_headless_browser(trained, tmp_path):
    """report.html opened in headless Chromium as a user would: a screenshot that is not blank, every image decoded,
    no console or load errors (a copy of the page carries the probe script; the page itself has none)."""
    import subprocess

    from matplotlib.image import imread

    exe = chromium()
    page = trained["reports"]["compare"] / "report.html"
    base = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    run = subprocess.run(base + ["--window-size=1280,1600", f"--screenshot={shot}", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert shot.is_file(), run.stderr[-2000:]
    pixels = imread(str(shot))[..., :3]
    ink = (pixels.mean(-1) < 0.9).mean()  # share of pixels that are not (near) white
    assert pixels.shape[:2] == (1600, 1280) and 0.02 < ink < 0.9 and pixels.std() > 0.05
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    dom = subprocess.run(base + ["--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", "--dump-dom",
                                 probe.as_uri()], capture_output=True, text=True, timeout=120)
    title = re.search(r"<title>(KILN[^<]*)</title>", dom.stdout)
    assert title is not None, dom.stderr[-2000:]
    found = dict(re.findall(r"(\w+)=(\d+)", title.group(1)))
    assert int(found["images"]) == 5 and found["decoded"] == found["images"], title.group(1)
    assert found["errors"] == "0", title.group(1)
    assert "CONSOLE" not in dom.stderr or "Uncaught" not in dom.stderr


def test_gate_still_reads_a_version_1_report_and_refuses_mixed_comparisons(trained, tmp_path, artifacts, capsys):
    one = {"schema": "kiln-report", "schema_version": 1, **entry(trained["reports"]["compare"], 2)}
    (tmp_path / "v1.json").write_text(json.dumps(one))
    assert main(["gate", str(tmp_path / "v1.json"), "--config", str(trained["root"] / "gate.toml")]) == 1
    assert "max_ppl_increase_pct" in capsys.readouterr().err
    assert main(["report", str(trained["artifacts"]["fp32"]), str(artifacts["bert"]), "--reference",
                 str(trained["ckpt"]), "--data", str(trained["data"]), "-o", str(tmp_path / "r")]) == 2
    assert "compare artifacts of one reference" in capsys.readouterr().err and not (tmp_path / "r").exists()


def halves(line: str) -> tuple[str, str]:
    """A line cut at the last space before its middle, past its indentation (the first half may be empty)."""
    indent = len(line) - len(line.lstrip())
    cut = line.rfind(" ", indent, len(line) // 2)
    return (line[:cut], line[cut:].lstrip()) if cut > indent else ("", line)


def cloze_set(ckpt, path, n: int = 48):
    """Multiple choice over held-out standard-library code the model never trained on: a line's second half after
    the two lines before it and its first half, against the same characters in other orders: the words reversed,
    each word spelt backwards. A model that reads code tells them apart; a guess scores a third."""
    lines = [line for line in (ckpt / "heldout.txt").read_text().splitlines() if len(line.strip()) >= 24]
    rng = np.random.default_rng(0)
    rows = []
    for i in range(2, len(lines)):
        head, tail = halves(lines[i])
        if i % 7 or not head:
            continue
        if len(rows) == n:
            break
        words = tail.split(" ")
        options = [tail, " ".join(reversed(words)), " ".join(w[::-1] for w in words)]
        options = [o if k == 0 or o != tail else o + " )" for k, o in enumerate(options)]  # never the answer twice
        order = rng.permutation(len(options))
        rows.append({"prompt": "\n".join(lines[i - 2:i]) + "\n" + head, "choices": [options[k] for k in order],
                     "answer": int(np.argmax(order == 0))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_task_metrics_pass_fp32_and_int8_and_fail_the_damaged_artifact(trained, tmp_path, capsys):
    """A labelled multiple-choice set scored on each artifact and on the reference checkpoint in the same run: FP32
    equals the reference to the example, INT8 stays within the gate, a copy crushed to 2 bits (one set of four levels
    a tensor: the per-column 2-bit copy above barely changes its answers here) fails it naming the set and the
    metric; its drop's interval excludes zero."""
    mc = cloze_set(trained["ckpt"], tmp_path / "cloze.jsonl")
    arts = dict(trained["artifacts"], bad=degrade(trained["artifacts"]["fp32"], tmp_path / "crushed", per_tensor=True))
    (tmp_path / "gate.toml").write_text("[gate]\nmax_accuracy_drop = 0.05\n")
    assert main(["report", str(arts["fp32"]), str(arts["int8"]), str(arts["bad"]), "--reference", str(trained["ckpt"]),
                 "--eval", str(mc), "--max-texts", "4", "--latency-seconds", "0.3", "--threads", "2", "-q",
                 "--config", str(tmp_path / "gate.toml"), "-o", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "accuracy (cloze.jsonl)" in out
    acc = {n: entry(tmp_path / "r", i)["tasks"][0]["metrics"]["accuracy"] for i, n in enumerate(("fp32", "int8", "bad"))}
    assert acc["fp32"]["reference"] > 0.8  # the trained model reads code: far above a guess (a third)
    assert acc["fp32"]["drop"] == 0 and acc["fp32"]["drop_interval"] == [0, 0]
    assert acc["bad"]["drop"] > 0.1 and acc["bad"]["drop_interval"][0] > 0
    assert entry(tmp_path / "r", 2)["tasks"][0]["examples"] == 48
    report = str(tmp_path / "r" / "report.json")
    assert main(["gate", report, "--artifact", str(arts["fp32"]), "--config", str(tmp_path / "gate.toml")]) == 0
    assert main(["gate", report, "--artifact", str(arts["int8"]), "--config", str(tmp_path / "gate.toml")]) == 0
    capsys.readouterr()
    assert main(["gate", report, "--artifact", str(arts["bad"]), "--config", str(tmp_path / "gate.toml")]) == 1
    err = capsys.readouterr()
    assert "max_accuracy_drop" in err.err and "cloze.jsonl" in err.out
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| cloze.jsonl | multiple_choice | 48 | accuracy |" in md
    # lm-evaluation-harness on the same data, offline, through its command line with the kiln model type: the same
    # accuracy as the report's for the damaged artifact (and it imports no torch to run an artifact)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "cloze.yaml").write_text(
        f"task: kiln_cloze\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mc}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{prompt}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    subprocess.run([sys.executable, "-m", "kiln.evaluate.lm_eval", "run", "--model", "kiln", "--model_args",
                    f"artifact={arts['bad']},threads=2,check=false", "--tasks", "kiln_cloze", "--include_path",
                    str(tmp_path / "tasks"), "--output_path", str(tmp_path / "lm")], check=True, env=env,
                   capture_output=True, text=True, timeout=600)
    results = json.loads(next((tmp_path / "lm").rglob("results*.json")).read_text())["results"]["kiln_cloze"]
    assert results["acc,none"] == pytest.approx(acc["bad"]["value"], abs=1e-12)
