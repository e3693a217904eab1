"""The artifact's ``manifest.json``: every section is built here, and written once, when the artifact is
complete (the verifier opens the staged artifact from the manifest in memory)."""

from __future__ import annotations

import contextlib
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import onnx

from kiln import __version__
from kiln.compiler.load import Checkpoint
from kiln.passes.kiln_kernels import fallback_name
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import ModelFacts
from kiln.compiler.staging import CHAT_TEMPLATE
from kiln.errors import UnsupportedModelError, UsageError
from kiln.runtimes.artifact import MANIFEST, SCHEMA_VERSION, TensorSpec, sha256_file

_TOOLS = ("kiln", "torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "numpy", "tokenizers")
RUNTIME_OF_TARGET = {"cpu": "onnxruntime-cpu", "tensorrt": "tensorrt"}
"""--target -> the manifest's ``target``: the runtime the graph is built for."""
VERIFIED_ON = {"backend": "onnxruntime", "providers": ["CPUExecutionProvider"], "device": "cpu"}
"""Where verification and the latency measurement run today, for every target."""


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _TOOLS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def tokenizer_section(ckpt: Checkpoint) -> dict[str, Any] | None:
    tok = ckpt.tokenizer
    if tok is None:
        return None
    out = {"file": "tokenizer.json", "pad_token_id": ckpt.pad_token_id, "padding_side": ckpt.padding_side,
           "add_special_tokens": True, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    if isinstance(getattr(tok, "chat_template", None), str):  # written beside it by staging.copy_tokenizer
        out |= {"chat_template": CHAT_TEMPLATE, "bos_token": tok.bos_token, "eos_token": tok.eos_token}
    return out


def base(ckpt: Checkpoint, facts: ModelFacts, options: CompileOptions, record: list[dict[str, Any]],
         inputs: list[TensorSpec], outputs: list[TensorSpec], graphs: dict[str, str]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kiln_version": __version__,
        "model": {
            "architecture": ckpt.architecture, "model_type": ckpt.model_type, "kind": ckpt.kind, "task": ckpt.task,
            "max_sequence_length": ckpt.max_length, "vocab_size": ckpt.vocab_size,
            "num_layers": facts.num_layers, "labels": ckpt.labels, "pooling": ckpt.pooling,
            "source": {"path": str(ckpt.path.absolute()), "sha256": ckpt.sha256} if ckpt.source is None else
                      dict(ckpt.source),
        },
        "inputs": [s.to_json() for s in inputs],
        "outputs": [s.to_json() for s in outputs],
        "dynamic_axes": {"batch": {"min": 1}, "sequence": {"min": 1, "max": ckpt.max_length}},
        "graphs": graphs,
        "opset": options.opset,
        "precision": options.precision,
        "target": RUNTIME_OF_TARGET[options.target],
        "passes": record,
        "tokenizer": tokenizer_section(ckpt),
        "verification": {"status": "skipped" if not options.verify else "pending"},
        "options": options.to_json(),
        "tool_versions": tool_versions(),
    }
    kiln_nodes = sum(int(r["stats"].get("kiln_kernels", 0)) for r in record if r["name"] == "kiln-kernels")
    if kiln_nodes:  # kiln's kernel library computes them; the fallback graphs use ONNX Runtime's MatMulNBits
        data["kernels"] = {"op": "ai.kiln.MatMulNBits", "nodes": kiln_nodes,
                           "fallback": {k: fallback_name(v) for k, v in graphs.items()}}
    if ckpt.tokenizer_problem:
        data["tokenizer_warning"] = f"no tokenizer shipped: {ckpt.tokenizer_problem}; verified on random token ids only"
    return data


def add_traced(data: dict[str, Any], graph: str, log: Any, ckpt: Checkpoint, axis: str) -> None:
    """What the trace had to fix (``kiln.compiler.decided``): the decisions on tensor data the graph was traced for
    (``assumptions``, per graph, checked by the runtime on every run) and the block its ``axis`` length comes in
    (``length_multiple``: the runtime pads requests to it with the model's pad id, masked)."""
    if log.assumptions:
        data.setdefault("assumptions", {})[graph] = log.assumptions
    if log.blocks:
        pad = getattr(ckpt.config, "pad_token_id", None)
        known = isinstance(pad, int) and pad >= 0 and (ckpt.vocab_size is None or pad < ckpt.vocab_size)
        data["length_multiple"] = {"axis": axis, "multiple": int(next(iter(log.blocks.values()))),
                                   "pad_token_id": int(pad) if known else 0}


def kv_names(layers: int) -> dict[str, list[str]]:
    return {
        "past": [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")],
        "present": [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")],
        "cross": [f"cross.{i}.{k}" for i in range(layers) for k in ("key", "value")],
    }


def add_kv_cache(data: dict[str, Any], ckpt: Checkpoint, facts: ModelFacts, options: CompileOptions,
                 shared_buffer: bool = True, dtype: str = "float32", row_lengths_refused: str | None = None,
                 dims: dict[str, Any] | None = None) -> None:
    """Decoders: the cache inputs/outputs, their layout and capacity, and what generation needs to stop.
    ``shared_buffer``: GroupQueryAttention's in-place cache (CPU); False for the TensorRT graph's Concat cache, whose
    present is the past plus the new positions (a runtime feeds it back as the next past). ``row_lengths_refused``:
    why rows of one batch cannot each have their own past length (continuous batching), None when they can."""
    capacity = options.max_length or ckpt.max_length
    if capacity > ckpt.max_length:
        raise UsageError(f"--max-length {capacity} exceeds the model's maximum sequence length {ckpt.max_length}; "
                         f"give at most {ckpt.max_length}")
    dims = dims or {"num_kv_heads": facts.num_kv_heads, "head_size": facts.head_size,
                    "value_head_size": facts.head_size, "layers": facts.num_layers}
    names = kv_names(dims["layers"])  # one cache per attention call (a layer may attend twice)
    heads = dims["num_kv_heads"]
    size = {"key": dims["head_size"], "value": dims["value_head_size"]}
    data["inputs"] = [dict(s, shape=["batch", "total_sequence"]) if s["name"] == "attention_mask" else s
                      for s in data["inputs"]]
    per = dims.get("layer_shapes") or [[heads, size[n.rsplit(".", 1)[1]]] for n in names["past"]]
    data["inputs"] += [TensorSpec(n, dtype, ("batch", h, "past_sequence", d), True, "empty").to_json()
                       for n, (h, d) in zip(names["past"], per)]
    data["outputs"] += [TensorSpec(n, dtype, ("batch", h, "present_sequence", d)).to_json()
                        for n, (h, d) in zip(names["present"], per)]
    data["dynamic_axes"]["total_sequence"] = {"min": 1, "max": capacity}
    data["kv_cache"] = {
        "layout": ["batch", "kv_heads", "sequence", "head_size"], "dtype": dtype,
        "num_layers": dims["layers"], "num_kv_heads": heads, "head_size": size["key"],
        **({"value_head_size": size["value"]} if size["value"] != size["key"] else {}),
        **({"layer_shapes": dims["layer_shapes"]} if dims.get("layer_shapes") else {}),
        "past": names["past"], "present": names["present"], "capacity": capacity,
        # GroupQueryAttention writes new entries at position seqlens_k of the past it is given: a runtime
        # may bind one buffer of `capacity` positions as both past and present and never copy the cache.
        "shared_buffer": shared_buffer,
        # each row's past length is the index of its last 1 in a right-padded mask (kiln.runtimes.scheduler)
        "row_lengths": row_lengths_refused is None,
    }
    if row_lengths_refused:
        data["kv_cache"]["row_lengths_refused"] = row_lengths_refused
    data["generation"] = generation_defaults(ckpt)


def add_logits_to_keep(data: dict[str, Any], name: str) -> None:
    """The graph takes the optional scalar ``name`` (0, the default a runtime fills: every position's logits);
    with a KV cache, generation feeds 1 so the prefill computes the head for the last position only."""
    data["inputs"].append(TensorSpec(name, "int64", (), True, "zeros").to_json())
    if "kv_cache" in data:
        data["kv_cache"]["logits_to_keep"] = name
    elif (data.get("generation") or {}).get("recompute"):
        data["generation"]["logits_to_keep"] = name


def add_seq2seq(data: dict[str, Any], ckpt: Checkpoint, facts: ModelFacts, options: CompileOptions,
                decoder_io: tuple[list[TensorSpec], list[TensorSpec]]) -> None:
    """Encoder-decoders: the decoder graph's contract, the self/cross cache layout, the decoder start token."""
    names = kv_names(facts.num_layers)
    data["decoder"] = {"inputs": [t.to_json() for t in decoder_io[0]], "outputs": [t.to_json() for t in decoder_io[1]]}
    data["kv_cache"] = {"layout": ["batch", "heads", "sequence", "head_size"], "dtype": "float32",
                        "num_layers": facts.num_layers, "num_kv_heads": facts.num_heads, "head_size": facts.head_size,
                        "past": names["past"], "present": names["present"], "cross": names["cross"],
                        "capacity": options.max_length or ckpt.max_length, "shared_buffer": False}
    data["generation"] = dict(generation_defaults(ckpt), decoder_start_token_id=int(ckpt.config.decoder_start_token_id))


def generation_defaults(ckpt: Checkpoint) -> dict[str, Any]:
    """Stop and pad ids from the generation config (else the model config), kept only if in the vocabulary."""
    vocab = ckpt.vocab_size
    gen = getattr(ckpt.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = getattr(ckpt.config, "eos_token_id", None) if eos is None else eos
    eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None and 0 <= int(e) < vocab]
    pad = getattr(gen, "pad_token_id", None) if gen is not None else None
    pad = pad if pad is not None and 0 <= int(pad) < vocab else (eos_ids[0] if eos_ids else 0)
    return {"eos_token_ids": eos_ids, "pad_token_id": int(pad)}


def verification(report: dict[str, Any], options: CompileOptions) -> dict[str, Any]:
    """The manifest's summary of a passed verification, saying where it ran (never implying a GPU)."""
    on = dict(VERIFIED_ON, threads=options.threads)
    if options.target != "cpu":
        how = ("verified on ONNX Runtime CPU through an FP32 emulation of its rounding, not timed"
               if report.get("numerics") else "the graph was verified and timed on ONNX Runtime CPU")
        on["note"] = f"target {options.target}: {how}; no TensorRT engine was built or run"
    out: dict[str, Any] = {"status": "passed", "report": "report.json", "verified_on": on, "summary": report["summary"]}
    if report.get("numerics"):
        out["numerics"] = report["numerics"]
    if report.get("latency"):
        out["latency"] = dict(report["latency"], measured_on=f"{on['backend']} {on['device']}")
    if report.get("quantization"):
        out["quantization"] = report["quantization"]
    if report.get("pruning"):
        out["pruning"] = report["pruning"]
    if "generation" in report:
        out["generation"] = {k: report["generation"][k] for k in
                             ("steps", "batch", "tokens_identical", "max_abs_over_atol", "ties", "reference", "through")
                             if k in report["generation"]}
    if "generation_1" in report:
        out["generation_batch_1"] = {k: report["generation_1"][k] for k in ("steps", "tokens_identical", "max_abs_over_atol")
                                     if k in report["generation_1"]}
    if "rows" in report:
        out["rows"] = {k: report["rows"][k] for k in ("rows", "steps", "max_abs_over_bound", "tokens_identical")}
    if report.get("reference"):  # a streamed checkpoint: what the artifact was compared with, and how
        out["reference"] = report["reference"]
    return out


def write(root: Path, data: dict[str, Any]) -> None:
    """Write ``manifest.json`` with the sha256 of every other file in ``root``."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    data = dict(data, files={p.relative_to(root).as_posix(): sha256_file(p) for p in files})
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(root / MANIFEST)


def cache_dtype(graph: Path) -> str:
    """The KV cache's element type at the graph's boundary (float16 in FP16 TensorRT graphs, else float32)."""
    model = onnx.load(str(graph), load_external_data=False)
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values."))
    return "float16" if past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else "float32"


def cache_dims(graph: Path) -> dict[str, Any]:
    """The KV cache's KV heads and key / value features, read from the graph's past inputs (the captured attention
    gave each layer its own; a model's config can say otherwise, as multi-query or latent-attention configs do).
    Layers that differ (per-layer head counts or sizes) are listed one by one in ``layer_shapes``."""
    model = onnx.load(str(graph), load_external_data=False)
    past = [(i.name, i.type.tensor_type.shape.dim) for i in model.graph.input if i.name.startswith("past_key_values.")]
    shapes = [[d[1].dim_value, d[3].dim_value] for _, d in past]
    keys = {tuple(s) for (n, _), s in zip(past, shapes) if n.endswith(".key")}
    values = {tuple(s) for (n, _), s in zip(past, shapes) if n.endswith(".value")}
    out: dict[str, Any] = {"layers": sum(1 for n, _ in past if n.endswith(".key"))}
    (heads, key), (vheads, value) = shapes[0], shapes[1]
    out.update(num_kv_heads=heads, head_size=key, value_head_size=value)
    if len(keys) > 1 or len(values) > 1 or heads != vheads:
        out["layer_shapes"] = shapes
    return out