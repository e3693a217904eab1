"""``compile``: the flow from checkpoint to artifact, each step in its own module:
load (``load``) -> prune (``prune_driver``) -> trace (``trace``, ``trace_stream``, ``trace_seq2seq``) -> recipe of
passes and quantization (``optimise``, ``quantize.driver``) -> verify the staged artifact (``verify.staged``) ->
write the manifest (``manifest``) and rename the staged directory into place (``staging``).

Decoders and encoders trace to one graph (``model.onnx``); encoder-decoders to ``encoder.onnx`` and
``decoder.onnx``, each run through the same recipe. Verification opens the staged artifact through
``kiln.runtimes`` (as an app would) from the manifest in memory; the manifest is written once, last.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from kiln.compiler import manifest as manifest_lib
from kiln.compiler import options as options_lib
from kiln.compiler import stream as stream_lib
from kiln.compiler import trace, trace_seq2seq, trace_stream
from kiln.compiler.facts import experts_layers, from_graph, model_facts
from kiln.compiler.load import Checkpoint, load_checkpoint
from kiln.compiler.optimise import optimise
from kiln.compiler.options import AWQ_METHODS, CompileOptions, int4_defaults
from kiln.compiler.pipeline import ModelFacts, recipe
from kiln.compiler.prune_driver import prune_checkpoint
from kiln.compiler.quantize import driver as driver_lib
from kiln.compiler.quantize import gptq
from kiln.compiler.scoped import torch_threads
from kiln.compiler.staging import GRAPH, check_output, copy_tokenizer, staging
from kiln.compiler.verify.staged import verify_artifact
from kiln.errors import OutputError, UnsupportedModelError, UsageError
from kiln.runtimes.artifact import REPORT

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


def compile(checkpoint: str | Path, output: str | Path, options: CompileOptions | None = None,
            progress: Progress | None = None) -> Path:
    """Compile a Hugging Face checkpoint directory into a verified artifact at ``output``."""
    options = options or CompileOptions()
    say = progress or (lambda msg: log.info(msg))
    options_lib.check(options)
    output = Path(output).absolute()
    check_output(output, options.force)
    stream = stream_lib.streams(Path(checkpoint), options, say)
    say(f"load {checkpoint}" + (" (streamed: the weights stay on disk, read one tensor at a time)" if stream else ""))
    ckpt = load_checkpoint(checkpoint, options.task, stream=stream)
    if ckpt.codebook is not None:
        options = options_lib.for_imported(options, ckpt.source["path"], ckpt.imported or {})
        say(f"{ckpt.path.name}: {ckpt.imported['format']} {ckpt.imported['bits']}-bit, group "
            f"{ckpt.imported['group_size']}: compiled with its own codes (no requantization)")
    options = int4_defaults(ckpt.kind, options)
    if options.prune:
        with torch_threads(options.threads):
            ckpt = prune_checkpoint(ckpt, options, say)
    if options.precision == "int4":
        gptq.check_group_size(ckpt.model, options.group_size, ckpt.path)
        if options.quant_method in AWQ_METHODS and ckpt.kind == "seq2seq":
            raise UsageError(f"--quant-method {options.quant_method}: {ckpt.path} is an encoder-decoder; kiln's AWQ "
                             "scales encoder-only and decoder-only models (use gptq or rtn)")
    if ckpt.tokenizer_problem:
        say(f"warning: {ckpt.path}: {ckpt.tokenizer_problem}; the artifact ships no tokenizer and is verified on "
            "random token ids only")
    try:
        with staging(output, options.force) as root, torch_threads(options.threads):
            build(ckpt, root, options, say)
    except OSError as e:  # the staging directory is gone again: nothing half-written stays
        where = e.filename or output.parent
        raise OutputError(f"writing the artifact failed: {e.strerror or e} ({where}); free space on that filesystem "
                          f"or choose another -o; nothing was written to {output}") from e
    say(f"wrote {output}")
    return output


def build(ckpt: Checkpoint, root: Path, options: CompileOptions, say: Progress) -> None:
    drivers: list[driver_lib.QuantDriver] = []
    try:
        _build(ckpt, root, options, say, drivers)
    finally:
        for driver in drivers:  # a streamed GPTQ's codebook directory goes with the compile, whatever happened
            driver.close()


def _build(ckpt: Checkpoint, root: Path, options: CompileOptions, say: Progress, drivers: list[driver_lib.QuantDriver]) -> None:
    facts = model_facts(ckpt)
    names = recipe(ckpt.kind, options)
    if ckpt.kind == "seq2seq":
        data = _build_seq2seq(ckpt, facts, names, root, options, say)
    else:
        if options.precision == "int4" and options.quant_method in AWQ_METHODS and ckpt.codebook is None:
            driver = driver_lib.QuantDriver(ckpt, facts, options, say)  # scales the eager model before it is traced
            drivers.append(driver)
            driver.awq()
        say(f"export {ckpt.architecture} ({ckpt.task}) to ONNX opset {options.opset}")
        if ckpt.streamed:
            log = trace_stream.export(ckpt, root / GRAPH, options.opset, say)
        else:
            log = trace.export(ckpt, root / GRAPH, options.opset, options.external_data_threshold)
        traced_fixes(ckpt, log, ckpt.kind == "decoder", say, "sequence")
        facts = from_graph(facts, root / GRAPH)
        record, summary, problems = optimise(root / GRAPH, names, facts, options, ckpt, say, drivers=drivers,
                                             delegated=log.delegated)
        for problem in problems:
            say(f"note: {problem}; verified on the fallback (--require-fusion refuses it)")
        data = manifest_lib.base(ckpt, facts, options, record, *trace.io_specs(ckpt), {"model": GRAPH})
        manifest_lib.add_traced(data, "model", log, ckpt, "sequence")
        data["attention"] = summary
        if ckpt.pruning is not None:
            data["pruning"] = ckpt.pruning
        cache = next((p["name"] for p in record if p["name"] in ("kv-cache", "kv-cache-concat")
                      and p["stats"].get("layers")), None)
        if cache:
            stats = next(p["stats"] for p in record if p["name"] == cache)
            rows = ("a Concat cache (the TensorRT graph's, or the unfused attention's) has one length for every row" if cache != "kv-cache" else
                    "learned position embeddings read each position from the mask" if stats.get("sliced_positions")
                    else None)
            manifest_lib.add_kv_cache(data, ckpt, facts, options, shared_buffer=cache == "kv-cache",
                                      dtype=manifest_lib.cache_dtype(root / GRAPH), row_lengths_refused=rows,
                                      dims=manifest_lib.cache_dims(root / GRAPH))
        elif ckpt.task == "causal-lm":  # no cache: generation recomputes the sequence every step (summary says why)
            data["generation"] = dict(manifest_lib.generation_defaults(ckpt), recompute=True)
        if any(p["name"] == "logits-to-keep" and p["stats"].get("sliced") for p in record):
            from kiln.passes.logits_to_keep import INPUT

            manifest_lib.add_logits_to_keep(data, INPUT)
        if options.target == "tensorrt":
            from kiln.passes.check_tensorrt import min_tensorrt

            data["target_info"] = {"min_tensorrt": min_tensorrt(onnx.load(str(root / GRAPH), load_external_data=False))}
    copy_tokenizer(ckpt, root)
    if options.verify:
        codes = None
        if options.precision == "int4" and drivers:
            codes = drivers[0].codes_transform() if ckpt.streamed else drivers[0].fake_quantized()
        report = verify_artifact(ckpt, root, data, options, say, codes)
        (root / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        data["verification"] = manifest_lib.verification(report, options)
    else:
        say("verification skipped (--no-verify)")
    manifest_lib.write(root, data)


def traced_fixes(ckpt: Checkpoint, log: Any, steps: bool, say: Progress, axis: str) -> None:
    """Says what the trace fixed (``kiln.compiler.decided``), and refuses what a graph run step by step (``steps``:
    a decoder, or an encoder-decoder's decoder) cannot keep: decisions on tensor data (the cached step sees only
    the new tokens, and its runners do not check them) and lengths in blocks (a step is one token)."""
    if steps and log.assumptions:
        raise UnsupportedModelError(f"{ckpt.path} ({ckpt.architecture}): the decoder decides on tensor data at "
                                    f"{log.assumptions[0]['where']}; kiln compiles such decisions only in graphs run "
                                    "whole (encoders), where the runtime checks them on every run")
    if steps and log.blocks:
        raise UnsupportedModelError(f"{ckpt.path} ({ckpt.architecture}): the decoder takes lengths only in blocks of "
                                    f"{next(iter(log.blocks.values()))} tokens; kiln steps a decoder token by token")
    for a in log.assumptions:
        say(f"note: traced for the branch the model takes at {a['where']} ({a['value']} on tensor data); the runtime "
            "checks it on every run and refuses an input that would take the other branch")
    for size in log.blocks.values():
        say(f"note: the graph takes {axis} lengths in blocks of {size} (the model pads to them itself); the runtime "
            "pads each request to whole blocks, masked, and cuts the outputs back")


def _build_seq2seq(ckpt: Checkpoint, facts: ModelFacts, names: list[str], root: Path, options: CompileOptions,
                   say: Progress) -> dict[str, Any]:
    say(f"export {ckpt.architecture} ({ckpt.task}) to an encoder and a decoder graph, ONNX opset {options.opset}")
    logs, width = trace_seq2seq.export(ckpt, root, options.opset)
    traced_fixes(ckpt, logs[trace_seq2seq.DECODER], True, say, "sequence")
    traced_fixes(ckpt, logs[trace_seq2seq.ENCODER], False, say, "source")
    s = trace_seq2seq.shapes(ckpt)
    # one MultiHeadAttention per encoder layer; self + cross per decoder layer
    encoder, decoder = ckpt.model.get_encoder(), ckpt.model.get_decoder()
    graphs = {trace_seq2seq.ENCODER: ModelFacts("seq2seq", s["encoder_layers"], s["heads"], s["heads"], s["head_size"],
                                                ckpt.max_length, experts_layers=experts_layers(encoder)),
              trace_seq2seq.DECODER: ModelFacts("seq2seq", s["layers"], s["heads"], s["heads"], s["head_size"],
                                                ckpt.max_length, attentions_per_layer=2,
                                                experts_layers=experts_layers(decoder))}
    record: list[dict[str, Any]] = []
    problems: list[str] = []
    summaries: dict[str, Any] = {}
    for graph, graph_facts in graphs.items():
        rec, summary, short = optimise(root / graph, names, graph_facts, options, ckpt, say, graph.split(".")[0],
                                       delegated=logs[graph].delegated)
        record += rec
        problems += short
        summaries[graph.split(".")[0]] = summary
    for problem in problems:
        say(f"note: {problem}; verified on the fallback (--require-fusion refuses it)")
    if width:
        say(f"note: the decoder's cache takes {width} new token per step (the model refuses more), so the decoder "
            "graph is traced at that width; generation feeds one token per step")
    spec = trace_seq2seq.io(ckpt, width)
    data = manifest_lib.base(ckpt, facts, options, record, spec["encoder"]["inputs"], spec["encoder"]["outputs"],
                             {"encoder": trace_seq2seq.ENCODER, "decoder": trace_seq2seq.DECODER})
    manifest_lib.add_seq2seq(data, ckpt, facts, options, (spec["decoder"]["inputs"], spec["decoder"]["outputs"]))
    manifest_lib.add_traced(data, "encoder", logs[trace_seq2seq.ENCODER], ckpt, "source")
    data["attention"] = summaries
    return data



