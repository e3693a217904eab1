"""LayerNormalization / RMSNormalization -> elementwise ops and ReduceMean, for ONNX Runtime CPU.

Why un-fuse: ONNX Runtime's CPU (Skip)LayerNormalization kernel runs at about 4 ns per element
on the reference machine (100 us for one 128x384 row block, 2 threads) while the same math as
ReduceMean/Sub/Mul/Sqrt/Reciprocal/Add runs 2.9x (batch 1) to 5x (batch 8) faster
(tools/bench_encoder.py, docs/passes.md). The square is a Mul, not a Pow, so ONNX Runtime's
LayerNormFusion does not put the slow kernel back. Numerics: the same two-pass FP32 formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph, attr


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


@dataclass
class _Run:
    """One run's settings and the constants it has made, kept off the pass object."""

    axes_input: bool
    rms_op: bool
    consts: dict[tuple[str, float], str] = field(default_factory=dict)  # one initializer per distinct constant


class DecomposeNorm(Pass):
    name = "decompose-norm"

    def __init__(self, ops: tuple[str, ...] = ("LayerNormalization",)) -> None:
        self.ops = ops

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        # LayerNorm through the RMSNorm kernel (standard from opset 23), unless RMSNorm itself is to be expanded
        run = _Run(axes_input=_opset(model) >= 18, rms_op=_opset(model) >= 23 and "RMSNormalization" not in self.ops)
        stats = {"layernorm": 0, "rmsnorm": 0}
        skipped = []
        # Handles first: the LayerNorm rewrite emits RMSNormalization nodes that are not to be expanded again.
        for op, handle in [(op, h) for op in self.ops for h in g.nodes_of(op)]:
            node = g.node(handle)
            where = node.name or handle
            if attr(node, "axis", -1) != -1:
                skipped.append(Reason(where, f"normalises from axis {attr(node, 'axis')}, only the last axis is decomposed"))
                continue
            if any(o for o in node.output[1:]):
                skipped.append(Reason(where, "mean/inv-std outputs are used (training graph)"))
                continue
            if attr(node, "stash_type", 1) != 1:
                skipped.append(Reason(where, "stash_type is not FP32"))
                continue
            new = self._expand(g, node, op == "RMSNormalization", run)
            g.replace_nodes([node], new)
            stats["rmsnorm" if op == "RMSNormalization" else "layernorm"] += 1
        return PassResult(g.model, any(stats.values()), stats, skipped)

    @staticmethod
    def _const(g: Graph, kind: str, value: np.ndarray, run: _Run) -> str:
        key = (kind, float(value.reshape(-1)[0]))
        if key not in run.consts:
            run.consts[key] = g.add_initializer(f"norm_{kind}", value)
        return run.consts[key]

    def _centred_rms(self, g: Graph, node: onnx.NodeProto, run: _Run) -> list[onnx.NodeProto]:
        """LayerNorm(x) = RMSNorm(x - mean(x)) + beta: ONNX Runtime's RMSNorm kernel is the fast one."""
        x, scale = node.input[0], node.input[1]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        axes = self._const(g, "axes", np.array([-1], dtype=np.int64), run)
        t = {k: g.fresh(f"{node.name or 'norm'}_{k}") for k in ("mu", "d", "n")}
        out = node.output[0]
        nodes = [helper.make_node("ReduceMean", [x, axes], [t["mu"]], keepdims=1),
                 helper.make_node("Sub", [x, t["mu"]], [t["d"]]),
                 helper.make_node("RMSNormalization", [t["d"], scale], [t["n"] if bias else out], axis=-1,
                                  epsilon=float(attr(node, "epsilon", 1e-5)))]
        if bias:
            nodes.append(helper.make_node("Add", [t["n"], bias], [out]))
        for i, n in enumerate(nodes):
            n.name = g.fresh(f"{node.name or 'norm'}_{i}")
        return nodes

    def _expand(self, g: Graph, node: onnx.NodeProto, rms: bool, run: _Run) -> list[onnx.NodeProto]:
        if not rms and run.rms_op:
            return self._centred_rms(g, node, run)
        x, scale = node.input[0], node.input[1]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        eps = self._const(g, "eps", np.array(attr(node, "epsilon", 1e-5), dtype=np.float32), run)
        axes = self._const(g, "axes", np.array([-1], dtype=np.int64), run) if run.axes_input else None
        t = {k: g.fresh(f"{node.name or 'norm'}_{k}") for k in ("mu", "d", "sq", "var", "ve", "sd", "inv", "n", "s")}

        def mean(src: str, dst: str) -> onnx.NodeProto:
            if axes is not None:
                return helper.make_node("ReduceMean", [src, axes], [dst], keepdims=1)
            return helper.make_node("ReduceMean", [src], [dst], axes=[-1], keepdims=1)

        nodes = []
        centred = x
        if not rms:
            nodes += [mean(x, t["mu"]), helper.make_node("Sub", [x, t["mu"]], [t["d"]])]
            centred = t["d"]
        out = node.output[0]
        nodes += [
            helper.make_node("Mul", [centred, centred], [t["sq"]]),
            mean(t["sq"], t["var"]),
            helper.make_node("Add", [t["var"], eps], [t["ve"]]),
            helper.make_node("Sqrt", [t["ve"]], [t["sd"]]),
            helper.make_node("Reciprocal", [t["sd"]], [t["inv"]]),
            helper.make_node("Mul", [centred, t["inv"]], [t["n"]]),
            helper.make_node("Mul", [t["n"], scale], [t["s"] if bias else out]),
        ]
        if bias:
            nodes.append(helper.make_node("Add", [t["s"], bias], [out]))
        for i, n in enumerate(nodes):
            n.name = g.fresh(f"{node.name or 'norm'}_{i}")
        return nodes
