"""Verification tells the truth: a metric with nothing to measure is absent (never a perfect score), and the
manifest says where the artifact was verified and timed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import fast_options
from kiln.compiler import compile
from kiln.compiler.verify import metrics
from kiln.compiler.verify.generation import compare_steps
from kiln.compiler.verify.cases import Case
from kiln.compiler.verify.parity import TOLERANCES, compare_output, failures, summarize, verify
from kiln.evaluate.report import greedy_match_rate

FP32 = TOLERANCES["fp32"]


def test_case_with_no_real_rows_has_no_numbers_and_no_verdict():
    ref = np.ones((2, 3, 4), np.float32)
    out = compare_output("last_hidden_state", ref, ref + 5, np.zeros((2, 3), np.int64), FP32)
    assert out == {"passed": None, "compared": 0}


def test_padded_rows_are_skipped_and_chunks_see_every_real_row(monkeypatch):
    """Rows are read by index a chunk at a time (no masked copies): what padded positions hold never counts, every
    real row does (a planted error in the last real row of the last chunk fails), and the numbers are those of the
    whole real-row arrays at once."""
    from kiln.compiler.verify import parity

    monkeypatch.setattr(parity, "CHUNK_ELEMENTS", 16)  # two rows of 8 a chunk
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((3, 5, 8)).astype(np.float32)
    mask = np.ones((3, 5), np.int64)
    mask[0, :2] = mask[2, 4:] = 0
    got = ref + rng.standard_normal(ref.shape).astype(np.float32) * 1e-6
    got[mask == 0] = np.nan  # padding: never compared
    out = compare_output("last_hidden_state", ref, got, mask, FP32)
    real = mask.astype(bool)
    r, g = ref[real].astype(np.float64), got[real].astype(np.float64)
    assert out["passed"] is True and out["compared"] == 12
    assert out["max_abs"] == np.abs(r - g).max() and np.isclose(out["cosine_min"], metrics.row_cosines(r, g).min())
    planted = got.copy()
    planted[2, 3] += 1e-2  # the last real row
    assert compare_output("last_hidden_state", ref, planted, mask, FP32)["passed"] is False


def test_top1_without_a_decisive_position_is_absent():
    tied = np.zeros((4, 10), np.float32)  # every row's best two logits are equal
    out = compare_output("logits", tied, tied, None, FP32)
    assert out["top1_agreement"] is None and out["top1_ties_excluded"] == 4 and out["passed"] is True
    assert metrics.top1(tied, tied, 1e-4)["agreement"] is None


def test_a_quantized_classification_head_is_judged_on_its_label_probabilities():
    """Two labels' logits near zero: an INT8 error of 0.05 sends their row cosine to 0.96 while no probability moves
    by more than 0.02, and every decision holds: it passes. A planted error that moves a probability by 0.2 fails,
    naming it; a decoder's wide logits are still judged by their row cosine."""
    int8 = TOLERANCES["int8"]
    ref = np.array([[0.20, 0.10], [4.0, -3.0], [-2.0, 2.5]], np.float32)  # (batch, labels)
    near = ref + np.array([[-0.05, 0.04], [0.03, 0.0], [0.0, -0.02]], np.float32)
    out = compare_output("logits", ref, near, None, int8)
    assert metrics.row_cosines(ref, near).min() < 0.98  # the old criterion would refuse it
    assert out["passed"] and out["prob_max_abs"] < 0.03 and out["cosine_bound"] is None
    planted = ref.copy()
    planted[1] = [1.0, 0.2]  # decisive row still right, but its probability falls from ~1 to 0.69
    bad = compare_output("logits", ref, planted, None, int8)
    assert bad["passed"] is False and bad["prob_max_abs"] > 0.2
    assert "a label probability moved by" in failures({"passed": False, "cases": [
        {"name": "text[0]", "outputs": {"logits": bad}}]})[0]
    wide = np.random.default_rng(0).normal(size=(1, 4, 1000)).astype(np.float32)
    assert compare_output("logits", wide, wide * 0.5 + 0.3, None, int8)["cosine_bound"] == int8.min_cosine
    narrow_tokens = np.zeros((1, 4, 10), np.float32)  # per position (a decoder's, or a token classifier's): cosine
    assert compare_output("logits", narrow_tokens + 1, narrow_tokens + 1, None, int8)["cosine_bound"] == int8.min_cosine


def test_summary_reports_only_what_some_case_measured():
    results = [{"outputs": {"logits": {"passed": None, "compared": 0}}}]
    assert summarize(results) == {"logits": {"compared": 0, "passed": True}}


class Echo:
    def __init__(self, fn):
        self.fn = fn

    def run(self, feeds):
        return {"last_hidden_state": self.fn(feeds["input_ids"].astype(np.float32)[..., None])}


def test_an_output_no_case_compared_fails_verification():
    feeds = {"input_ids": np.ones((1, 3), np.int64), "attention_mask": np.zeros((1, 3), np.int64)}
    report = verify(Echo(lambda x: x), Echo(lambda x: x + 1), [Case("all padding", feeds, "random")], "fp32")
    assert report["passed"] is False and report["uncompared_outputs"] == ["last_hidden_state"]
    assert report["cases"][0]["passed"] is None


def test_planted_error_fails_even_next_to_an_empty_case():
    empty = {"input_ids": np.ones((1, 3), np.int64), "attention_mask": np.zeros((1, 3), np.int64)}
    full = {"input_ids": np.ones((1, 3), np.int64), "attention_mask": np.ones((1, 3), np.int64)}
    report = verify(Echo(lambda x: x), Echo(lambda x: x + 1e-3), [Case("e", empty, "random"), Case("f", full, "random")],
                    "fp32")
    assert report["passed"] is False and report["summary"]["last_hidden_state"]["max_abs"] > 1e-4


def rounding_case(eager_noise, artifact_noise):
    """An exact answer, PyTorch's FP32 ``eager_noise`` away from it and the artifact ``artifact_noise`` away."""
    rng = np.random.default_rng(0)
    exact = rng.normal(size=(1, 6, 8))
    runners = [Echo(lambda x, n=n, d=rng.normal(size=(1, 6, 8)): exact + n * d / np.abs(d).max())
               for n in (eager_noise, artifact_noise)]
    feeds = {"input_ids": np.ones((1, 6), np.int64), "attention_mask": np.ones((1, 6), np.int64)}
    return verify(*runners, [Case("c", feeds, "random")], "fp32", exact=lambda: Echo(lambda x: exact))


def test_an_ill_conditioned_model_passes_on_what_fp32_can_do_and_a_planted_bug_still_fails():
    """Eager FP32 itself 2e-3 from FP64 (20x the abs bound): an artifact as far off passes, with both distances
    recorded; one 10x further (a graph bug on top of the rounding) fails naming the comparison; a well-conditioned
    model (eager 1e-6 from FP64) keeps the plain abs bound, so 1e-3 fails there."""
    ok = verify_output(rounding_case(2e-3, 3e-3))
    assert ok["passed"] is True and ok["rounding"]["eager_vs_fp64"] > 1e-3 and ok["max_abs"] > ok["atol"]
    bad = rounding_case(2e-3, 3e-2)
    assert bad["passed"] is False and "PyTorch's own FP32 rounding" in failures(bad)[0]
    assert rounding_case(1e-6, 1e-3)["passed"] is False


def verify_output(report):
    return report["cases"][0]["outputs"]["last_hidden_state"]


def test_generation_agreement_is_absent_when_every_step_is_a_tie():
    tied = np.zeros((3, 2, 8), np.float32)  # (steps, batch, vocab)

    def forced():
        yield from tied

    out = compare_steps(forced, tied, np.zeros((2, 3), np.int64), lambda: np.zeros((2, 3), np.int64), TOLERANCES["int8"])
    assert out["decisive_agreement"] is None and out["passed"]


def test_greedy_match_rate_is_absent_when_the_cache_has_no_room():
    full = SimpleNamespace(manifest=SimpleNamespace(data={"kv_cache": {"capacity": 4}, "generation": {}}),
                           max_sequence_length=4)
    assert greedy_match_rate(full, None, [[1, 2, 3, 4]]) is None


def test_manifest_says_where_a_tensorrt_graph_was_verified(checkpoints, tmp_path):
    out = compile(checkpoints["bert"], tmp_path / "trt", fast_options(target="tensorrt"))
    v = json.loads((out / "manifest.json").read_text())["verification"]
    assert v["verified_on"]["backend"] == "onnxruntime" and v["verified_on"]["device"] == "cpu"
    assert "no TensorRT engine was built or run" in v["verified_on"]["note"]
    assert v["latency"]["measured_on"] == "onnxruntime cpu"
    report = json.loads((out / "report.json").read_text())
    assert report["verified_on"]["providers"] == ["CPUExecutionProvider"]


def test_the_rounding_check_never_rescues_a_top1_miss():
    """Logits whose decisive best token the artifact changes fail on top-1 alone: the FP64 reference is not even
    built (so an ill-conditioned model cannot excuse a wrong answer)."""
    logits = np.zeros((1, 4, 10), np.float32)
    logits[..., 3], logits[..., 7] = 1.0, 0.95
    swapped = logits.copy()
    swapped[..., 3], swapped[..., 7] = 0.95, 1.0

    class Logits:
        def __init__(self, value):
            self.value = value

        def run(self, feeds):
            return {"logits": self.value}

    asked = []
    feeds = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    report = verify(Logits(logits), Logits(swapped), [Case("c", feeds, "random")], "fp32",
                    exact=lambda: asked.append(1) or Logits(logits))
    out = report["cases"][0]["outputs"]["logits"]
    assert report["passed"] is False and out["top1_agreement"] == 0.0 and "rounding" not in out and not asked


@pytest.mark.parametrize("source", ["random", "text"])
def test_quantized_top1_is_judged_over_every_case_of_a_source_pooled(source):
    """INT4's random-id cases, and a quantized artifact's text cases, are judged on top-1 over their decisive
    positions together: four flips among one short case's 16 decisive positions (75%) do not fail an artifact that
    agrees everywhere else (a random-init model's near-ties flip by machine and thread count), while the same bound
    (80%) still fails a planted error that flips a quarter of all positions of that source."""
    int4 = TOLERANCES["int4"]

    class Logits:
        def __init__(self, table):
            self.table = table

        def run(self, feeds):
            return {"logits": self.table[feeds["input_ids"].shape[1]]}

    def logits(seq, flips):
        ref = np.zeros((1, seq, 10), np.float32)
        ref[..., 3] = 10.0
        got = ref.copy()
        got[0, :flips, 7] = 10.5 if source == "text" else 20.0  # text: a flip whose row keeps its cosine bound
        return ref, got

    def run(short_flips, long_flips):
        (r16, g16), (r64, g64) = logits(16, short_flips), logits(64, long_flips)
        cases = [Case(f"{source} 1x{n}", {"input_ids": np.ones((1, n), np.int64),
                                          "attention_mask": np.ones((1, n), np.int64)}, source) for n in (16, 64)]
        return verify(Logits({16: r16, 64: r64}), Logits({16: g16, 64: g64}), cases, "int4")

    key = f"{source}_top1"
    report = run(4, 0)
    assert report["cases"][0]["outputs"]["logits"]["top1_agreement"] == 0.75
    assert report["passed"] is True and report[key]["logits"]["decisive"] == 80
    assert report[key]["logits"]["agreement"] == 76 / 80 and not failures(report)
    bad = run(4, 16)
    assert bad["passed"] is False and bad[key]["logits"]["agreement"] == 60 / 80
    label = "random-id" if source == "random" else "text"
    assert failures(bad) == [f"{label} cases logits: top-1 agreement 75.00% over 80 decisive positions < 80%"]
