"""``compile``: checkpoint -> traced graph -> passes -> verified artifact directory."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kiln.runtimes as kr
from kiln import __version__
from kiln.compiler import cases as case_lib
from kiln.compiler.artifact import check_output, staging, tool_versions, write_manifest
from kiln.compiler.load import Checkpoint, load_checkpoint
from kiln.compiler import int8
from kiln.compiler.options import CALIBRATION_METHODS, PRECISIONS, TARGETS, TASKS, CompileOptions
from kiln.compiler.pipeline import ModelFacts, check_coverage, select_passes
from kiln.compiler.trace import EagerRunner, export, io_specs
from kiln.compiler.verify import failures, latency, verify
from kiln.compiler.verify_generation import verify_generation
from kiln.errors import ParityError, UsageError
from kiln.passes import check_disabled, run_passes
from kiln.passes.kv_cache import PAST, PRESENT
from kiln.runtimes.artifact import REPORT, SCHEMA_VERSION, TensorSpec

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
GRAPH = "model.onnx"
GENERATION_STEPS = 16


def _check_options(options: CompileOptions) -> None:
    if options.precision not in PRECISIONS:
        raise UsageError(f"precision {options.precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if options.max_length is not None and options.max_length < 2:
        raise UsageError(f"--max-length {options.max_length} is too small; give at least 2 (prompt + one new token)")
    if (options.max_drop or options.calibration or options.static or options.smoothquant is not None) \
            and options.precision != "int8":
        raise UsageError("--max-drop, --calibration, --static and --smoothquant configure INT8; add --precision int8")
    if options.calibration_method not in CALIBRATION_METHODS:
        raise UsageError(f"--calibration-method {options.calibration_method!r} is unknown; choose one of "
                         f"{', '.join(CALIBRATION_METHODS)}")
    if options.outlier_ratio and options.outlier_ratio <= 1.0:
        raise UsageError(f"--outlier-ratio {options.outlier_ratio}: give a ratio above 1 (6 is typical) or 0 to turn it off")
    if options.smoothquant is not None and not 0.0 <= options.smoothquant <= 1.0:
        raise UsageError(f"--smoothquant {options.smoothquant}: alpha must be in [0, 1] (0.5 is typical)")
    if options.target not in TARGETS:
        raise UsageError(f"target {options.target!r} is not supported; choose one of {', '.join(TARGETS)}")
    if options.task is not None and options.task not in TASKS:
        raise UsageError(f"task {options.task!r} is unknown; choose one of {', '.join(TASKS)}")


def compile(checkpoint: str | Path, output: str | Path, options: CompileOptions | None = None,
            progress: Progress | None = None) -> Path:
    """Compile a Hugging Face checkpoint directory into a verified artifact at ``output``."""
    options = options or CompileOptions()
    say = progress or (lambda msg: log.info(msg))
    _check_options(options)
    output = Path(output).absolute()
    check_output(output, options.force)
    say(f"load {checkpoint}")
    ckpt = load_checkpoint(checkpoint, options.task)
    with staging(output, options.force) as root:
        build(ckpt, root, options, say)
    say(f"wrote {output}")
    return output


def build(ckpt: Checkpoint, root: Path, options: CompileOptions, say: Progress) -> None:
    if ckpt.kind == "seq2seq":
        from kiln.compiler.build_seq2seq import build_seq2seq

        build_seq2seq(ckpt, root, options, say, manifest_data, copy_tokenizer, generation_defaults)
        return
    say(f"export {ckpt.architecture} ({ckpt.task}) to ONNX opset {options.opset}")
    graph_files = export(ckpt, root / GRAPH, options.opset, options.external_data_threshold)
    facts = model_facts(ckpt)
    passes = select_passes(facts, options.precision, options.target, options.static)
    check_disabled(passes, options.disabled_passes)
    record: list[dict[str, Any]] = []
    target_info: dict[str, Any] = {}
    if passes:
        import onnx

        if options.precision == "int8":
            model, record = int8.quantize_graph(ckpt, onnx.load(str(root / GRAPH)), passes, facts, options, say)
        else:
            model, record = run_passes(onnx.load(str(root / GRAPH)), passes, options.disabled_passes, say)
        for problem in check_coverage(record, facts, options.allow_partial_fusion):
            say(f"warning: {problem} (--allow-partial-fusion)")
        if options.target == "tensorrt":
            from kiln.passes.check_tensorrt import min_tensorrt

            target_info["min_tensorrt"] = min_tensorrt(model)
        external = len(graph_files) > 1
        for f in graph_files:
            f.unlink()
        onnx.save_model(model, str(root / GRAPH), save_as_external_data=external,
                        all_tensors_to_one_file=True, location=GRAPH + ".data")

    tok = case_lib.load_hf_tokenizer(ckpt.path)
    tokenizer_spec = copy_tokenizer(ckpt, tok, root)
    manifest = manifest_data(ckpt, facts, options, record, tokenizer_spec)
    cache = next((p for p in record if p["name"] == "kv-cache" and p["stats"].get("layers")), None)
    if cache is not None:
        add_kv_cache(manifest, ckpt, facts, options)
    if target_info:
        manifest["target_info"] = target_info
    write_manifest(root, manifest)
    if not options.verify:
        say("verification skipped (--no-verify)")
        return

    inputs = [s.name for s in io_specs(ckpt)[0]]
    cases = case_lib.text_cases(ckpt, tok, inputs) if tok is not None else []
    cases += case_lib.random_cases(ckpt, inputs, options.verify_max_length, options.seed)
    eager = EagerRunner(ckpt, options.threads)
    with kr.load(root, threads=options.threads) as artifact:
        report = verify(eager, artifact, cases, options.precision, say)
        if report["passed"] and "kv_cache" in manifest and ckpt.task == "causal-lm":
            say(f"verify generation: {GENERATION_STEPS} greedy steps through the KV cache vs Hugging Face generate")
            gen = verify_generation(ckpt.model, artifact, case_lib.generation_prompts(ckpt, tok, options.seed),
                                    GENERATION_STEPS, options.precision, manifest["generation"]["pad_token_id"])
            report["generation"] = gen
            report["passed"] = gen["passed"]
        if report["passed"]:
            say("measure latency (eager vs artifact)")
            feeds = case_lib.latency_feeds(ckpt, inputs, options.latency_shape, options.seed)
            report["latency"] = latency(eager, artifact, feeds, options.latency_budget_s)
    report = {"schema_version": SCHEMA_VERSION, "checkpoint": str(ckpt.path), **report}
    if not report["passed"]:
        kept = Path(tempfile.mkdtemp(prefix="kiln-parity-")) / REPORT
        kept.write_text(json.dumps(report, indent=2))
        problems = failures(report)
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ParityError(
            f"parity check failed for {ckpt.path}: {'; '.join(problems[:3])}{more}; "
            f"no artifact written, full report in {kept}"
        )
    int8_summary = int8.cost_and_gain(record, report)
    if int8_summary:
        report["quantization"] = int8_summary
    (root / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    manifest["verification"] = {"status": "passed", "report": REPORT, "summary": report["summary"],
                                "latency": report.get("latency")}
    if int8_summary:
        manifest["verification"]["quantization"] = int8_summary
    if "generation" in report:
        manifest["verification"]["generation"] = {k: report["generation"][k] for k in
                                                  ("steps", "batch", "tokens_identical", "max_abs_over_atol", "ties")}
    write_manifest(root, manifest)


def model_facts(ckpt: Checkpoint) -> ModelFacts:
    cfg = ckpt.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or getattr(cfg, "n_layers")
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or getattr(cfg, "n_heads")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "dim", None) or cfg.n_embd
    head_size = getattr(cfg, "head_dim", None) or int(hidden) // int(heads)
    return ModelFacts(ckpt.kind, int(layers), int(heads), int(kv), int(head_size), ckpt.max_length,
                      sliding_windows(cfg, int(layers)))


def sliding_windows(cfg: Any, layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full), from ``layer_types`` where the config has them."""
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return (None,) * layers
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def copy_tokenizer(ckpt: Checkpoint, tok: Any | None, root: Path) -> dict[str, Any] | None:
    if tok is None:
        return None
    for name in ckpt.tokenizer_files:
        if name != "tokenizer.json":
            shutil.copy2(ckpt.path / name, root / name)
    # Saved from the loaded fast tokenizer, so checkpoints that ship only vocab files get one too.
    tok.backend_tokenizer.save(str(root / "tokenizer.json"))
    return {
        "file": "tokenizer.json",
        "pad_token_id": case_lib.pad_token_id(ckpt, tok),
        "padding_side": case_lib.padding_side(ckpt),
        "add_special_tokens": True,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
    }


def add_kv_cache(manifest: dict[str, Any], ckpt: Checkpoint, facts: ModelFacts, options: CompileOptions) -> None:
    """The cache inputs/outputs, their layout and capacity, and what generation needs to stop."""
    capacity = options.max_length or ckpt.max_length
    if capacity > ckpt.max_length:
        raise UsageError(f"--max-length {capacity} exceeds the model's maximum sequence length {ckpt.max_length}; "
                         f"give at most {ckpt.max_length}")
    names = {"past": [], "present": []}
    for i in range(facts.num_layers):
        for kind in ("key", "value"):
            names["past"].append(PAST.format(i, kind))
            names["present"].append(PRESENT.format(i, kind))
    shape = ["batch", facts.num_kv_heads, "past_sequence", facts.head_size]
    manifest["inputs"] = [dict(s, shape=["batch", "total_sequence"]) if s["name"] == "attention_mask" else s
                          for s in manifest["inputs"]]
    manifest["inputs"] += [TensorSpec(n, "float32", tuple(shape), True, "empty").to_json() for n in names["past"]]
    manifest["outputs"] += [TensorSpec(n, "float32", tuple(shape[:2] + ["present_sequence"] + shape[3:])).to_json()
                            for n in names["present"]]
    manifest["dynamic_axes"]["total_sequence"] = {"min": 1, "max": capacity}
    manifest["kv_cache"] = {
        "layout": ["batch", "kv_heads", "sequence", "head_size"], "dtype": "float32",
        "num_layers": facts.num_layers, "num_kv_heads": facts.num_kv_heads, "head_size": facts.head_size,
        "past": names["past"], "present": names["present"], "capacity": capacity,
        # GroupQueryAttention writes new entries at position seqlens_k of the past it is given: a runtime
        # may bind one buffer of `capacity` positions as both past and present and never copy the cache.
        "shared_buffer": True,
    }
    manifest["generation"] = generation_defaults(ckpt)


def generation_defaults(ckpt: Checkpoint) -> dict[str, Any]:
    """Stop and pad ids from the generation config (else the model config), kept only if in the vocabulary."""
    vocab = int(ckpt.config.vocab_size)
    gen = getattr(ckpt.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = ckpt.config.eos_token_id if eos is None else eos
    eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None and 0 <= int(e) < vocab]
    pad = getattr(gen, "pad_token_id", None) if gen is not None else None
    pad = pad if pad is not None and 0 <= int(pad) < vocab else (eos_ids[0] if eos_ids else 0)
    return {"eos_token_ids": eos_ids, "pad_token_id": int(pad)}


def manifest_data(ckpt: Checkpoint, facts: ModelFacts, options: CompileOptions, record: list[dict[str, Any]],
                  tokenizer: dict[str, Any] | None) -> dict[str, Any]:
    inputs, outputs = io_specs(ckpt)
    return {
        "schema_version": SCHEMA_VERSION,
        "kiln_version": __version__,
        "model": {
            "architecture": ckpt.architecture,
            "model_type": ckpt.model_type,
            "kind": ckpt.kind,
            "task": ckpt.task,
            "max_sequence_length": ckpt.max_length,
            "vocab_size": int(ckpt.config.vocab_size),
            "num_layers": facts.num_layers,
            "labels": ckpt.labels,
            "pooling": ckpt.pooling,
            "source": {"path": str(ckpt.path.absolute()), "sha256": ckpt.sha256},
        },
        "inputs": [s.to_json() for s in inputs],
        "outputs": [s.to_json() for s in outputs],
        "dynamic_axes": {"batch": {"min": 1}, "sequence": {"min": 1, "max": ckpt.max_length}},
        "graphs": {"model": GRAPH},
        "opset": options.opset,
        "precision": options.precision,
        "target": {"cpu": "onnxruntime-cpu", "tensorrt": "tensorrt"}[options.target],
        "passes": record,
        "tokenizer": tokenizer,
        "verification": {"status": "skipped" if not options.verify else "pending"},
        "options": options.to_json(),
        "tool_versions": tool_versions(),
    }
