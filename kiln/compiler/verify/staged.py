"""The staged artifact against the eager model, before anything is renamed into place: parity on text and random
cases (through ``kiln.runtimes``, as an app opens it), the KV-cache generation check, INT4's second check against
the solver's codes, FP16/BF16 numerics through an FP32 emulation, then latency. A failure raises ``ParityError`` with
the report kept in a temporary directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

import kiln.runtimes as kr
from kiln.compiler import manifest as manifest_lib
from kiln.compiler import stream as stream_lib
from kiln.compiler import trace
from kiln.compiler.load import Checkpoint
from kiln.compiler.options import REDUCED_FLOAT, CompileOptions
from kiln.compiler.quantize.driver import cost_and_gain
from kiln.compiler.staging import GRAPH
from kiln.compiler.verify import cases as case_lib
from kiln.compiler.verify import canary
from kiln.compiler.verify.generation import GENERATION_STEPS, ROW_COUNTS, verify_generation, verify_rows, verify_seq2seq
from kiln.compiler.verify.parity import EXACT_SESSION, fails_on_case, failures, fp32_activations, latency, verify
from kiln.errors import GraphRunError, ParityError
from kiln.runtimes.artifact import REPORT, SCHEMA_VERSION, Manifest

Progress = Callable[[str], None]


def fp64_fits(ckpt: Checkpoint) -> bool:
    """A float64 copy of the model (FP32 parity's rounding check) fits in a third of the memory available now."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such counter here: only the total is known
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    return sum(p.numel() for p in ckpt.model.parameters()) * 8 < available / 3


def scratch_graph(root: Path, transform: Callable[[onnx.ModelProto], onnx.ModelProto], prefix: str) -> Path:
    """A scratch copy of the staged artifact (a temporary directory the caller removes) whose graph is
    ``transform`` of the staged one; the other files (tokenizer, ...) copied as they are."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    for f in root.iterdir():
        if f.is_file() and not f.name.startswith(GRAPH):
            shutil.copy2(f, out / f.name)
    onnx.save_model(transform(onnx.load(str(root / GRAPH))), str(out / GRAPH), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=GRAPH + ".data")
    return out


def exact_copy(root: Path) -> Path:
    """A scratch copy of the staged graph with every MatMulNBits at accuracy_level 0 (FP32 activations): it
    computes exactly what the codes dequantize to, so verification can compare it with the fake-quantized model
    to float rounding (the shipped kernel also rounds activations to int8 per block)."""
    return scratch_graph(root, fp32_activations, "kiln-codes-")


FP16_CPU_UNFAITHFUL = ("ONNX Runtime CPU loads it, but its FP16 graph is not IEEE-faithful at overflow (a decomposed "
                       "RMSNorm whose x**2 exceeds 65504 returns the FP32 answer there, zeros in IEEE FP16: "
                       "tests/passes/test_reduce_precision.py), so it would hide what a strongly typed engine stores")


def numerics_graph(root: Path, precision: str) -> tuple[Path, dict[str, Any]]:
    """FP16/BF16 (TensorRT graphs): a scratch directory holding the FP32 emulation of the graph's rounding
    (kiln/compiler/verify/emulate.py), which verification runs, and a record of how and why."""
    import onnxruntime as ort

    from kiln.compiler.verify.emulate import emulate

    dtype = REDUCED_FLOAT[precision]
    try:
        ort.InferenceSession(str(root / GRAPH), providers=["CPUExecutionProvider"])
        why = FP16_CPU_UNFAITHFUL
    except Exception as e:  # ORT's untyped errors: only a missing kernel is expected here
        if "NOT_IMPLEMENTED" not in str(e):
            raise
        why = "ONNX Runtime CPU: " + str(e).split(":", 3)[-1].strip().splitlines()[0]
    out = scratch_graph(root, emulate, "kiln-emulate-")
    return out, {"graph": "emulated", "ran_on": "onnxruntime-cpu",
                 "how": f"FP32 kernels with every {dtype} value rounded to {dtype} where it is produced", "why": why}


def remedy(report: dict[str, Any], options: CompileOptions, kind: str = "decoder") -> str:
    """The fix to name when a quantized graph misses its bound against FP32 while it computes what was rounded
    (the codes check passed, or there is none; the generation check, run only after parity, did not fail): the
    rounding itself costs this model too much, and a higher tier for its most sensitive weights is the remedy."""
    if options.precision not in ("int8", "int4") or not (report.get("codes") or {}).get("passed", True) \
            or "generation" in report:
        return ""
    # a budget the model's kind measures (an encoder's is its pooled cosine; --max-drop refuses the others)
    budget = "tighten --max-drop" if options.max_drop else "--max-drop cosine=0.99" if kind == "encoder" else \
        "--max-drop top1=0.95"
    up = "INT8" if options.precision == "int4" else "FP32"
    other = "--quant-method gptq, or --precision int8" if options.precision == "int4" else "--precision fp16"
    return (f"; the rounding itself costs this model more than {options.precision.upper()}'s bound: keep its most "
            f"sensitive weights at {up} with {budget} (calibration text through the checkpoint's tokenizer or "
            f"--calibration FILE), or try {other}")


def verify_artifact(ckpt: Checkpoint, root: Path, data: dict[str, Any], options: CompileOptions,
                    say: Progress, codes: Any = None) -> dict[str, Any]:
    """Parity (and the KV-cache generation check) against eager PyTorch, then latency; raises ParityError
    with the report kept in a temporary directory, or returns the report.

    INT4 (``codes``: the eager model with the quantized weights' dequantized values): the artifact is checked
    twice, against eager FP32 with INT4's quality floor and against ``codes`` with a tight bound (the packed
    kernels compute what the solver chose), and the generation check runs against ``codes``."""
    staged = Manifest(root, data)
    if ckpt.kind == "seq2seq":
        say(f"verify generation: {GENERATION_STEPS} greedy steps through encoder + cached decoder vs Hugging Face generate")
        ids, mask = case_lib.seq2seq_sources(ckpt, options.seed)
        one = int(mask[0].sum())
        with kr.open_manifest(staged, threads=options.threads) as artifact:
            gen = verify_seq2seq(ckpt.model, artifact, ids, mask, GENERATION_STEPS, options.precision)
            gen_1 = verify_seq2seq(ckpt.model, artifact, ids[:1, :one], mask[:1, :one], GENERATION_STEPS,
                                   options.precision)
            report = {"precision": options.precision, "generation": gen, "generation_1": gen_1,
                      "passed": gen["passed"] and gen_1["passed"], "cases": [], "summary": {}}
            if report["passed"]:
                say("record the canary: the artifact's own acceptance test, run wherever it is loaded")
                data["canary"] = canary.record(ckpt, artifact, root, options.precision, ckpt.model, False,
                                               seed=options.seed)
    elif ckpt.streamed:
        report = stream_lib.verify(ckpt, root, staged, data, options, say, codes)
    else:
        inputs = [s.name for s in trace.io_specs(ckpt)[0]]
        cases = case_lib.text_cases(ckpt, inputs) + case_lib.random_cases(ckpt, inputs, options.verify_max_length,
                                                                          options.seed)
        eager = trace.EagerRunner(ckpt)
        prompts = case_lib.generation_prompts(ckpt, options.seed)  # generation, continuous batching, the canary
        exact_dir = exact_copy(root) if codes is not None else None
        emulated, numerics = numerics_graph(root, options.precision) if options.precision in REDUCED_FLOAT else (None, {})
        if numerics:
            say(f"verify the {options.precision} graph's numerics: {numerics['how']}")
        try:
            with kr.open_manifest(Manifest(emulated, data) if emulated else staged, threads=options.threads) as artifact, \
                    (kr.open_manifest(Manifest(exact_dir, data), threads=options.threads, session_config=EXACT_SESSION)
                     if exact_dir
                     else contextlib.nullcontext()) as exact_artifact:
                report = verify(eager, artifact, cases, options.precision, say,
                                exact=(lambda: trace.EagerRunner.exact(ckpt)) if fp64_fits(ckpt) else None)
                if codes is not None:
                    say("verify the codes: the graph with FP32 activations (accuracy_level 0) vs the fake-quantized model")
                    exact = verify(trace.EagerRunner(dataclasses.replace(ckpt, model=codes)), exact_artifact, cases,
                                   "int4-codes")
                    report["codes"] = {k: exact[k] for k in ("tolerance", "summary", "cases", "passed")}
                    report["passed"] = report["passed"] and exact["passed"]
                if report["passed"] and ckpt.task == "causal-lm":
                    through = "the KV cache" if "kv_cache" in data else "full recomputation (no KV cache)"
                    say(f"verify generation: {GENERATION_STEPS} greedy steps through {through} vs Hugging Face "
                        "generate, a padded batch and batch 1" +
                        (" (the codes: FP32-activation graph vs the fake-quantized model)" if codes else ""))
                    for key, rows in (("generation", prompts), ("generation_1", prompts[:1])):
                        report[key] = verify_generation(codes if codes is not None else ckpt.model,
                                                        exact_artifact if codes is not None else artifact, rows,
                                                        GENERATION_STEPS,
                                                        "int4-codes" if codes is not None else options.precision,
                                                        data["generation"]["pad_token_id"])
                    report["passed"] = report["generation"]["passed"] and report["generation_1"]["passed"]
                    if report["passed"]:
                        say(f"verify continuous batching: {', '.join(map(str, ROW_COUNTS))} rows of different lengths, "
                            "each against itself alone")
                        rows_report = verify_rows(artifact, prompts, options.precision)
                        if rows_report is not None:
                            report["rows"] = rows_report
                            report["passed"] = rows_report["passed"]
                if report["passed"]:
                    say("record the canary: the artifact's own acceptance test, run wherever it is loaded")
                    data["canary"] = canary.record(ckpt, artifact, root, options.precision,
                                                   codes if codes is not None else ckpt.model, codes is not None,
                                                   prompts, options.seed)
                if numerics:
                    report["numerics"] = numerics
                if report["passed"] and not emulated:  # an emulation's speed is not the engine's
                    say("measure latency (eager vs artifact)")
                    feeds = case_lib.latency_feeds(ckpt, inputs, options.latency_shape, options.seed)
                    report["latency"] = latency(eager, artifact, feeds, options.latency_budget_s)
        except GraphRunError as e:
            raise fails_on_case(ckpt.path, e) from e
        finally:
            for scratch in (exact_dir, emulated):
                if scratch is not None:
                    shutil.rmtree(scratch, ignore_errors=True)
    report = {"schema_version": SCHEMA_VERSION, "checkpoint": str(ckpt.path),
              "verified_on": manifest_lib.VERIFIED_ON, **report}
    if not report["passed"]:
        kept = Path(tempfile.mkdtemp(prefix="kiln-parity-")) / REPORT
        kept.write_text(json.dumps(report, indent=2))
        problems = failures(report)
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ParityError(f"parity check failed for {ckpt.path}: {'; '.join(problems[:3])}{more}; "
                          f"no artifact written, full report in {kept}{remedy(report, options, ckpt.kind)}")
    summary = cost_and_gain(data["passes"], report)
    if summary:
        report["quantization"] = summary
    if ckpt.pruning is not None:
        from kiln.compiler import prune as prune_lib

        report["pruning"] = prune_lib.summary(ckpt.pruning, report.get("latency"))
    return report
