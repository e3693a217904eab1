"""A traced graph through its recipe: each stage of ``pipeline.recipe`` in order (calibrated stages built by the
quantization driver from measurements of the graph they receive), attention coverage summarised, the graph written back
(its weights in external data above the threshold; a streamed checkpoint's compacted tensor by tensor)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from kiln.compiler.load import Checkpoint
from kiln.compiler.options import CompileOptions
from kiln.compiler.pipeline import STAGES, ModelFacts, attention_summary, build_pass
from kiln.compiler.quantize import driver as driver_lib
from kiln.passes import run_passes
from kiln.passes.kiln_kernels import fallback, fallback_name
from kiln.passes.weights import WeightStore, compact

Progress = Callable[[str], None]


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
             say: Progress, graph: str = "", drivers: list[driver_lib.QuantDriver] | None = None,
             delegated: list[dict[str, Any]] | None = None
             ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Replace the traced graph at ``path`` with its optimised form; returns the record, the attention summary
    (``pipeline.attention_summary``; ``delegated``: the attention calls the capture left to the model) and the
    blocks left unfused, one line each.

    A streamed checkpoint's graph is loaded without its weights: passes read them from disk one at a time and spill
    what they create (``kiln.passes.weights``), and the result is compacted into one data file tensor by tensor."""
    if ckpt.streamed:
        store = WeightStore(path.parent)
        with store.active():
            model, record = apply_recipe(onnx.load(str(path), load_external_data=False), names, facts, options, ckpt,
                                         say, drivers)
        summary, problems = attention_summary(record, facts, options.require_fusion, graph, delegated)
        written = compact(model, path.parent, path, threshold=1024)
        (path.parent / store.spill_name).unlink(missing_ok=True)
        say(f"wrote {path.name} with {written / 2**30:.2f} GiB of weights in {path.name}.data")
    else:
        model, record = apply_recipe(onnx.load(str(path)), names, facts, options, ckpt, say, drivers)
        summary, problems = attention_summary(record, facts, options.require_fusion, graph, delegated)
        for f in path.parent.iterdir():
            if f.name.startswith(path.name):  # the traced graph and its external data
                f.unlink()
        external = model.ByteSize() > options.external_data_threshold
        onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                        location=path.name + ".data")
    if any(r["name"] == "kiln-kernels" and r["stats"].get("kiln_kernels") for r in record):
        write_fallback(path)
    if graph:
        for r in record:
            r["graph"] = graph
    return record, summary, problems


def write_fallback(path: Path) -> None:
    """Beside the graph at ``path``: the same graph with ONNX Runtime's MatMulNBits in place of kiln's, for machines
    without kiln's kernel library. Weights in external data are shared (the same file, the same offsets)."""
    data = path.with_name(path.name + ".data")
    if not data.exists():  # a small graph held its weights: moved out, so the twin shares them instead of a copy
        onnx.save_model(onnx.load(str(path)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
    model = onnx.load(str(path), load_external_data=False)
    fallback(model)
    onnx.save_model(model, str(path.parent / fallback_name(path.name)))
