"""``kiln`` command line. Exit codes: 0 success, 1 the job failed, 2 bad usage.

``kiln run`` and ``kiln generate`` use only ``kiln.runtimes``; torch is imported by ``kiln compile`` (and by
``kiln bench --eager`` / ``kiln report``, which run the checkpoint eagerly).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from kiln import __version__
from kiln.errors import ArtifactError, KilnError, UsageError
from kiln.serve.guard import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES


def _memory() -> str:
    """Resident memory now and the process's peak so far (Linux; empty elsewhere): a long compile shows where its
    memory goes, and the line where the peak moves names the step that set it."""
    try:
        status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        now, peak = (int(status[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return ""
    return f" {now:.2f} GiB, peak {peak:.2f}"


class _Progress:
    """One line per step on stderr with elapsed seconds and memory, so long exports and checks show life."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.start = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[kiln {time.perf_counter() - self.start:6.1f}s{_memory()}] {msg}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    from kiln.compiler.options import (
        ACCURACY_LEVELS,
        KERNELS,
        CALIBRATION_METHODS,
        LM_HEADS,
        PRECISIONS,
        PRUNE_LAYERS,
        PRUNE_METHODS,
        QUANT_METHODS,
        TARGETS,
        TASKS,
        CompileOptions,
    )
    from kiln.evaluate.gate import THRESHOLDS
    from kiln.evaluate.options import BenchOptions, ReportOptions
    from kiln.runtimes.sampling import GenerateOptions

    d = CompileOptions()
    g, bo, ro = GenerateOptions(), BenchOptions(), ReportOptions()
    p = argparse.ArgumentParser(prog="kiln", description="Compile Transformers into verified deployment artifacts.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="checkpoint directory -> verified artifact directory")
    c.add_argument("checkpoint", help="Hugging Face checkpoint directory (config.json + weights), or a .gguf file")
    c.add_argument("-o", "--output", required=True, help="artifact directory to create")
    c.add_argument("--task", choices=TASKS, default=d.task, help="override the head implied by config.architectures")
    c.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    c.add_argument("--target", choices=TARGETS, default=d.target,
                   help="cpu: ONNX Runtime graph; tensorrt: standard-op graph TensorRT parses (verified on ONNX Runtime)")
    c.add_argument("--opset", type=int, default=d.opset)
    c.add_argument("--threads", type=int, default=d.threads, help="threads for verification and latency (default: all)")
    c.add_argument("--no-verify", dest="verify", action="store_false", help="skip the parity check (recorded)")
    c.add_argument("--force", action="store_true", help="replace an existing output directory")
    c.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="skip a pass (repeatable)")
    c.add_argument("--require-fusion", action="store_true",
                   help="fail when any attention block runs on the verified fallback instead of a fused kernel")
    c.add_argument("--allow-partial-fusion", action="store_true", help=argparse.SUPPRESS)  # the default since 0.2
    c.add_argument("--verify-max-length", type=int, default=d.verify_max_length,
                   help="longest random sequence in the parity check")
    c.add_argument("--max-drop", default=d.max_drop, metavar="METRIC=VALUE",
                   help="int8/int4 accuracy budget: cosine=0.995 (encoders), ppl=2 (percent), top1=0.98 or kl=0.01 "
                        "(decoders); sensitive weights go up a tier (int4 -> int8 -> fp32) until it holds on "
                        "held-out text")
    c.add_argument("--calibration", default=d.calibration, metavar="FILE",
                   help="texts (one per line, or JSONL with a text field) for int8 calibration and the budget")
    c.add_argument("--static", action="store_true",
                   help="int8 in QDQ form with calibrated activation ranges (always on for --target tensorrt)")
    c.add_argument("--calibration-method", choices=CALIBRATION_METHODS, default=d.calibration_method,
                   help="static int8 activation ranges: minmax, percentile (99.99) or entropy (KL)")
    c.add_argument("--outlier-ratio", type=float, default=d.outlier_ratio, metavar="R",
                   help="calibrated int8: channels above R x the median channel maximum stay FP32 (0: off)")
    c.add_argument("--smoothquant", type=float, default=d.smoothquant, metavar="ALPHA",
                   help="migrate activation outliers into the weights before int8 (alpha in [0, 1], 0.5 typical)")
    c.add_argument("--quant-method", choices=QUANT_METHODS, default=d.quant_method,
                   help=f"int4: {' or '.join(QUANT_METHODS)} (GPTQ layer by layer on --calibration text, "
                        "round-to-nearest, AWQ's activation-aware scales then round-to-nearest, or AWQ then GPTQ)")
    c.add_argument("--group-size", type=int, default=d.group_size, metavar="G",
                   help="int4: inputs per scale, a power of two >= 16 (default 32; 0: one group per row)")
    c.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=d.act_order,
                   help="int4 GPTQ: solve columns by descending activation energy (default on)")
    c.add_argument("--prune", default=d.prune, metavar="heads=R,ffn=R",
                   help="remove fractions of every layer's attention heads and FFN channels before export")
    c.add_argument("--prune-method", choices=PRUNE_METHODS, default=d.prune_method,
                   help="how --prune chooses what to remove (default flap: input fluctuation + bias compensation)")
    c.add_argument("--prune-layers", choices=PRUNE_LAYERS, default=d.prune_layers,
                   help="--prune: the same count from every layer (default), or per-layer counts from one "
                        "across-layer ranking (FLAP's structure search)")
    c.add_argument("--asym", action=argparse.BooleanOptionalAction, default=d.asym,
                   help="int4: asymmetric groups with zero points (cpu target; default on for encoders, off for decoders)")
    c.add_argument("--mixed-bits", action=argparse.BooleanOptionalAction, default=d.mixed_bits,
                   help="int4 gptq / awq+gptq: attention input and FFN down projections of llama.cpp's more-bits "
                        "layers at 8 bits (default on for decoders on the cpu target)")
    c.add_argument("--lm-head", choices=LM_HEADS, default=d.lm_head,
                   help="int4: precision of the lm_head and the embedding table (default int8)")
    c.add_argument("--accuracy-level", type=int, choices=ACCURACY_LEVELS, default=d.accuracy_level,
                   help="MatMulNBits accuracy level: 4 = int8 activations per block, 0 = FP32 activations "
                        "(default 4; int4 encoders 0)")
    c.add_argument("--kernels", choices=KERNELS, default=d.kernels,
                   help="cpu target, int8/int4 decoders and int4 encoders: kiln's own low-bit kernel (kiln), ONNX "
                        "Runtime's MatMulNBits (onnxruntime), or kiln where its library is built here (auto)")
    c.add_argument("--gptq-windows", type=int, default=d.gptq_windows, metavar="N",
                   help="int4 GPTQ: calibration windows of 256 tokens")
    c.add_argument("--max-length", type=int, default=d.max_length,
                   help="decoders: KV-cache capacity, prompt + new tokens (default: the model's maximum)")
    c.add_argument("--stream", action=argparse.BooleanOptionalAction, default=d.stream,
                   help="read the checkpoint one tensor at a time: trace an empty model, stream weights to external "
                        "data, verify against a layer-by-layer reference (default: when the FP32 weights exceed 1 GiB)")
    c.add_argument("--seed", type=int, default=d.seed)
    c.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    ex = sub.add_parser("export-gptq", help="GPTQ on a checkpoint, written as a GPTQ (v1) checkpoint for other tools")
    ex.add_argument("checkpoint", help="Hugging Face checkpoint directory (or .gguf file)")
    ex.add_argument("-o", "--output", required=True, help="checkpoint directory to create")
    ex.add_argument("--calibration", default=d.calibration, metavar="FILE", help="texts to calibrate on")
    ex.add_argument("--group-size", type=int, default=d.group_size, metavar="G")
    ex.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=d.act_order)
    ex.add_argument("--asym", action="store_true")
    ex.add_argument("--gptq-windows", type=int, default=d.gptq_windows, metavar="N")
    ex.add_argument("--threads", type=int, default=d.threads)
    ex.add_argument("--force", action="store_true", help="replace an existing output directory")
    ex.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    gen = sub.add_parser("generate", help="generate text with a causal-lm artifact, streaming to stdout")
    gen.add_argument("artifact")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the artifact's tokenizer)")
    src.add_argument("--ids", help="comma-separated prompt token ids; prints token ids")
    gen.add_argument("--max-new-tokens", type=int, default=g.max_new_tokens)
    gen.add_argument("--do-sample", action="store_true", default=g.do_sample, help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=g.temperature)
    gen.add_argument("--top-k", type=int, default=g.top_k, help="keep the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=g.top_p, help="nucleus sampling mass")
    gen.add_argument("--repetition-penalty", type=float, default=g.repetition_penalty)
    gen.add_argument("--stop-id", type=int, action="append", help="stop token id (repeatable; default: the model's eos)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true",
                     help="--prompt is a user message: rendered through the artifact's chat template")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument("--backend", default="onnxruntime", help="auto | tensorrt | onnxruntime(-cpu) | onnxruntime-cuda | onnxruntime-tensorrt")

    r = sub.add_parser("run", help="run an artifact once on text or token ids")
    r.add_argument("artifact")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", action="append", help="input text (repeat for a batch)")
    src.add_argument("--ids", help="comma-separated token ids")
    r.add_argument("--truncate", action="store_true", help="cut text longer than the model's maximum")
    r.add_argument("--threads", type=int, default=None)
    r.add_argument("--backend", default="onnxruntime", help="auto | tensorrt | onnxruntime(-cpu) | onnxruntime-cuda | onnxruntime-tensorrt")
    r.add_argument("--top", type=int, default=5, help="how many labels or next tokens to show")
    r.add_argument("--json", action="store_true", help="machine-readable output")

    b = sub.add_parser("bench", help="latency and throughput of an artifact, optionally against eager or another artifact")
    b.add_argument("artifact")
    b.add_argument("--eager", metavar="CKPT", help="also time the checkpoint in eager PyTorch (needs the compile extra)")
    b.add_argument("--compare", metavar="ARTIFACT", help="also time another artifact (e.g. another precision)")
    b.add_argument("--batch-size", type=int, nargs="+", default=list(bo.batch_sizes))
    b.add_argument("--seq-len", type=int, nargs="+", default=list(bo.seq_lens))
    b.add_argument("--budget-seconds", type=float, default=bo.budget_s, help="timing budget per system and shape")
    b.add_argument("--rounds", type=int, default=bo.rounds, help="alternating rounds the budget is split into")
    b.add_argument("--threads", type=int, default=bo.threads)
    b.add_argument("--backend", default=bo.backend, help="auto | tensorrt | onnxruntime(-cpu) | onnxruntime-cuda | onnxruntime-tensorrt")
    b.add_argument("--concurrent", type=int, nargs="+", default=list(bo.concurrent), metavar="N",
                   help="decoders: drive N concurrent synthetic requests through continuous batching (for each N; "
                   "prompts of each --seq-len) instead of the batch timings")
    b.add_argument("--new-tokens", type=int, default=bo.new_tokens, help="with --concurrent: tokens per request")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    rep = sub.add_parser("report", help="accuracy and latency of one or more artifacts against their reference "
                                        "checkpoint, with a verdict per artifact")
    rep.add_argument("artifacts", nargs="+", metavar="ARTIFACT", help="artifacts compiled from --reference (the first "
                                                                     "is the speed-up baseline)")
    rep.add_argument("--reference", required=True, help="the checkpoint directory the artifacts were compiled from")
    rep.add_argument("--config", help="TOML with the gate thresholds the verdicts use (default: ./kiln.toml, "
                                      "./pyproject.toml [tool.kiln.gate])")
    rep.add_argument("--data", help="text file (one text per line) or JSONL with a text field, for the drift metrics "
                                    "(default: English sentences of the Python docs)")
    rep.add_argument("--eval", action="append", default=[], metavar="FILE",
                     help="labelled JSONL scored with task metrics, the reference beside each artifact (repeatable): "
                          "text+label (accuracy, macro-F1), tokens+tags (entity F1), prompt+choices+answer "
                          "(multiple-choice accuracy), "
                          "prompt+answer (exact match), source+reference (BLEU, chrF), text (perplexity)")
    rep.add_argument("--eval-task", choices=["classification", "token_classification", "multiple_choice",
                                             "exact_match", "translation", "summarization", "perplexity"],
                     help="the task of the --eval sets where their fields do not say it (summarization: ROUGE)")
    rep.add_argument("--eval-chat", action="store_true",
                     help="decoders: render each --eval prompt through the artifact's chat template (instruct models)")
    rep.add_argument("--eval-examples", type=int, default=ro.eval_examples,
                     help=f"examples used from each --eval set (default {ro.eval_examples})")
    rep.add_argument("--eval-new-tokens", type=int, default=ro.eval_new_tokens,
                     help=f"tokens generated per example for exact match, translation, summaries (default {ro.eval_new_tokens})")
    rep.add_argument("-o", "--output", required=True, help="directory for report.json, report.md, report.html")
    rep.add_argument("--max-texts", type=int, default=ro.max_texts, help=f"texts to use from --data (default {ro.max_texts})")
    rep.add_argument("--max-tokens", type=int, default=ro.max_tokens, help=f"tokens per text (default {ro.max_tokens})")
    rep.add_argument("--latency-seconds", type=float, default=ro.latency_s, help="time spent measuring latency")
    rep.add_argument("--threads", type=int, default=ro.threads)
    rep.add_argument("--backend", default=ro.backend, help="auto | tensorrt | onnxruntime(-cpu) | onnxruntime-cuda | onnxruntime-tensorrt")
    rep.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    exp = sub.add_parser("export", help="an artifact in another serving system's layout")
    fmt = exp.add_subparsers(dest="format", required=True)
    tri = fmt.add_parser("triton", help="a Triton Inference Server model repository (ONNX Runtime backend)")
    tri.add_argument("artifact")
    tri.add_argument("-o", "--output", required=True, help="the model repository directory (created if missing)")
    tri.add_argument("--name", help="the model's name in the repository (default: the artifact directory's)")
    tri.add_argument("--max-batch", type=int, default=None,
                     help="encoders: Triton's max_batch_size (default 32; 0: no batching); decoders: requests decoded "
                     "together by the generation model (default 8)")
    tri.add_argument("--queue", type=int, default=64, help="decoders: requests that may wait for a decode slot")
    tri.add_argument("--graph-only", action="store_true",
                     help="decoders: the bare graph on Triton's ONNX Runtime backend (whole-sequence requests) "
                     "instead of the streaming generation model")
    tri.add_argument("--max-wait-ms", type=float, default=5.0, help="encoders: dynamic batching's queue delay")
    tri.add_argument("--instances", type=int, default=1, help="model instances (instance_group count)")
    tri.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="instance_group kind")
    tri.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads per instance")
    tri.add_argument("--force", action="store_true", help="replace the model if the repository has it")
    be = sub.add_parser("build-engine", help="a TensorRT engine for this GPU (needs TensorRT and an NVIDIA GPU)")
    be.add_argument("artifact")
    be.add_argument("--profile", help="optimization profile, e.g. batch=1:4:8,seq=1:128:512 (default: from the manifest)")
    be.add_argument("--precision", help="the precision recipe recorded with the engine (default: the artifact's)")
    be.add_argument("--workspace-gb", type=float, default=4.0)
    be.add_argument("--force", action="store_true", help="rebuild even if a current engine exists")
    chk = sub.add_parser("check", help="run an artifact's canary on this machine: exit 0 when every entry point "
                                       "computes what it was verified to, 1 when one does not")
    chk.add_argument("artifact")
    chk.add_argument("--threads", type=int, default=None)
    chk.add_argument("--backend", default="onnxruntime", help="auto | tensorrt | onnxruntime(-cpu) | onnxruntime-cuda | onnxruntime-tensorrt")
    chk.add_argument("--json", action="store_true", help="print the result as JSON")
    srv = sub.add_parser("serve", help="serve an artifact over HTTP (OpenAI-compatible; needs kiln[serve])")
    srv.add_argument("artifact")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch", type=int, default=None,
                     help="encoders: texts per dynamic batch (default 32; 1: no batching); decoders: requests decoded "
                     "together, each in its own KV-cache slot (default 8)")
    srv.add_argument("--queue", type=int, default=64,
                     help="decoders: requests that may wait for a slot; past it, 429 with Retry-After")
    srv.add_argument("--decode", default="batched", choices=("batched", "threads"),
                     help="decoders: batched (continuous batching: one decode step for every active request) or "
                     "threads (each request on its own thread at batch 1)")
    srv.add_argument("--min-rows", type=int, default=None,
                     help="decoders, batched: rows every decode step runs (default: 1, or 2 for a quantized artifact "
                     "whose canary did not show here that one row decodes as it does beside others)")
    srv.add_argument("--max-wait-ms", type=float, default=5.0,
                     help="encoders: how long the first request of a batch waits for others")
    srv.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    sec = srv.add_argument_group("security (docs/serving.md#security)")
    sec.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require Authorization: Bearer KEY on every route but /health (repeatable; also KILN_API_KEY)")
    sec.add_argument("--api-key-file", default=None, metavar="FILE", help="API keys, one per line")
    sec.add_argument("--insecure-no-auth", action="store_true",
                     help="allow a non-loopback --host without an API key (behind a proxy that authenticates)")
    sec.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                     help="a Host name requests may use besides the bound address (repeatable; e.g. behind a proxy)")
    sec.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="a web origin allowed to call the API from a browser (repeatable; default: none)")
    sec.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413 before they are read")
    sec.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                     help="seconds a connection has to send its request line and headers")
    sec.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                     help="seconds a request has to send its body (408 past it)")
    sec.add_argument("--max-connections", type=int, default=512,
                     help="open connections and requests at once; past it, 503")
    gate = sub.add_parser("gate", help="check a report against thresholds: exit 0 pass, 1 violated, 2 unusable input")
    gate.add_argument("report", help="report.json written by kiln report")
    gate.add_argument("--artifact", help="gate this artifact of a comparison report (default: every artifact)")
    gate.add_argument("--baseline", help="the last release's report.json, for max_latency_regression_pct")
    gate.add_argument("--config", help="TOML file with a [gate] table (default: ./kiln.toml, ./pyproject.toml)")
    for key in THRESHOLDS:
        gate.add_argument("--" + key.replace("_", "-"), type=float, default=None, dest=key)
    gate.add_argument("--gate-on", choices=["value", "upper"], default=None, dest="gate_on",
                      help="task thresholds read the value (default) or the pessimistic end of its bootstrap interval")
    gate.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


class Terminated(KeyboardInterrupt):
    signum = signal.SIGTERM


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage error
        return int(e.code or 0)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C (staging directories are removed on the way out) instead of dying in place
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return {"compile": cmd_compile, "run": cmd_run, "generate": cmd_generate, "report": cmd_report,
                "gate": cmd_gate, "bench": cmd_bench, "export-gptq": cmd_export_gptq,
                "serve": cmd_serve, "export": cmd_export, "check": cmd_check, "build-engine": cmd_build_engine}[args.command](args)
    except KilnError as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"kiln {args.command}: interrupted ({signal.Signals(signum).name})"
              + ("; nothing written" if args.command in ("compile", "export-gptq", "export", "report") else ""),
              file=sys.stderr)
        return 128 + int(signum)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def cmd_compile(args: argparse.Namespace) -> int:
    from kiln.compiler.build import compile
    from kiln.compiler.options import CompileOptions

    opts = CompileOptions(
        task=args.task, precision=args.precision, target=args.target, opset=args.opset, verify=args.verify, force=args.force,
        threads=args.threads, verify_max_length=args.verify_max_length, seed=args.seed, max_length=args.max_length,
        max_drop=args.max_drop, calibration=args.calibration, static=args.static,
        calibration_method=args.calibration_method, smoothquant=args.smoothquant, outlier_ratio=args.outlier_ratio,
        disabled_passes=tuple(args.disable_pass), require_fusion=args.require_fusion,
        quant_method=args.quant_method, group_size=args.group_size, act_order=args.act_order, asym=args.asym,
        mixed_bits=args.mixed_bits, lm_head=args.lm_head, accuracy_level=args.accuracy_level, kernels=args.kernels, gptq_windows=args.gptq_windows,
        prune=args.prune, prune_method=args.prune_method, prune_layers=args.prune_layers, stream=args.stream,
    )
    out = compile(args.checkpoint, args.output, opts, progress=_Progress(args.quiet or args.json))
    manifest = json.loads((out / "manifest.json").read_text())
    if args.json:
        print(json.dumps({"artifact": str(out), "model": manifest["model"], "verification": manifest["verification"]}, indent=2))
    else:
        print(parity_table(manifest))
    return 0


def cmd_export_gptq(args: argparse.Namespace) -> int:
    from kiln.compiler.options import CompileOptions
    from kiln.compiler.quantize.export import export

    opts = CompileOptions(precision="int4", calibration=args.calibration, group_size=args.group_size,
                          act_order=args.act_order, asym=args.asym, gptq_windows=args.gptq_windows, threads=args.threads,
                          force=args.force)
    out = export(args.checkpoint, args.output, opts, _Progress(args.quiet))
    print(out)
    return 0


def parity_table(manifest: dict[str, Any]) -> str:
    """Human summary of a manifest's verification: worst error per output and latency."""
    m = manifest["model"]
    v = manifest["verification"]
    lines = [f"{m['architecture']} ({m['kind']}, {m['task']}) -> {manifest['precision']}, verification {v['status']}"]
    if v["status"] != "passed":
        return lines[0]
    if v["summary"]:  # an encoder-decoder is verified by its generation alone (the line below)
        lines.append(f"  {'output':<20} {'max abs err':>12} {'max rel err':>12} {'cosine min':>11} {'top-1':>7}")
    for name, s in v["summary"].items():
        def cell(key: str, fmt: str, width: int) -> str:
            return f"{s[key]:>{width}{fmt}}" if s.get(key) is not None else f"{'-':>{width}}"

        lines.append(f"  {name:<20} {cell('max_abs', '.3g', 12)} {cell('max_rel', '.3g', 12)} "
                     f"{cell('cosine_min', '.6f', 11)} {cell('top1_agreement', '.1%', 7)}")
    on = v.get("verified_on")
    if on:
        lines.append(f"  verified on {on['backend']} {on['device']}" + (f" ({on['note']})" if on.get("note") else ""))
    num = v.get("numerics")
    if num:
        lines.append(f"  {manifest['precision']} numerics {num['graph']} on {num['ran_on']}: {num['how']}; latency not "
                     "measured (an emulation's speed is not the engine's: tools/gpu_check.py times engines)")
    gen = v.get("generation")
    if gen:
        against = ("the reference's greedy choices (teacher-forced over the artifact's tokens, reference run layer by "
                   "layer)" if gen.get("reference") else "Hugging Face generate")
        lines.append(f"  generation: {gen['steps']} greedy steps x batch {gen['batch']} through the cache, tokens identical "
                     f"to {against}: {gen['tokens_identical']} (step logits within "
                     f"{gen['max_abs_over_atol']:.3g}x the tolerance)")
    one = v.get("generation_batch_1")
    if one:
        lines.append(f"  batch-1 decode: {one['steps']} greedy steps alone through the cache, tokens identical: "
                     f"{one['tokens_identical']} (step logits within {one['max_abs_over_atol']:.3g}x the tolerance)")
    rows = v.get("rows")
    if rows:
        worst = max(rows["max_abs_over_bound"].values(), default=0.0)
        lines.append(f"  continuous batching: {', '.join(map(str, rows['rows']))} rows of different lengths, each row "
                     f"within {worst:.3g}x its bound of itself alone (tokens identical: {rows['tokens_identical']})")
    if manifest.get("canary"):
        lines.append(f"  canary: {', '.join(e['name'] for e in manifest['canary']['entries'])} recorded "
                     "(`kiln check` runs them on any machine; load runs them by default)")
    if v.get("reference"):
        lines.append(f"  reference: {v['reference']}; latency against eager not measured (no eager model in memory)")
    lat = v.get("latency")
    if lat:
        b, t = lat["shape"]
        lines.append(f"  latency batch {b} seq {t}: eager {lat['eager_ms']:.2f} ms, artifact {lat['artifact_ms']:.2f} ms "
                     f"({lat['speedup']:.2f}x)")
    q = v.get("quantization")
    if q:
        cost = ([f"min cosine {q['cosine_min_vs_eager']:.4f}"] if q["cosine_min_vs_eager"] is not None else []) + ([f"top-1 {q['top1_vs_eager']:.1%}"] if q["top1_vs_eager"] is not None else [])
        if "budget" in q:
            b = q["budget"]
            cost.append(f"held-out {b['metric']} {b['heldout']:.4g} (budget {b['value']})")
        gain = f"{q['speedup_vs_eager']:.2f}x eager" if q.get("speedup_vs_eager") else "not measured"
        if "int4" in q:
            i4 = q["int4"]
            what = (f"int4 ({i4['method']}, group {i4['group_size']}{', act-order' if i4['act_order'] else ''}): "
                    f"{q['quantized']} weights quantized ({i4['from_solver']} with the solver's codes"
                    f"{', %d of them at 8 bits' % i4['more_bits'] if i4.get('more_bits') else ''}"
                    f"{', %.2f bits per weight' % i4['bits_per_weight'] if i4.get('bits_per_weight') else ''}), lm_head "
                    f"{i4['lm_head'] or '-'}, embedding {i4['embedding']}, {i4['promoted_int8']} promoted to INT8, "
                    f"{q['kept_fp32']} kept FP32")
        else:
            what = f"int8 ({q['pass']}): {q['quantized']} weights INT8, {q['kept_fp32']} kept FP32"
        lines.append(f"  {what}; cost vs eager FP32: {', '.join(cost)}; speed: {gain}")
    p = v.get("pruning")
    if p:
        from kiln.compiler.prune import span

        o = p["original"]
        line = (f"  pruned ({p['method']}, {'adaptive' if p.get('adaptive') else 'uniform'}): heads {o['heads']} -> "
                f"{span(p['heads_per_layer'])}, FFN {o['ffn']} -> {span(p['ffn_per_layer'])} per layer")
        if p.get("cost"):
            line += f"; cost vs the original on {p['cost']['texts']} held-out texts: " + ", ".join(
                f"{k} {val:.4g}" for k, val in p["cost"].items() if k != "texts")
        if p.get("speedup_vs_original_eager"):
            line += (f"; speed: pruned eager {p['eager_speedup']:.2f}x the original eager "
                     f"({p['original_eager_ms']:.2f} ms), artifact {p['speedup_vs_original_eager']:.2f}x")
        lines.append(line)
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from kiln.evaluate.bench import bench, table
    from kiln.evaluate.options import BenchOptions

    opts = BenchOptions(tuple(args.batch_size), tuple(args.seq_len), args.budget_seconds, args.rounds, args.threads,
                        args.backend, tuple(args.concurrent), args.new_tokens)
    result = bench(args.artifact, args.eager, args.compare, opts, progress=_Progress(args.quiet))
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kiln.evaluate.options import ReportOptions
    from kiln.evaluate.render import verdict_text
    from kiln.evaluate.report import report

    if args.eval_examples < 1 or args.eval_new_tokens < 1:
        raise UsageError("--eval-examples and --eval-new-tokens must be at least 1")
    opts = ReportOptions(args.max_texts, args.max_tokens, args.latency_seconds, args.threads, args.backend,
                         tuple(args.eval), args.eval_task, args.eval_examples, args.eval_new_tokens, args.eval_chat)
    result = report(args.artifacts, args.reference, args.data, args.output, opts, progress=_Progress(args.quiet),
                    config=args.config)
    print(verdict_text(result))
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from kiln.evaluate import gate

    current = gate.load_report(args.report)
    chosen = gate.pick(current, args.artifact)
    baseline = gate.load_report(args.baseline, "baseline") if args.baseline else None
    thresholds = gate.load_thresholds(args.config, {k: getattr(args, k) for k in (*gate.THRESHOLDS, "gate_on")})
    results = [(e, gate.evaluate(e, thresholds, gate.baseline_for(e, baseline) if baseline else None, args.report))
               for e in chosen]
    if args.json:
        print(json.dumps([{"artifact": e.get("artifact"), "checks": [{"threshold": c.name, "limit": c.threshold,
                                                                       "value": c.value, "passed": c.passed} for c in checks]}
                          for e, checks in results] if len(results) > 1 else
                         [{"threshold": c.name, "limit": c.threshold, "value": c.value, "passed": c.passed}
                          for c in results[0][1]], indent=2))
    else:
        for e, checks in results:
            if len(results) > 1:
                print(f"\n{e.get('artifact')}")
            print(gate.table(checks))
    failed = [(e, [c for c in checks if not c.passed]) for e, checks in results]
    failed = [(e, bad) for e, bad in failed if bad]
    for e, bad in failed:
        where = f"{e.get('artifact')}: " if len(results) > 1 or args.artifact else ""
        print(f"kiln gate: FAILED: {where}{', '.join(f'{c.name} ({c.value:.6g} vs {c.threshold:.6g})' for c in bad)}",
              file=sys.stderr)
    if failed and len(results) > 1:
        print(f"kiln gate: {len(failed)} of {len(results)} artifacts failed", file=sys.stderr)
    return 1 if failed else 0


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UsageError(f"{flag} {text!r} is not a comma-separated list of integers") from e
    if not ids:
        raise UsageError(f"{flag} is empty; give at least one token id")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    model = _load(args)
    sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                    stop_token_ids=args.stop_id, seed=args.seed)
    if args.ids:
        if args.chat:
            raise UsageError("--chat renders a --prompt text through the chat template; drop --ids or --chat")
        ids = _parse_ids(args.ids, "--ids")
        out = model.generate([ids], **sampling)
        print(",".join(str(int(t)) for t in out[0, len(ids):]))
        return 0
    if args.chat:
        prompt = model.chat_prompt([{"role": "user", "content": args.prompt}])
        chunks = model.stream(prompt, chat=True, **sampling)
    else:
        chunks = model.stream(args.prompt, **sampling)
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_build_engine(args: argparse.Namespace) -> int:
    from kiln.runtimes.tensorrt import build

    print(build(args.artifact, precision=args.precision, profile=args.profile, force=args.force,
                workspace_gb=args.workspace_gb, say=lambda m: print(m, file=sys.stderr)))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """The canary on this machine and backend: the machine line, then one line per entry point."""
    import kiln.runtimes as kr

    with _load(args, check=False) as model:
        result = kr.canary.check(model, args.threads)
        if result is None:
            raise ArtifactError(f"artifact {args.artifact} carries no canary (compiled by an older kiln, or an "
                                "encoder compiled streamed); recompile it with this kiln to check it on this machine")
        if args.json:
            print(json.dumps(result.to_json(), indent=2))
        else:
            print(f"machine: {result.machine}")
            for e in result.entries:
                err = "-" if e["error"] is None else f"{e['error']:.3g}"
                compiled = "" if e.get("compiled") is None else f" (compiled: {e['compiled']:.3g})"
                if e.get("min_cosine") is not None:
                    compiled += f", row cosine {e['cosine']:.4f} >= {e['min_cosine']:.4f}"
                print(f"  {e['name']:<12} error {err:>9} bound {e['bound']:.3g}{compiled}  "
                      f"{'ok' if e['passed'] else 'differs' if e['name'] == 'rows' else 'FAILED ' + e.get('failed', '')}")
        if result.refused:
            print(f"kiln check: error: {kr.canary.refusal(model, result)}", file=sys.stderr)
            return 1
        if result.rows_agree is False:
            print("note: one row decodes differently alone than beside others here: generate and continuous batching "
                  "keep at least two rows per step on this machine (min_rows=2); every entry point is correct",
                  file=sys.stderr)
    return 0


def _load(args: argparse.Namespace, check: bool = True) -> Any:
    """An artifact for run/generate/check on --backend; ``auto`` says on stderr what it chose and why."""
    import kiln.runtimes as kr

    if args.backend not in kr.BACKENDS:
        raise UsageError(f"--backend {args.backend!r}; choose one of {', '.join(kr.BACKENDS)}")
    model = kr.load(args.artifact, backend=args.backend, threads=args.threads, check=check)
    if args.backend == "auto":
        b = model.backend
        print(f"kiln {args.command}: backend {b['name']} ("
              + "; ".join(f"{k} skipped: {v}" for k, v in b["skipped"].items()) + ")", file=sys.stderr)
    return model


def cmd_export(args: argparse.Namespace) -> int:
    from kiln.runtimes.artifact import read_manifest
    from kiln.serve.triton import export, generates

    manifest = read_manifest(args.artifact)
    decoder = manifest.kind == "decoder"
    max_batch = args.max_batch if args.max_batch is not None else 8 if decoder else 32
    out = export(args.artifact, args.output, name=args.name, max_batch=max_batch, max_wait_ms=args.max_wait_ms,
                 instances=args.instances, device=args.device, threads=args.threads, force=args.force,
                 graph_only=args.graph_only, queue=args.queue)
    if decoder and not args.graph_only:
        why = generates(manifest)
        print(f"kiln export triton: the bare graph, not the generation model: {why}" if why else
              f"kiln export triton: a streaming generation model (Python backend, decoupled, {max_batch} slots)",
              file=sys.stderr)
    print(out)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise UsageError("kiln serve needs its extra: pip install 'kiln[serve]' (starlette, uvicorn, jinja2)") from e
    from kiln.serve import create_app
    from kiln.serve.guard import Policy, check_bind, http_protocol, read_keys

    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a TCP port; give 1-65535")
    if args.max_connections < 1:
        raise UsageError(f"--max-connections {args.max_connections}: give at least 1")
    policy = Policy(bind=args.host, keys=read_keys(args.api_key, args.api_key_file),
                    allowed_hosts=tuple(args.allowed_host), cors_origins=tuple(args.cors_origin),
                    max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                    header_timeout_s=args.header_timeout)
    check_bind(policy, args.insecure_no_auth)  # before the artifact loads: a refused start is quick
    app = create_app(args.artifact, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, threads=args.threads,
                     queue=args.queue, decode=args.decode, min_rows=args.min_rows, policy=policy)
    auth = f"{len(policy.keys)} API key(s)" if policy.keys else "no API key"
    print(f"kiln serve: {args.artifact} on http://{args.host}:{args.port} (max batch {args.max_batch or 'default'}, "
          f"max wait {args.max_wait_ms:g} ms, queue {args.queue}, {auth}; {canary_line(app)})", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                http=http_protocol(policy.header_timeout_s), limit_concurrency=args.max_connections)
    return 0


def canary_line(app: Any) -> str:
    """What the start-up canary found, for the server's first line."""
    server = app.state.server
    result = server.model.canary
    if result is None:
        return "no canary: the artifact was not checked on this machine"
    rows = f", min rows {server.scheduler.min_rows}" if server.scheduler is not None else ""
    return f"canary passed on {result.machine}{rows}"


def cmd_run(args: argparse.Namespace) -> int:
    model = _load(args)
    if model.manifest.kind == "seq2seq":
        raise UsageError(f"{args.artifact} is an encoder-decoder artifact: kiln run shows one forward pass of a "
                         "single-graph model; use kiln generate --prompt TEXT")
    if args.text:
        feeds = model.encode(args.text, truncate=args.truncate)
    else:
        feeds = {"input_ids": np.asarray([_parse_ids(args.ids, "--ids")], dtype=np.int64)}
    outputs = model.run(feeds)
    summary = summarize(model, feeds, outputs, args.top)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def summarize(model: Any, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray], top: int) -> dict[str, Any]:
    m = model.manifest.data["model"]
    out: dict[str, Any] = {"task": m["task"], "shapes": {k: list(v.shape) for k, v in outputs.items()
                                                          if not k.startswith("present.")}}
    lengths = feeds.get("attention_mask", np.ones_like(feeds["input_ids"])).sum(1)
    if "sentence_embedding" in outputs:
        emb = outputs["sentence_embedding"]
        out["embedding"] = emb.tolist()
        out["norm"] = np.linalg.norm(emb, axis=1).tolist()
    elif m["task"] == "causal-lm":
        rows = []
        for b, n in enumerate(lengths):
            pos = -1 if model.manifest.tokenizer and model.manifest.tokenizer.get("padding_side") == "left" else int(n) - 1
            rows.append(_top(outputs["logits"][b, pos], top, model))
        out["next_token"] = rows
    elif m["task"] == "sequence-classification":
        out["labels"] = [_top(row, top, model, labels=m["labels"]) for row in outputs["logits"]]
    else:
        name = "last_hidden_state" if "last_hidden_state" in outputs else "logits"
        h = outputs[name]
        mask = feeds.get("attention_mask", np.ones(h.shape[:2], dtype=np.int64))[..., None]
        out["mean_pooled"] = ((h * mask).sum(1) / mask.sum(1)).tolist()
    return out


def _top(logits: np.ndarray, k: int, model: Any, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    z = logits.astype(np.float64) - logits.max()
    p = np.exp(z) / np.exp(z).sum()
    best = np.argsort(-p)[:k]
    rows = []
    for i in best:
        if labels is not None:
            name = labels.get(str(int(i)), str(int(i)))
        elif model.manifest.tokenizer:
            name = model.text_encoder.decode([int(i)], skip_special_tokens=False)
        else:
            name = str(int(i))
        rows.append({"id": int(i), "token": name, "p": float(p[i])})
    return rows


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"task {s['task']}; outputs " + ", ".join(f"{k} {v}" for k, v in s["shapes"].items())]
    if "embedding" in s:
        for i, (e, n) in enumerate(zip(s["embedding"], s["norm"])):
            head = ", ".join(f"{x:+.4f}" for x in e[:6])
            lines.append(f"[{i}] sentence_embedding dim {len(e)} norm {n:.4f}: [{head}, ...]")
    for key in ("next_token", "labels"):
        for i, row in enumerate(s.get(key, [])):
            lines.append(f"[{i}] {key}: " + ", ".join(f"{r['token']!r} {r['p']:.3f}" for r in row))
    for i, e in enumerate(s.get("mean_pooled", [])):
        head = ", ".join(f"{x:+.4f}" for x in e[:6])
        lines.append(f"[{i}] mean-pooled dim {len(e)}: [{head}, ...]")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
