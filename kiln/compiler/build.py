"""``compile``: checkpoint -> traced graph(s) -> recipe of passes -> verified artifact directory.

Decoders and encoders trace to one graph (``model.onnx``); encoder-decoders to ``encoder.onnx`` and
``decoder.onnx``, each run through the same recipe. Verification opens the staged artifact through
``kiln.runtimes`` (as an app would) from the manifest in memory; the manifest is written once, last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

import kiln.runtimes as kr
from kiln.compiler import manifest as manifest_lib
from kiln.compiler import options as options_lib
from kiln.compiler import stream as stream_lib
from kiln.compiler import trace, trace_seq2seq, trace_stream
from kiln.compiler.artifact import check_output, staging
from kiln.compiler.experts import routed_experts
from kiln.compiler.load import Checkpoint, load_checkpoint
from kiln.compiler.options import AWQ_METHODS, REDUCED_FLOAT, CompileOptions, int4_defaults
from kiln.compiler.pipeline import STAGES, ModelFacts, build_pass, check_coverage, recipe
from kiln.compiler.quantize import driver as driver_lib
from kiln.compiler.quantize import gptq
from kiln.compiler.scoped import torch_threads
from kiln.compiler.verify import cases as case_lib
from kiln.compiler.verify.generation import GENERATION_STEPS, verify_generation, verify_seq2seq
from kiln.compiler.verify.parity import EXACT_SESSION, failures, fp32_activations, latency, median_latency_ms, verify
from kiln.errors import OutputError, ParityError, UnsupportedModelError, UsageError
from kiln.passes import run_passes
from kiln.passes.weights import WeightStore, compact
from kiln.runtimes.artifact import REPORT, SCHEMA_VERSION, Manifest

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
GRAPH = "model.onnx"


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


def prune_checkpoint(ckpt: Checkpoint, options: CompileOptions, say: Progress) -> Checkpoint:
    """``--prune``: the eager model loses heads and FFN channels chosen on calibration text (the artifact is then
    verified against the pruned model); the cost against the original is measured on held-out text."""
    import copy
    from dataclasses import replace

    from kiln.compiler import corpus
    from kiln.compiler import prune as prune_lib

    spec = options_lib.parse_prune(options.prune, options.prune_method, options.prune_layers)
    if ckpt.kind == "seq2seq" or ckpt.codebook is not None:
        raise UsageError(f"--prune: {ckpt.path} is {'an encoder-decoder' if ckpt.kind == 'seq2seq' else 'already quantized'}"
                         "; kiln prunes encoder-only and decoder-only FP32 checkpoints")
    facts = model_facts(ckpt)
    cal, held = corpus.split(corpus.read_texts(options.calibration))
    feeds = prune_lib.torch_feeds(ckpt, cal[:64]) if ckpt.tokenizer is not None and spec.method != "magnitude" else []
    if spec.method != "magnitude" and not feeds:
        raise UsageError(f"--prune-method {spec.method} reads calibration text through the tokenizer; {ckpt.path} "
                         "has none (use --prune-method magnitude)")
    original = copy.deepcopy(ckpt.model) if ckpt.tokenizer is not None else None  # the cost needs text
    auto = None
    if spec.auto:
        if original is None:
            raise UsageError(f"--prune auto measures --max-drop on text through the tokenizer; {ckpt.path} has none")
        from kiln.compiler.quantize.budget import parse_budget

        budget = parse_budget(options.max_drop, ckpt.kind)
        spec, auto = auto_ratio(original, facts, spec, budget, prune_lib.torch_feeds(ckpt, cal[:64]), feeds, say)
    record = prune_lib.prune(ckpt.model, facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_size, spec,
                             feeds, say, kv_cache=facts.kind == "decoder")
    if original is not None:
        record["cost"] = prune_lib.cost(original, ckpt.model, prune_lib.torch_feeds(ckpt, held[:64]), ckpt.kind)
        say(f"prune cost on {record['cost']['texts']} held-out texts vs the original: "
            + ", ".join(f"{k} {v:.4g}" for k, v in record["cost"].items() if k != "texts"))
    if auto is not None:
        from kiln.compiler.quantize.budget import AccuracyBudgetError

        auto["heldout"] = record["cost"][prune_lib.COST_KEYS[budget.metric]]
        record["auto"] = auto
        if not budget.holds(auto["heldout"]):
            raise AccuracyBudgetError(
                f"--prune auto --max-drop {options.max_drop}: heads {auto['heads']:.3g} / FFN {auto['ffn']:.3g} met it on calibration "
                f"({auto['calibration']:.5g}) but not on held-out text ({auto['heldout']:.5g}); loosen the budget")
    if original is not None:  # the speed side of the cost: the original eager model, timed as verification times
        inputs = [s.name for s in trace.io_specs(ckpt)[0]]
        feeds = case_lib.latency_feeds(ckpt, inputs, options.latency_shape, options.seed)
        record["original_eager_ms"] = median_latency_ms(trace.EagerRunner(replace(ckpt, model=original)), feeds,
                                                        budget_s=options.latency_budget_s / 2)
    del original
    return replace(ckpt, pruning=record)


AUTO_STEPS = 32
"""``--prune auto``'s resolution: FFN ratios in steps of 1/32."""
AUTO_MARGIN = 0.5
"""Calibration must meet half the allowed drop: pruning's worst case moves more between splits than INT8's (MiniLM
FFN 1/16: calibration min cosine 0.9878, held-out 0.9778; the INT8 budget's three-quarters let that through)."""


def auto_ratio(original: Any, facts: ModelFacts, spec: Any, budget: Any, cal: list[dict[str, Any]],
               stats_feeds: list[dict[str, Any]], say: Progress) -> tuple[Any, dict[str, Any]]:
    """``--prune auto``: the largest ratio whose cost on the calibration split meets ``--max-drop`` with half of the
    allowed drop to spare (``AUTO_MARGIN``), by bisection over ``AUTO_STEPS`` steps: step k removes k/AUTO_STEPS of the FFN
    channels and the same fraction of heads rounded down to what a layer can lose (per KV group for grouped-query
    models, else per head), so the first steps prune FFN channels only."""
    import copy
    from dataclasses import replace

    from kiln.compiler import prune as prune_lib
    from kiln.compiler.quantize.budget import AccuracyBudgetError

    group = facts.num_heads // facts.num_kv_heads
    levels = group if group > 1 else facts.num_heads
    values: dict[int, float] = {}

    def ratios(k: int) -> tuple[float, float]:
        return (k * levels // AUTO_STEPS) / levels, k / AUTO_STEPS

    def meets(k: int) -> bool:
        if k not in values:
            trial = copy.deepcopy(original)
            heads, ffn = ratios(k)
            prune_lib.prune(trial, facts.num_layers, facts.num_heads, facts.num_kv_heads, facts.head_size,
                            replace(spec, heads=heads, ffn=ffn, auto=False), stats_feeds, lambda m: None,
                            kv_cache=facts.kind == "decoder")
            values[k] = prune_lib.cost(original, trial, cal, facts.kind)[prune_lib.COST_KEYS[budget.metric]]
            say(f"prune auto: heads {heads:.3g}, FFN {ffn:.3g} -> calibration {budget.metric} {values[k]:.5g}")
        return budget.drop(values[k]) <= AUTO_MARGIN * budget.limit

    lo, hi = 0, AUTO_STEPS  # lo meets (nothing pruned); hi would leave nothing
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    if lo == 0:
        raise AccuracyBudgetError(
            f"--prune auto --max-drop {budget.metric}={budget.value}: even the smallest step (1/{AUTO_STEPS} of the "
            f"FFN channels) measures {budget.metric} {values[1]:.5g} on calibration text; loosen the budget or give --prune ratios")
    heads, ffn = ratios(lo)
    return (replace(spec, heads=heads, ffn=ffn, auto=False),
            {"metric": budget.metric, "budget": budget.value, "heads": heads, "ffn": ffn, "calibration": values[lo],
             "candidates": len(values)})


def fp64_fits(ckpt: Checkpoint) -> bool:
    """A float64 copy of the model (FP32 parity's rounding check) fits in a third of the memory available now."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such counter here: only the total is known
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    return sum(p.numel() for p in ckpt.model.parameters()) * 8 < available / 3


def model_facts(ckpt: Checkpoint) -> ModelFacts:
    cfg = ckpt.config
    if ckpt.kind == "seq2seq":
        s = trace_seq2seq.shapes(ckpt)
        return ModelFacts("seq2seq", s["layers"], s["heads"], s["heads"], s["head_size"], ckpt.max_length)

    def first(*keys: str) -> Any:
        return next((getattr(cfg, k) for k in keys if getattr(cfg, k, None)), None)

    layers = first("num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = first("num_attention_heads", "n_head", "n_heads", "num_heads")
    hidden = first("hidden_size", "dim", "n_embd", "d_model")
    if not (layers and heads and hidden):
        raise UnsupportedModelError(
            f"checkpoint {ckpt.path} ({ckpt.model_type}) has no attention layers kiln can count (config lacks "
            "num_hidden_layers / num_attention_heads / hidden_size); kiln compiles attention Transformers")
    kv = first("num_key_value_heads") or heads
    head_size = first("head_dim") or int(hidden) // int(heads)
    per_layer = tuple(ckpt.pruning["heads_per_layer"]) if ckpt.pruning else ()
    return ModelFacts(ckpt.kind, int(layers), int(heads), int(kv), int(head_size), ckpt.max_length,
                      sliding_windows(cfg, int(layers)), heads_per_layer=per_layer,
                      experts_layers=len(routed_experts(ckpt.model)))


def sliding_windows(cfg: Any, layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full), from ``layer_types`` where the config has them."""
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return (None,) * layers
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def apply_recipe(model: onnx.ModelProto, names: list[str], facts: ModelFacts, options: CompileOptions,
                 ckpt: Checkpoint, say: Progress,
                 drivers: list[driver_lib.QuantDriver] | None = None) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """Run the recipe's stages in order; calibrated stages are built by the INT8 driver from measurements
    of the graph they receive (the driver is appended to ``drivers`` when given)."""
    record: list[dict[str, Any]] = []
    driver: driver_lib.QuantDriver | None = drivers[0] if drivers else None  # AWQ's, when it ran before the trace
    for name in names:
        if name in options.disabled_passes:
            record.append({"name": name, "disabled": True, "stats": {}})
            continue
        if STAGES[name].calibrated:
            if driver is None:
                driver = driver_lib.QuantDriver(ckpt, facts, options, say)
                if drivers is not None:
                    drivers.append(driver)
            model, rec = driver.run(name, model)
        else:
            model, rec = run_passes(model, [build_pass(name, facts, options)], progress=say)
        record += rec
    return model, record


def optimise(path: Path, names: list[str], facts: ModelFacts, options: CompileOptions, ckpt: Checkpoint,
             say: Progress, graph: str = "", drivers: list[driver_lib.QuantDriver] | None = None
             ) -> tuple[list[dict[str, Any]], list[str]]:
    """Replace the traced graph at ``path`` with its optimised form; returns the record and coverage shortfalls.

    A streamed checkpoint's graph is loaded without its weights: passes read them from disk one at a time and spill
    what they create (``kiln.passes.weights``), and the result is compacted into one data file tensor by tensor."""
    if ckpt.streamed:
        store = WeightStore(path.parent)
        with store.active():
            model, record = apply_recipe(onnx.load(str(path), load_external_data=False), names, facts, options, ckpt,
                                         say, drivers)
        problems = check_coverage(record, facts, options.allow_partial_fusion, graph)
        written = compact(model, path.parent, path, threshold=1024)
        (path.parent / store.spill_name).unlink(missing_ok=True)
        say(f"wrote {path.name} with {written / 2**30:.2f} GiB of weights in {path.name}.data")
    else:
        model, record = apply_recipe(onnx.load(str(path)), names, facts, options, ckpt, say, drivers)
        problems = check_coverage(record, facts, options.allow_partial_fusion, graph)
        for f in path.parent.iterdir():
            if f.name.startswith(path.name):  # the traced graph and its external data
                f.unlink()
        external = model.ByteSize() > options.external_data_threshold
        onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                        location=path.name + ".data")
    if graph:
        for r in record:
            r["graph"] = graph
    return record, problems


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
            trace_stream.export(ckpt, root / GRAPH, options.opset, say)
        else:
            trace.export(ckpt, root / GRAPH, options.opset, options.external_data_threshold)
        record, problems = optimise(root / GRAPH, names, facts, options, ckpt, say, drivers=drivers)
        for problem in problems:
            say(f"warning: {problem} (--allow-partial-fusion)")
        data = manifest_lib.base(ckpt, facts, options, record, *trace.io_specs(ckpt), {"model": GRAPH})
        if ckpt.pruning is not None:
            data["pruning"] = ckpt.pruning
        cache = next((p["name"] for p in record if p["name"] in ("kv-cache", "kv-cache-concat")
                      and p["stats"].get("layers")), None)
        if cache:
            stats = next(p["stats"] for p in record if p["name"] == cache)
            rows = ("the TensorRT graph's Concat cache has one length for every row" if cache != "kv-cache" else
                    "learned position embeddings read each position from the mask" if stats.get("sliced_positions")
                    else None)
            manifest_lib.add_kv_cache(data, ckpt, facts, options, shared_buffer=cache == "kv-cache",
                                      dtype=cache_dtype(root / GRAPH), row_lengths_refused=rows)
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


def _build_seq2seq(ckpt: Checkpoint, facts: ModelFacts, names: list[str], root: Path, options: CompileOptions,
                   say: Progress) -> dict[str, Any]:
    say(f"export {ckpt.architecture} ({ckpt.task}) to an encoder and a decoder graph, ONNX opset {options.opset}")
    trace_seq2seq.export(ckpt, root, options.opset)
    s = trace_seq2seq.shapes(ckpt)
    # one MultiHeadAttention per encoder layer; self + cross per decoder layer
    graphs = {trace_seq2seq.ENCODER: ModelFacts("seq2seq", s["encoder_layers"], s["heads"], s["heads"], s["head_size"],
                                                ckpt.max_length),
              trace_seq2seq.DECODER: ModelFacts("seq2seq", s["layers"], s["heads"], s["heads"], s["head_size"],
                                                ckpt.max_length, attentions_per_layer=2)}
    record: list[dict[str, Any]] = []
    problems: list[str] = []
    for graph, graph_facts in graphs.items():
        rec, short = optimise(root / graph, names, graph_facts, options, ckpt, say, graph.split(".")[0])
        record += rec
        problems += short
    for problem in problems:
        say(f"warning: {problem} (--allow-partial-fusion)")
    spec = trace_seq2seq.io(ckpt)
    data = manifest_lib.base(ckpt, facts, options, record, spec["encoder"]["inputs"], spec["encoder"]["outputs"],
                             {"encoder": trace_seq2seq.ENCODER, "decoder": trace_seq2seq.DECODER})
    manifest_lib.add_seq2seq(data, ckpt, facts, options, (spec["decoder"]["inputs"], spec["decoder"]["outputs"]))
    return data




def exact_copy(root: Path) -> Path:
    """A scratch copy of the staged graph with every MatMulNBits at accuracy_level 0 (FP32 activations): it
    computes exactly what the codes dequantize to, so verification can compare it with the fake-quantized model
    to float rounding (the shipped kernel also rounds activations to int8 per block)."""
    out = Path(tempfile.mkdtemp(prefix="kiln-codes-"))
    for f in root.iterdir():
        if f.is_file() and not f.name.startswith(GRAPH):
            shutil.copy2(f, out / f.name)
    model = fp32_activations(onnx.load(str(root / GRAPH)))
    onnx.save_model(model, str(out / GRAPH), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=GRAPH + ".data")
    return out



FP16_CPU_UNFAITHFUL = ("ONNX Runtime CPU loads it, but its FP16 graph is not IEEE-faithful at overflow (a decomposed "
                       "RMSNorm whose x**2 exceeds 65504 returns the FP32 answer there, zeros in IEEE FP16: "
                       "tests/passes/test_reduce_precision.py), so it would hide what a strongly typed engine stores")


def cache_dtype(graph: Path) -> str:
    """The KV cache's element type at the graph's boundary (float16 in FP16 TensorRT graphs, else float32)."""
    model = onnx.load(str(graph), load_external_data=False)
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values."))
    return "float16" if past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else "float32"


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
    out = Path(tempfile.mkdtemp(prefix="kiln-emulate-"))
    for f in root.iterdir():
        if f.is_file() and not f.name.startswith(GRAPH):
            shutil.copy2(f, out / f.name)
    onnx.save_model(emulate(onnx.load(str(root / GRAPH))), str(out / GRAPH), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=GRAPH + ".data")
    return out, {"graph": "emulated", "ran_on": "onnxruntime-cpu",
                 "how": f"FP32 kernels with every {dtype} value rounded to {dtype} where it is produced", "why": why}


def copy_tokenizer(ckpt: Checkpoint, root: Path) -> None:
    if ckpt.tokenizer is None:
        return
    for name in ckpt.tokenizer_files:
        if name != "tokenizer.json":
            shutil.copy2(ckpt.path / name, root / name)
    # Saved from the loaded fast tokenizer, so checkpoints that ship only vocab files get one too.
    ckpt.tokenizer.backend_tokenizer.save(str(root / "tokenizer.json"))
    template = getattr(ckpt.tokenizer, "chat_template", None)
    if isinstance(template, str):  # from tokenizer_config.json or chat_template.jinja, whichever it came in
        (root / manifest_lib.CHAT_TEMPLATE).write_text(template)


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
        with kr.open_manifest(staged, threads=options.threads) as artifact:
            gen = verify_seq2seq(ckpt.model, artifact, ids, mask, GENERATION_STEPS, options.precision)
        report = {"precision": options.precision, "generation": gen, "passed": gen["passed"], "cases": [], "summary": {}}
    elif ckpt.streamed:
        report = stream_lib.verify(ckpt, root, staged, data, options, say, codes)
    else:
        inputs = [s.name for s in trace.io_specs(ckpt)[0]]
        cases = case_lib.text_cases(ckpt, inputs) + case_lib.random_cases(ckpt, inputs, options.verify_max_length,
                                                                          options.seed)
        eager = trace.EagerRunner(ckpt)
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
                if report["passed"] and "kv_cache" in data and ckpt.task == "causal-lm":
                    say(f"verify generation: {GENERATION_STEPS} greedy steps through the KV cache vs Hugging Face "
                        "generate" + (" (the codes: FP32-activation graph vs the fake-quantized model)" if codes else ""))
                    gen = verify_generation(codes if codes is not None else ckpt.model,
                                            exact_artifact if codes is not None else artifact,
                                            case_lib.generation_prompts(ckpt, options.seed), GENERATION_STEPS,
                                            "int4-codes" if codes is not None else options.precision,
                                            data["generation"]["pad_token_id"])
                    report["generation"] = gen
                    report["passed"] = gen["passed"]
                if numerics:
                    report["numerics"] = numerics
                if report["passed"] and not emulated:  # an emulation's speed is not the engine's
                    say("measure latency (eager vs artifact)")
                    feeds = case_lib.latency_feeds(ckpt, inputs, options.latency_shape, options.seed)
                    report["latency"] = latency(eager, artifact, feeds, options.latency_budget_s)
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
                          f"no artifact written, full report in {kept}")
    summary = driver_lib.cost_and_gain(data["passes"], report)
    if summary:
        report["quantization"] = summary
    if ckpt.pruning is not None:
        from kiln.compiler import prune as prune_lib

        report["pruning"] = prune_lib.summary(ckpt.pruning, report.get("latency"))
    return report
