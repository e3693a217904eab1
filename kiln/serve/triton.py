"""``kiln export triton``: an artifact as a Triton Inference Server model repository (ONNX Runtime backend).

    model_repository/<name>/config.pbtxt      inputs/outputs/dims from the graph and the manifest
    model_repository/<name>/1/model.onnx      the artifact's graph (+ model.onnx.data), checksums verified
    model_repository/<name>/kiln/             manifest.json and the tokenizer files, for clients

Encoders get dynamic batching (``max_batch_size``, ``max_queue_delay_microseconds``; dims without the batch
axis, ``-1`` for dynamic ones).

Decoders whose graph gives each row its own past length get a generation model instead: Triton's Python backend
in decoupled (streaming) mode running ``kiln.runtimes.scheduler`` (``kiln/serve/triton_python.py``, copied as
``1/model.py``; the artifact in ``1/artifact``): a prompt string in, text pieces out, decode steps batched across
requests (continuous batching; ``--max-batch`` slots, ``--queue`` waiting requests). ``graph_only`` (or a decoder
without per-row lengths: GPT-2's learned positions, older artifacts) exports the bare graph for whole-sequence
requests with ``max_batch_size: 0`` (full shapes): its KV-cache tensors carry a per-request past length, which
Triton's dynamic batcher cannot concatenate. Encoder-decoders (two graphs) are refused. Written into a staging
directory and renamed: never half a repository. Imports ``kiln.runtimes`` only.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kiln.errors import UsageError
from kiln.runtimes import kernels
from kiln.runtimes.artifact import MANIFEST, Manifest, read_manifest

DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "float16": "TYPE_FP16",
          "bool": "TYPE_BOOL"}
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def graph_io(manifest: Manifest) -> tuple[set[str], set[str]]:
    """The input and output names the ONNX graph really has (the manifest may list inputs a pass removed)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(kernels.portable_graph(manifest)), opts, providers=["CPUExecutionProvider"])
    return {i.name for i in session.get_inputs()}, {o.name for o in session.get_outputs()}


def tensor(spec: dict[str, Any], batched: bool) -> str:
    dims = [d if isinstance(d, int) else -1 for d in spec["shape"]]
    if batched:
        dims = dims[1:]
    extra = ""
    if not dims:  # a scalar (logits_to_keep): Triton wants one dim, reshaped away for the backend
        dims, extra = [1], " reshape: { shape: [ ] }"
    dtype = DTYPES.get(spec["dtype"])
    if dtype is None:
        raise UsageError(f"tensor {spec['name']} has dtype {spec['dtype']}, which kiln cannot map to a Triton type")
    return f'  {{ name: "{spec["name"]}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]{extra} }}'


def config(manifest: Manifest, name: str, max_batch: int, max_wait_ms: float, instances: int, device: str,
           threads: int | None) -> str:
    """config.pbtxt text (protobuf text format of ``inference.ModelConfig``)."""
    inputs, outputs = graph_io(manifest)
    batched = manifest.kind == "encoder" and max_batch > 0
    ins = [s for s in manifest.data["inputs"] if s["name"] in inputs]
    outs = [s for s in manifest.data["outputs"] if s["name"] in outputs]
    missing = sorted(inputs - {s["name"] for s in ins})
    if missing:
        raise UsageError(f"{manifest.root}: graph inputs {', '.join(missing)} are not in {MANIFEST}; "
                         "recompile the artifact")
    lines = [f'name: "{name}"', 'backend: "onnxruntime"', f"max_batch_size: {max_batch if batched else 0}",
             "input [", ",\n".join(tensor(s, batched) for s in ins), "]",
             "output [", ",\n".join(tensor(s, batched) for s in outs), "]"]
    if batched:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {int(max_wait_ms * 1000)} }}")
    lines.append(f"instance_group [ {{ count: {instances} kind: {'KIND_GPU' if device == 'gpu' else 'KIND_CPU'} }} ]")
    if threads:
        lines.append(f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{threads}" }} }}')
    return "\n".join(lines) + "\n"


def generation_config(name: str, slots: int, queue: int, instances: int, threads: int | None) -> str:
    """config.pbtxt of the decoupled Python-backend generation model."""
    optional = [("max_tokens", "TYPE_INT32"), ("temperature", "TYPE_FP32"), ("top_p", "TYPE_FP32"),
                ("top_k", "TYPE_INT32"), ("seed", "TYPE_INT64")]
    params = {"slots": slots, "queue": queue, **({"threads": threads} if threads else {})}
    lines = [f'name: "{name}"', 'backend: "python"', "max_batch_size: 0",
             "model_transaction_policy { decoupled: true }",
             "input [", ",\n".join(['  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }',
                                     *(f'  {{ name: "{n}" data_type: {t} dims: [ 1 ] optional: true }}'
                                       for n, t in optional)]), "]",
             "output [", '  { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }', "]",
             f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]"]
    lines += [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()]
    return "\n".join(lines) + "\n"


def generates(manifest: Manifest) -> str | None:
    """Why this artifact gets the bare graph rather than the generation model (None: it gets the model)."""
    kv = manifest.data.get("kv_cache")
    if manifest.kind != "decoder" or not kv:
        return "not a decoder with a KV cache"
    if not kv.get("row_lengths"):
        return kv.get("row_lengths_refused") or "compiled by an older kiln: recompile it for the generation model"
    return None


def export(artifact: str | Path, out: str | Path, name: str | None = None, max_batch: int = 32,
           max_wait_ms: float = 5.0, instances: int = 1, device: str = "cpu", threads: int | None = None,
           force: bool = False, graph_only: bool = False, queue: int = 64) -> Path:
    manifest = read_manifest(artifact)  # checksums first: never export a tampered artifact
    if manifest.kind == "seq2seq":
        raise UsageError(f"{artifact} is an encoder-decoder (two graphs); kiln export triton writes single-graph "
                         "artifacts (encoders, decoders)")
    kept = [why for key, why in (("assumptions", "checks the branches the graph was traced for on every run"),
                                 ("length_multiple", "pads each request to the graph's whole blocks"))
            if manifest.data.get(key)]
    if kept:
        raise UsageError(f"{artifact}: kiln's runtime {' and '.join(kept)}, which Triton's ONNX Runtime backend "
                         "does not do; serve it with kiln serve")
    name = name or Path(artifact).absolute().name
    if not _NAME.match(name):
        raise UsageError(f"--name {name!r}: Triton model names take letters, digits, '_', '-' and '.'")
    if max_batch < 0 or instances < 1 or max_wait_ms < 0 or device not in ("cpu", "gpu"):
        raise UsageError("--max-batch >= 0, --instances >= 1, --max-wait-ms >= 0 and --device cpu|gpu")
    out = Path(out).absolute()
    target = out / name
    if target.exists() and not force:
        raise UsageError(f"{target} exists; pass --force to replace it or choose another -o / --name")
    if not out.parent.is_dir():
        raise UsageError(f"the parent directory of {out} does not exist; create it first")
    python = manifest.kind == "decoder" and not graph_only and generates(manifest) is None
    if python and (device != "cpu" or max_batch < 1):
        raise UsageError("the decoder generation model runs kiln's scheduler on ONNX Runtime CPU: --device cpu and "
                         "--max-batch >= 1 (its slots), or --graph-only for the bare graph")
    text = (generation_config(name, max_batch, queue, instances, threads) if python else
            config(manifest, name, max_batch, max_wait_ms, instances, device, threads))
    out.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.kiln-", dir=out))
    try:
        (staging / "config.pbtxt").write_text(text)
        version = staging / "1"
        version.mkdir()
        graph = manifest.graph_path()
        # Triton's ONNX Runtime backend cannot load kiln's kernel library: it gets the artifact's portable graph
        # (the same codes on ONNX Runtime's MatMulNBits), under the graph's own name, beside the same weights file
        portable = kernels.portable_graph(manifest)
        if python:
            shutil.copy2(Path(__file__).with_name("triton_python.py"), version / "model.py")
            (version / "artifact").mkdir()
            for rel in [MANIFEST, *manifest.data["files"]]:
                (version / "artifact" / rel).parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(manifest.root / rel, version / "artifact" / rel)
        for f in manifest.root.iterdir():
            if not python and f.name.startswith(graph.name):  # the graph and its external data
                source = portable if f.name == graph.name else f
                _link_or_copy(source, version / ("model.onnx" + f.name[len(graph.name):]))
        kiln_dir = staging / "kiln"
        kiln_dir.mkdir()
        for rel in [MANIFEST, *manifest.data["files"]]:
            if not rel.startswith(graph.name) and rel != portable.name and "/" not in rel:
                shutil.copy2(manifest.root / rel, kiln_dir / rel)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # same filesystem: no second copy of the weights
    except OSError:
        shutil.copy2(src, dst)
