"""Running intermediate graphs (calibration, the INT8 budget, ``kiln report``'s per-layer errors) in
ONNX Runtime, always from a file: a model handed over as serialized bytes cannot exceed protobuf's
2 GB limit, so graphs past that size keep their weights as external data beside the file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from kiln.passes import weights

EXTERNAL_ABOVE = 1 << 30
"""Graphs over this many bytes are written with their weights in a separate data file."""


def expose(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` with the given FP32 intermediate values added as graph outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    present = {o.name for o in out.graph.output}
    for name in names:
        if name not in present:
            out.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
            present.add(name)
    return out


def session(model: onnx.ModelProto, threads: int | None = None, external_above: int = EXTERNAL_ABOVE) -> Any:
    """An ONNX Runtime CPU session over ``model``, loaded from a temporary file (the caller's proto is not
    changed). The file is gone once the session holds the weights."""
    import onnxruntime as ort

    from kiln.runtimes import kernels

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or 0
    kernels.register(opts)  # a graph on kiln's kernel (ai.kiln.MatMulNBits)
    store = weights.current()
    if store is not None:  # a streamed graph: its weights are references into files beside it, so it runs from there
        fd, name = tempfile.mkstemp(prefix="kiln-run-", suffix=".onnx", dir=store.base_dir)
        os.close(fd)
        try:
            onnx.save_model(model, name)
            return ort.InferenceSession(name, opts, providers=["CPUExecutionProvider"])
        finally:
            os.unlink(name)
    with tempfile.TemporaryDirectory(prefix="kiln-graph-") as tmp:
        path = Path(tmp) / "model.onnx"
        if model.ByteSize() > external_above:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)  # saving with external data strips the weights out of the proto it is given
            onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location="model.onnx.data", size_threshold=1024)
        else:
            onnx.save_model(model, str(path))
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
