"""Trace a model whose weights are not in memory: the empty shell (``lazy.build_shell``) is exported on the
meta device, every initializer becomes a lazy tensor that reads its checkpoint tensor when written, and the
graph is saved with all weights as external data, streamed one tensor at a time.

torch.onnx exports ``nn.Linear`` as ``MatMul(x, Transpose(W))`` and its optimizer folds that Transpose into a
transposed copy of W held in memory; here the fold is done first, lazily (the transpose happens when the tensor
is written), so the optimizer then only sees constants too large to fold and leaves them alone.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.compiler import capture
from kiln.compiler.lazy import LazyWeights, parameter_keys
from kiln.compiler.load import Checkpoint
from kiln.compiler.scoped import logger_level
from kiln.errors import ExportError, UnsupportedModelError

log = logging.getLogger(__name__)

WRAPPER = "model."
"""The traced wrapper (``trace.DecoderGraph``) holds the model as ``self.model``: initializer names carry it."""


def _lazy(weights: LazyWeights, key: str, shape: tuple[int, ...], transpose: bool) -> Any:
    import onnx_ir as ir

    def load() -> Any:
        return ir.tensor(weights.torch(key, transpose).numpy())  # the writer drops it once written

    return ir.LazyTensor(load, dtype=ir.DataType.FLOAT, shape=ir.Shape(shape[::-1] if transpose else shape))


def attach_weights(model: Any, ckpt: Checkpoint) -> dict[str, int]:
    """Give every initializer of the meta-traced graph its value: checkpoint tensors lazily (single-consumer
    2-D Transposes folded into them), computed buffers as they are. Returns counts for the record."""
    import onnx_ir as ir

    weights: LazyWeights = ckpt.weights
    keys = parameter_keys(ckpt.model, weights)
    stats = {"lazy": 0, "transposed": 0, "buffers": 0}
    for name, value in list(model.graph.initializers.items()):
        inner = name[len(WRAPPER):] if name.startswith(WRAPPER) else name
        if inner in keys:
            shape = tuple(int(d) for d in value.shape)
            users = list(value.uses())
            node = users[0].node if len(users) == 1 else None
            perm = node.attributes.get("perm") if node is not None and node.op_type == "Transpose" else None
            if node is not None and node.domain == "" and perm is not None and list(perm.as_ints()) == [1, 0]:
                out = node.outputs[0]
                folded = ir.Value(name=out.name, shape=ir.Shape(shape[::-1]), type=value.type,
                                  const_value=_lazy(weights, keys[inner], shape, True))
                model.graph.remove(node, safe=False)
                out.replace_all_uses_with(folded)
                model.graph.initializers.pop(name)
                model.graph.register_initializer(folded)
                stats["transposed"] += 1
            else:
                value.const_value = _lazy(weights, keys[inner], shape, False)
            stats["lazy"] += 1
        elif inner in ckpt.buffers:
            value.const_value = ir.tensor(ckpt.buffers[inner].numpy())
            stats["buffers"] += 1
        else:
            raise ExportError(f"the graph traced from {ckpt.path} has a constant {name} that is neither a checkpoint "
                              "tensor nor a computed buffer; report it with the checkpoint's config.json")
    return stats


def fake_parameters(shell: Any) -> None:
    """Every parameter becomes a fake CPU tensor (shape and dtype, no storage); tied ones stay one object.

    Not the meta device: torch.export decomposes ops by the device's kernels, and meta's attention output layout
    traces to Reshape-then-Transpose where the CPU's traces to Transpose-then-Reshape, which is what the fusion
    rules (and the in-memory path) see."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.nn.Parameter] = {}
    for module in shell.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                with mode:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="cpu"),
                                                     requires_grad=False)
            module._parameters[name] = made[id(p)]


def export(ckpt: Checkpoint, path: Path, opset: int, say: Callable[[str], None]) -> capture.Log:
    """Trace ``ckpt.model`` (the empty shell) to ``path``, its weights streamed into ``path.data``, attention captured
    (``kiln.compiler.capture``); returns what the capture saw."""
    import onnx_ir as ir
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions

    from kiln.compiler import trace

    fake_parameters(ckpt.model)
    module = trace.graph_module(ckpt)
    inputs, outputs = trace.io_specs(ckpt)
    example = tuple(torch.randint(0, 2, (2, 8), dtype=torch.long) for _ in inputs)
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("sequence", min=1, max=max(ckpt.max_length, 9))
    dynamic = {s.name: {0: batch, 1: seq} for s in inputs}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.no_grad(), logger_level("torch.onnx", logging.ERROR):
            warnings.simplefilter("ignore")
            program, log = capture.export(
                module, example, dynamic_shapes=dynamic, input_names=[s.name for s in inputs],
                output_names=[s.name for s in outputs], source=f"{ckpt.path} ({ckpt.architecture})",
                opset_version=opset, optimize=False, verbose=False)
        model = program.model
        attach_weights(model, ckpt)
        onnxscript.optimizer.optimize_ir(model)
        onnxscript.rewriter.onnx_fusions.fuse(model)
    except ExportError:
        raise
    except UnsupportedModelError:
        raise
    except Exception as e:  # the exporter raises many unrelated types; keep the first line for the user
        first = capture.failure(e)
        raise ExportError(f"torch.onnx.export failed for {ckpt.path} ({ckpt.architecture}): {first}; "
                          "report it with the checkpoint's config.json") from e
    say(f"traced without weights in {time.perf_counter() - start:.1f} s; writing {len(model.graph.initializers)} "
        "tensors as external data, one at a time")
    written = {"n": 0, "bytes": 0}
    total = len(model.graph.initializers)
    t0 = time.perf_counter()

    def progress(tensor: Any, info: Any) -> None:
        written["n"] += 1
        written["bytes"] += int(tensor.nbytes)
        if written["n"] % 50 == 0 or written["n"] == total:
            elapsed = time.perf_counter() - t0
            say(f"weights {written['n']}/{total} ({written['bytes'] / 2**30:.2f} GiB) {elapsed:.0f} s elapsed, "
                f"~{elapsed / written['n'] * (total - written['n']):.0f} s left")

    ir.save(model, str(path), external_data=path.name + ".data", size_threshold_bytes=1024, max_workers=1,
            callback=progress)
    return log
