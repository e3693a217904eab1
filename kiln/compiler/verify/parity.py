"""Parity and latency between any two runners (``run(feeds) -> dict``); knows no backend.

A case is a dict of feeds. Per output it measures max abs error, max relative error, minimum
cosine similarity of rows and, for logits, top-1 agreement; the tolerance table per precision
decides pass or fail. A case or output with nothing to compare (no real-token rows, no decisive
position) reports the metric as absent, and verification needs at least one compared row per output.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import numpy as np

from kiln.compiler.verify import metrics
from kiln.compiler.verify.cases import Case, Feeds
from kiln.errors import GraphRunError, KilnError, ParityError

log = logging.getLogger(__name__)



class Runner(Protocol):
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class Tolerance:
    abs_factor: float
    """max abs error allowed = abs_factor * max(1, max |reference|) per output and case."""
    min_top1: float
    """top-1 agreement required on logits, over positions where the reference is decisive."""
    min_cosine: float | None = None
    """When set (quantized precisions), rows must reach this cosine similarity instead of the abs bound;
    the abs bound then only decides which logit positions are decisive for top-1."""
    min_mean_cosine: float | None = None
    """When set, the mean row cosine of each output and text case must reach it as well: INT4's worst row is
    noisy (SmolLM2-135M GPTQ group 128: one 7-token text's worst row 0.73, its mean far higher), its mean is not."""
    random_min_cosine: float | None = None
    """When set, random-id cases need only this cosine (text cases the full ``min_cosine``): a weight-only INT4
    solver is fitted to text, and random ids at full length sit far outside it (all-MiniLM-L6-v2 GPTQ group 32:
    held-out sentences min 0.985, random 3x512 ids 0.79; SmolLM2-135M group 128: random 2x17 ids 0.27).
    Their top-1 is then judged over the decisive positions of all random cases pooled (``min_top1`` unchanged):
    one short case holds about 16 decisive positions, where two flips of a random-init test model already fell
    to 75% (a 2-layer StableLM at INT4, 1 run in about 10; the other cases 100%)."""
    centered_logits: bool = False
    """Logit rows are compared after subtracting each row's mean: a constant shift leaves the softmax unchanged
    but swings an uncentered cosine (SmolLM2 INT4 RTN: a row at cosine -0.001 uncentered, 0.76 centered)."""


# INT8, measured with the default --precision int8: all-MiniLM-L6-v2 worst token-row cosine 0.9936 (sentence
# 0.9963), the trained reference Llama (llama-tiny, blocked INT8) worst logit-row cosine 0.99994 with decisive
# top-1 100%, SmolLM2-135M 0.9953. One layer's weight scales doubled: 0.44-0.89; 2-bit weights: below 0.15
# (tests/compiler/test_int8_tolerance.py).
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(abs_factor=1e-4, min_top1=1.0),
    "int8": Tolerance(abs_factor=5e-2, min_top1=0.95, min_cosine=0.98),
    # INT4 against eager FP32: the quality floor (what 4 bits cost a small model; SmolLM2-135M GPTQ group 128:
    # worst row 0.73, mean 0.89 on a 7-token text; the held-out perplexity and the budget say more). The codes:
    # the graph with FP32 activations (accuracy_level 0) against the fake-quantized eager model, to float
    # rounding: the packed kernels compute what the solver chose (planted bugs: tests/compiler/test_int4.py)
    "int4": Tolerance(abs_factor=1e-1, min_top1=0.80, min_cosine=0.5, min_mean_cosine=0.85, random_min_cosine=0.2,
                      centered_logits=True),
    "int4-codes": Tolerance(abs_factor=1e-3, min_top1=1.0),
    # TensorRT's reduced floats against eager FP32, checked through the rounding emulation (kiln/compiler/verify/
    # emulate.py). FP16, worst row cosine: all-MiniLM-L6-v2 0.999994, SmolLM2-135M 0.999870; the MiniLM graph stored
    # in BF16 instead 0.99972 (fails). BF16: MiniLM 0.99960, SmolLM2 0.99700; the MiniLM graph stored in FP8 E4M3
    # 0.927 (fails) (tests/compiler/test_reduced_precision.py)
    "fp16": Tolerance(abs_factor=1e-2, min_top1=0.98, min_cosine=0.9998),
    "bf16": Tolerance(abs_factor=5e-2, min_top1=0.95, min_cosine=0.99),
}


EXACT_SESSION = {"session.qdq_matmulnbits_accuracy_level": "0"}
"""INT4's codes check runs the graph with every MatMulNBits at accuracy_level 0 (FP32 activations); ONNX Runtime
fuses blocked DequantizeLinear + MatMul into MatMulNBits, by default at accuracy level 4: this keeps that FP32 too."""


def fp32_activations(model: Any) -> Any:
    """The graph of INT4's codes check: every MatMulNBits and QMoE of ``model`` (an onnx ModelProto) at
    accuracy_level 0 (FP32 activations), in place; kiln's own MatMulNBits (always int8 activations) become ONNX
    Runtime's for it."""
    from kiln.passes.kiln_kernels import fallback

    fallback(model)
    for node in model.graph.node:
        if node.op_type in ("MatMulNBits", "QMoE"):
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = 0
    return model


ROUNDING_FACTOR = 3.0
"""FP32 only: a case over the abs bound still passes when the artifact is within this many times PyTorch's own
FP32 rounding of the exact (FP64) answer, measured on that case. An ill-conditioned model (SmolLM2-135M with 20% of
its FFN channels cut by magnitude, its massive activations gone: eager FP32 is 0.0045 off its FP64 self on random
ids, the unpruned model 7e-5) then passes on what FP32 can do; a graph bug is far above either bound."""


def _rows(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows, features) views of both outputs and, for a per-token output with padding, the real-token rows' indices
    (None: every row): padded positions are skipped by index as chunks are read, never by a masked copy (a 3 x 512
    case of a 128k vocabulary holds 788 MB of logits a side)."""
    if mask is not None and a.ndim >= 2 and a.shape[:2] == mask.shape:
        width = int(np.prod(a.shape[2:], dtype=np.int64))
        keep = mask.reshape(-1).astype(bool)
        return a.reshape(-1, width), b.reshape(-1, width), None if keep.all() else np.flatnonzero(keep)
    lead = a.shape[0] if a.ndim > 1 else 1
    return a.reshape(lead, -1), b.reshape(lead, -1), None


def _chunks(arrays: tuple[np.ndarray, ...], index: np.ndarray | None) -> Iterator[tuple[np.ndarray, ...]]:
    """The rows of ``arrays`` (``index``'s, or all), about ``CHUNK_ELEMENTS`` values at a time, as float64 copies of
    that chunk only."""
    step = max(1, CHUNK_ELEMENTS // max(1, arrays[0].shape[1]))
    total = arrays[0].shape[0] if index is None else len(index)
    for lo in range(0, total, step):
        rows = slice(lo, lo + step) if index is None else index[lo:lo + step]
        yield tuple(a[rows].astype(np.float64) for a in arrays)


CHUNK_ELEMENTS = 1 << 22
"""Rows are compared in chunks of about this many values (float64 temporaries of ~32 MB): a 3 x 512 case of a
128k vocabulary is 200M logits, whose whole-array float64 copies would take gigabytes."""


FEW_LABELS = 64
"""Logits of shape (batch, labels) this narrow are a sequence classification head's (a decoder's are per position,
and thousands wide). Their row cosine says
little: two labels' logits near zero swing it from 1 to 0.96 for an error of 0.05 (a MiniLM sentiment classifier
at INT8, every decision kept), and their size depends on the input (random ids: under 1). A quantized head is
judged on what it outputs, its label probabilities: the largest change of one (softmax, so a shift of every logit
is none) within the precision's ``abs_factor``, and its top-1 on decisive rows."""


def compare_output(name: str, ref: np.ndarray, got: np.ndarray, mask: np.ndarray | None, tol: Tolerance) -> dict[str, Any]:
    if ref.shape != got.shape:
        return {"passed": False, "error": f"shape {list(got.shape)} != reference {list(ref.shape)}"}
    r_all, g_all, index = _rows(ref, got, mask)
    compared = r_all.shape[0] if index is None else len(index)
    if compared == 0 or r_all.shape[1] == 0:  # nothing real to compare: no verdict either way, and no numbers
        return {"passed": None, "compared": 0}
    peak, finite = 0.0, True
    for r, g in _chunks((r_all, g_all), index):
        peak = max(peak, float(np.abs(r).max()))
        finite = finite and bool(np.isfinite(g).all())
    if not finite:
        return {"passed": False, "error": "artifact produced NaN or Inf at real-token positions"}
    scale = max(1.0, peak)
    atol = tol.abs_factor * scale
    logits = name == "logits" and r_all.shape[1] > 1
    max_abs, max_rel, cosines = 0.0, 0.0, []
    decisive = agree_decisive = agree_all = 0
    for r, g in _chunks((r_all, g_all), index):
        diff = np.abs(r - g)
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / (np.abs(r) + 1e-6 * scale)).max()))
        del diff
        pair = (metrics.centered(r), metrics.centered(g)) if name == "logits" and tol.centered_logits else (r, g)
        cosines.append(metrics.row_cosines(*pair))
        if logits:
            counts = metrics.top1_counts(r, g, atol)
            decisive += counts["decisive"]
            agree_decisive += counts["agree_decisive"]
            agree_all += counts["agree"]
    cos = np.concatenate(cosines)
    cos_min = float(cos.min())
    head = tol.min_cosine is not None and logits and ref.ndim == 2 and r_all.shape[1] <= FEW_LABELS
    out: dict[str, Any] = {
        "compared": int(compared), "max_abs": max_abs, "atol": atol, "max_rel": max_rel, "cosine_min": cos_min,
        "cosine_mean": float(cos.mean()), "cosine_bound": None if head else tol.min_cosine,
        "mean_bound": None if head else tol.min_mean_cosine,
        "passed": max_abs <= atol if tol.min_cosine is None else bool(
            cos_min >= tol.min_cosine and (tol.min_mean_cosine is None or cos.mean() >= tol.min_mean_cosine)),
    }
    if head:
        prob = max(float(np.abs(np.exp(metrics.log_softmax(r)) - np.exp(metrics.log_softmax(g))).max())
                   for r, g in _chunks((r_all, g_all), index))
        out |= {"prob_max_abs": prob, "prob_bound": tol.abs_factor, "passed": prob <= tol.abs_factor}
    if logits:
        agreement = agree_decisive / decisive if decisive else None
        out["top1_agreement"] = agreement  # None: every position a near-tie, nothing decisive to check
        out["top1_agreement_all"] = agree_all / compared
        out["top1_ties_excluded"] = int(compared - decisive)
        out["top1_decisive"], out["top1_agree_decisive"] = decisive, agree_decisive
        if agreement is not None:
            out["passed"] = out["passed"] and agreement >= tol.min_top1
    return out


def rounding_check(out: dict[str, Any], ref: np.ndarray, got: np.ndarray, exact: np.ndarray,
                   mask: np.ndarray | None) -> None:
    """An FP32 output over its abs bound (top-1 fine) against the FP64 reference: passes when the artifact is within
    ``ROUNDING_FACTOR`` times PyTorch's own FP32 distance from FP64; records both distances either way."""
    r_all, g_all, index = _rows(ref, got, mask)
    e_all = _rows(exact, exact, mask)[0]
    eager = artifact = 0.0
    for r, g, e in _chunks((r_all, g_all, e_all), index):
        eager, artifact = max(eager, float(np.abs(r - e).max())), max(artifact, float(np.abs(g - e).max()))
    bound = max(out["atol"], ROUNDING_FACTOR * eager)
    out["rounding"] = {"eager_vs_fp64": eager, "artifact_vs_fp64": artifact, "bound": bound}
    out["passed"] = artifact <= bound


def verify(reference: Runner, candidate: Runner, cases: list[Case], precision: str,
           progress: Callable[[str], None] | None = None, exact: Callable[[], Runner] | None = None) -> dict[str, Any]:
    """``exact``: builds an FP64 reference, asked for only when an FP32 case misses its abs bound alone."""
    tol = TOLERANCES[precision]
    results = []
    exact_runner: Runner | None = None
    for i, case in enumerate(cases):
        if progress:
            progress(f"verify {i + 1}/{len(cases)}: {case.name}")
        ref = reference.run(case.feeds)
        try:
            got = candidate.run(case.feeds)
        except GraphRunError as e:
            e.at = f"{case.name} (input_ids {'x'.join(map(str, case.feeds['input_ids'].shape))})"
            raise
        mask = case.feeds.get("attention_mask")
        case_tol = tol
        if case.source == "random" and tol.random_min_cosine is not None:  # top-1: pooled below
            case_tol = replace(tol, min_cosine=tol.random_min_cosine, min_mean_cosine=None, min_top1=0.0)
        elif tol.min_cosine is not None:  # quantized text cases: top-1 pooled below as well
            case_tol = replace(tol, min_top1=0.0)
        outputs = {n: compare_output(n, ref[n], got[n], mask, case_tol) for n in ref}
        abs_only = [n for n, o in outputs.items() if o["passed"] is False and "error" not in o and
                    tol.min_cosine is None and o["max_abs"] > o["atol"] and
                    (o.get("top1_agreement") is None or o["top1_agreement"] >= tol.min_top1)]
        if abs_only and exact is not None:
            if progress:
                progress(f"verify {case.name}: over the FP32 bound; measuring PyTorch's own FP32 rounding against FP64")
            exact_runner = exact_runner or exact()
            ref64 = exact_runner.run(case.feeds)
            for n in abs_only:
                rounding_check(outputs[n], ref[n], got[n], ref64[n], mask)
        shape = list(case.feeds["input_ids"].shape)
        verdicts = [o["passed"] for o in outputs.values() if o["passed"] is not None]
        results.append({"name": case.name, "source": case.source, "shape": shape, "outputs": outputs,
                        "passed": all(verdicts) if verdicts else None})
    summary = summarize(results)
    uncompared = [n for n, s in summary.items() if not s["compared"] and "error" not in s]
    pooled = {f"{source}_top1": top1 for source, on in (("random", tol.random_min_cosine is not None),
                                                         ("text", tol.min_cosine is not None))
              if on and (top1 := pooled_top1(results, tol, source))}
    return {
        "precision": precision, "tolerance": asdict(tol), "cases": results, "summary": summary,
        "uncompared_outputs": uncompared, **pooled,
        "passed": bool(results) and not uncompared and all(r["passed"] is not False for r in results) and
        all(p["passed"] for top1 in pooled.values() for p in top1.values()),
    }


def fails_on_case(source: Any, e: GraphRunError) -> KilnError:
    """The compile's error for a graph that ONNX Runtime could not run on a verification case (``e`` unchanged when
    it was not running one)."""
    if e.at is None:
        return e
    return ParityError(
        f"{source}: the compiled graph fails on verification case {e.at}: {e.detail}; it holds fixed a size that "
        "varies with the input (a shape the model's forward computed from the traced example's batch or length as a "
        "Python number), or a pass broke it (compare with --disable-pass NAME); no artifact written: report it "
        "with the checkpoint's config.json")


def pooled_top1(results: list[dict[str, Any]], tol: Tolerance, source: str) -> dict[str, dict[str, Any]]:
    """Per logits output, top-1 agreement over the decisive positions of every case from ``source`` together (random
    ids; a quantized artifact's texts): one short case holds a handful of decisive positions, where one flip of a
    random-init model's near-tied logits (thread counts, kernel paths, test order) swings it by a third (a Gemma 3
    INT4 test model: 66.67% on a 7-token text on one machine, 100% on another). An output with no decisive position
    is left out (nothing to measure)."""
    pooled: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["source"] != source:
            continue
        for name, o in r["outputs"].items():
            if o.get("top1_decisive"):
                p = pooled.setdefault(name, {"decisive": 0, "agree": 0})
                p["decisive"] += o["top1_decisive"]
                p["agree"] += o["top1_agree_decisive"]
    for p in pooled.values():
        p["agreement"], p["bound"] = p["agree"] / p["decisive"], tol.min_top1
        p["passed"] = p["agreement"] >= tol.min_top1
    return pooled


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Worst value of each metric per output across the cases that compared something; a metric no case
    measured is left out."""
    worst: dict[str, dict[str, Any]] = {}
    for r in results:
        for name, o in r["outputs"].items():
            w = worst.setdefault(name, {"compared": 0, "passed": True})
            w["passed"] = w["passed"] and o["passed"] is not False
            if "error" in o:
                w["error"] = o["error"]
                continue
            if not o.get("compared"):
                continue
            w["compared"] += o["compared"]
            for key, pick in (("max_abs", max), ("max_rel", max), ("cosine_min", min), ("cosine_mean", min),
                              ("top1_agreement", min)):
                if o.get(key) is not None:
                    w[key] = pick(w[key], o[key]) if key in w else o[key]
    return worst


def failures(report: dict[str, Any]) -> list[str]:
    """One short phrase per failing (case, output), for the error message."""
    out = []
    for key, label in (("generation", "greedy generation"), ("generation_1", "batch-1 greedy generation")):
        out += _generation_failure(report.get(key), label)
    rows = report.get("rows")
    if rows and not rows["passed"]:
        worst = {n: round(x, 3) for n, x in rows["max_abs_over_bound"].items()}
        out.append(f"continuous batching: a row's decode logits beside others differ from the same row alone by "
                   f"{worst} times the bound {rows['bound']:g} (rows: times the bound); the kernels compute one row "
                   "differently from several on this machine")
    for name in report.get("uncompared_outputs", []):
        out.append(f"output {name}: no case compared a single real-token row")
    return out + _case_failures(report)


def _generation_failure(gen: dict[str, Any] | None, label: str) -> list[str]:
    out = []
    if gen and not gen["passed"] and "error" in gen:
        out.append(f"{label} through the KV cache failed to run: {gen['error']}")
    elif gen and not gen["passed"]:
        why = ""
        if gen.get("generate_inputs"):
            why = (f"; the model's generate feeds its forward {', '.join(gen['generate_inputs'])} "
                   "(its prepare_inputs_for_generation), which the compiled forward does not take, so its next token "
                   "is not the forward's last logits: its generation is not supported (report it with the "
                   "checkpoint's config.json)")
        elif gen.get("reference") == "rows alone" and gen.get("through") == "kv cache":
            why = ("; the reference ran each prompt alone because the model's forward takes no position_ids, so a "
                   "left-padded row the model numbers from its first pad fails here (kiln's KV cache decodes "
                   "left-padded batches; such a model is not supported yet: report it with the checkpoint's "
                   "config.json)")
        out.append(f"{label}: {len(gen['wrong_tokens'])} wrong decisive token(s) (first {gen['wrong_tokens'][:1]}), "
                   f"step logits at {gen['max_abs_over_atol']:.3g}x the tolerance, cosine min {gen['cosine_min']:.4f}, "
                   f"tokens identical {gen['tokens_identical']}{why}")
    return out


def _case_failures(report: dict[str, Any]) -> list[str]:
    out = []
    for source, label in (("random", "random-id"), ("text", "text")):
        for name, p in report.get(f"{source}_top1", {}).items():
            if not p["passed"]:
                out.append(f"{label} cases {name}: top-1 agreement {p['agreement']:.2%} over {p['decisive']} decisive "
                           f"positions < {p['bound']:.0%}")
    cases = [(r, "") for r in report["cases"]] + \
        [(r, " vs the fake-quantized model") for r in (report.get("codes") or {}).get("cases", [])]
    for r, against in cases:
        for name, o in r["outputs"].items():
            if o["passed"] is not False:
                continue
            where = f"{r['name']} {name}{against}"
            if "error" in o:
                out.append(f"{where}: {o['error']}")
            elif o.get("prob_bound") is not None and o["prob_max_abs"] > o["prob_bound"]:
                out.append(f"{where}: a label probability moved by {o['prob_max_abs']:.4f} > {o['prob_bound']}")
            elif o.get("cosine_bound") is not None and o["cosine_min"] < o["cosine_bound"]:
                out.append(f"{where}: row cosine {o['cosine_min']:.4f} < {o['cosine_bound']}")
            elif o.get("mean_bound") is not None and o["cosine_mean"] < o["mean_bound"]:
                out.append(f"{where}: mean row cosine {o['cosine_mean']:.4f} < {o['mean_bound']}")
            elif "rounding" in o:
                rd = o["rounding"]
                out.append(f"{where}: max abs error {o['max_abs']:.3g} > {o['atol']:.3g}, and {rd['artifact_vs_fp64']:.3g} "
                           f"from FP64 > {ROUNDING_FACTOR:g}x PyTorch's own FP32 rounding ({rd['eager_vs_fp64']:.3g})")
            elif o.get("cosine_bound") is None and o["max_abs"] > o["atol"]:
                out.append(f"{where}: max abs error {o['max_abs']:.3g} > {o['atol']:.3g}")
            else:
                out.append(f"{where}: top-1 agreement {o['top1_agreement']:.2%}")
    return out


def median_latency_ms(runner: Runner, feeds: Feeds, warmup: int = 3, budget_s: float = 2.0,
                      min_runs: int = 5, max_runs: int = 50) -> float:
    for _ in range(warmup):
        runner.run(feeds)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        runner.run(feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def latency(reference: Runner, candidate: Runner, feeds: Feeds, budget_s: float = 4.0) -> dict[str, Any]:
    """Median latency of both, measured in alternating rounds so drift hits both alike."""
    eager, artifact = [], []
    for _ in range(3):
        eager.append(median_latency_ms(reference, feeds, warmup=2, budget_s=budget_s / 6, min_runs=3))
        artifact.append(median_latency_ms(candidate, feeds, warmup=2, budget_s=budget_s / 6, min_runs=3))
    e, a = statistics.median(eager), statistics.median(artifact)
    return {"shape": list(feeds["input_ids"].shape), "eager_ms": e, "artifact_ms": a, "speedup": e / a}
