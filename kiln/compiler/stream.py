"""When a compile streams its checkpoint (``--stream``), and how a streamed artifact is verified.

Streaming (see docs/streaming.md) keeps the weights on disk from the checkpoint to the artifact: the
loader builds an empty shell (``lazy``), the trace writes external data (``trace_stream``), passes read and spill
through ``kiln.passes.weights``, and verification here runs the layer-by-layer reference
(``verify.streamed``), twice for INT4 (FP32 floor, then the codes through an FP32-activation copy of the graph).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

import kiln.runtimes as kr
from kiln.compiler import gguf, lazy, trace
from kiln.compiler.experts import config_experts
from kiln.compiler.load import Checkpoint, check_weights, model_kind, read_config
from kiln.compiler.options import AWQ_METHODS, STREAM_ABOVE, CompileOptions
from kiln.compiler.quantize import gptq_format
from kiln.compiler.staging import GRAPH
from kiln.compiler.verify import canary
from kiln.compiler.verify import cases as case_lib
from kiln.compiler.verify.generation import GENERATION_STEPS, ROW_COUNTS, verify_rows
from kiln.compiler.verify.parity import EXACT_SESSION, fp32_activations
from kiln.compiler.verify.streamed import verify_streamed
from kiln.errors import UsageError
from kiln.runtimes.artifact import Manifest

Progress = Callable[[str], None]

STREAMED_PRECISIONS = ("fp32", "int8", "int4")


def streams(path: Path, options: CompileOptions, say: Progress) -> bool:
    """Whether this compile streams the checkpoint (``CompileOptions.stream``; auto: FP32 weights over
    ``STREAM_ABOVE``). Streaming takes decoders and encoders from safetensors on the CPU target at FP32, dynamic
    INT8 or INT4 (GPTQ or round-to-nearest), and already-quantized checkpoints; asking for it elsewhere is a usage
    error naming what is missing, and a large checkpoint that auto cannot stream is said so before the whole model
    is loaded."""
    if options.stream is False or gguf.is_gguf(path) or not path.is_dir():
        return False
    raw = read_config(path)
    qcfg = gptq_format.quantization_config(path, raw)
    archs = raw.get("architectures") or [""]
    kind = model_kind(path, raw, archs[0])
    size = None
    if kind != "seq2seq":
        check_weights(path)  # headers and shards checked before any header is trusted
        size = lazy.fp32_weight_bytes(path)
        if qcfg is not None and size is not None:  # what its Linears dequantize to
            size = gptq_format.DequantizedWeights(path, gptq_format.Layout(path, qcfg)).fp32_bytes()
    experts = config_experts(raw)
    why = ("encoder-decoders are not streamed yet" if kind == "seq2seq" else
           f"its {experts} routed experts are not streamed yet" if experts else
           "its weights are not safetensors" if size is None else
           f"--precision {options.precision} with these settings is not streamed yet (fp32, dynamic int8 and int4 "
           "are)"
           if options.precision not in STREAMED_PRECISIONS or options.static or options.smoothquant is not None else
           "--prune needs the whole model in memory" if options.prune else
           f"--quant-method {options.quant_method} scales the whole model in memory"
           if options.precision == "int4" and options.quant_method in AWQ_METHODS else
           "--max-drop searches with the whole model in memory" if options.max_drop else
           "--target tensorrt is not streamed yet" if options.target != "cpu" else None)
    if options.stream is None:
        large = size is not None and size > STREAM_ABOVE
        if large and why is not None:
            say(f"warning: {path} has {size / 2**30:.1f} GiB of FP32 weights but is not streamed ({why}): the whole "
                "model is loaded, and the compile needs several times that in memory")
        return large and why is None
    if why is not None:
        raise UsageError(f"--stream: {path} cannot be streamed ({why}); compile it without --stream")
    return True


def verify(ckpt: Checkpoint, root: Path, staged: Manifest, data: dict[str, Any], options: CompileOptions,
           say: Progress, codes: Any = None) -> dict[str, Any]:
    """A streamed checkpoint: the reference runs layer by layer from the checkpoint (no eager model to time).
    INT4 (``codes``: a per-tensor transform to the dequantized codes): against FP32 with INT4's floor, then the
    FP32-activation graph against the codes with the tight bound, the generation check through the codes."""
    inputs = [s.name for s in trace.io_specs(ckpt)[0]]
    cases = case_lib.text_cases(ckpt, inputs) + case_lib.random_cases(ckpt, inputs, options.verify_max_length,
                                                                      options.seed)
    prompts = case_lib.generation_prompts(ckpt, options.seed) if "kv_cache" in data and ckpt.task == "causal-lm" else None
    pad = data.get("generation", {}).get("pad_token_id", ckpt.pad_token_id)
    batch = canary.batch_feeds(ckpt, inputs, options.seed)  # a graph run whole: the canary's one batch
    report = verify_streamed(ckpt, lambda: kr.open_manifest(staged, threads=options.threads), cases,
                             None if codes is not None else prompts, GENERATION_STEPS, options.precision, pad, say,
                             canary_inputs=None if codes is not None else canary.decode_inputs,
                             canary_batch=None if codes is not None or prompts else batch)
    entries = report.pop("canary_entries")
    if codes is not None:
        exact_dir = exact_link(root)
        try:
            say("verify the codes: the graph with FP32 activations (accuracy_level 0) vs the reference on the "
                "dequantized codes, layer by layer")
            exact = verify_streamed(ckpt, lambda: kr.open_manifest(Manifest(exact_dir, data), threads=options.threads,
                                                                   session_config=EXACT_SESSION),
                                    cases, prompts, GENERATION_STEPS, "int4-codes", pad, say, transform=codes,
                                    canary_inputs=canary.decode_inputs, canary_batch=None if prompts else batch)
        finally:
            shutil.rmtree(exact_dir, ignore_errors=True)
        entries = exact.pop("canary_entries")
        report["codes"] = {k: exact[k] for k in ("tolerance", "summary", "cases", "passed")}
        report["passed"] = report["passed"] and exact["passed"]
        for key in ("generation", "generation_1"):
            if key in exact:
                report[key] = exact[key]
                report["passed"] = report["passed"] and exact[key]["passed"]
    if report["passed"]:  # the shipped graph: continuous batching's rows, then the canary's bounds
        with kr.open_manifest(staged, threads=options.threads) as artifact:
            if prompts:
                say(f"verify continuous batching: {', '.join(map(str, ROW_COUNTS))} rows of different lengths, "
                    "each against itself alone")
                rows = verify_rows(artifact, prompts, options.precision)
                if rows is not None:
                    report["rows"], report["passed"] = rows, rows["passed"]
            if report["passed"] and entries:
                say("record the canary: the artifact's own acceptance test, run wherever it is loaded")
                kinds = {name: "batch" if name == "batch" else "decode" for name in entries}
                data["canary"] = canary.finish(entries, kinds, artifact, root, options.precision, codes is not None)
    say("latency against eager skipped: a streamed checkpoint has no eager model in memory to time")
    return report


def exact_link(root: Path) -> Path:
    """``exact_copy`` without copying the weights: the graph rewritten (accuracy_level 0) in a scratch directory
    beside the staging one, its data file and the rest hard-linked (same filesystem, no bytes duplicated)."""
    out = Path(tempfile.mkdtemp(prefix=".kiln-codes-", dir=root.parent))
    for f in root.iterdir():
        if f.is_file() and f.name != GRAPH:
            os.link(f, out / f.name)
    onnx.save_model(fp32_activations(onnx.load(str(root / GRAPH), load_external_data=False)), str(out / GRAPH))
    return out


