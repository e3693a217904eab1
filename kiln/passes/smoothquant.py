"""SmoothQuant: move activation outliers into the weights before INT8 quantization.

A few channels of a Transformer's activations are 10-100x larger than the rest, so one per-tensor
activation scale wastes most of its levels on them. For ``y = x @ W`` the per-channel factor
``s_j = max|x_j|**alpha / max|W_j,:|**(1 - alpha)`` gives ``y = (x / s) @ (s * W)``: the same
product, with the outliers divided down in x and the weights (quantized per output column) taking
them on. ``alpha`` trades the two (0.5 is the paper's default; higher moves more into the weights).

Every weight MatMul reading the same activation is smoothed with one ``s`` (its weight maximum
taken over all of them). ``1 / s`` is folded into the norm that produces the activation when the
norm's scale (and bias) are constants and nothing else reads its output: a norm, or a norm followed
by its bias Add (kiln's decomposed LayerNorm); otherwise a ``Mul`` by ``1 / s`` is inserted.
Per-channel activation maxima come from calibration, handed to the pass.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph
from kiln.passes.quantize_qdq import calibrated_groups

# norm -> indices of its per-channel output scale and bias (SkipSimplified's input 3 is added before the norm)
NORMS = {"LayerNormalization": (1, 2), "SimplifiedLayerNormalization": (1,), "RMSNormalization": (1,),
         "SkipLayerNormalization": (2, 3), "SkipSimplifiedLayerNormalization": (2,)}


def smoothing_factors(act_absmax: np.ndarray, weight_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """Per input channel: max|x|**alpha / max|W row|**(1-alpha), with dead channels left alone (1)."""
    a = np.maximum(act_absmax.astype(np.float64), 1e-5)
    w = np.maximum(weight_absmax.astype(np.float64), 1e-5)
    s = a ** alpha / w ** (1.0 - alpha)
    s[(act_absmax == 0) | (weight_absmax == 0)] = 1.0
    return s.astype(np.float32)


class SmoothQuant(Pass):
    name = "smoothquant"

    def __init__(self, channel_absmax: dict[str, np.ndarray], alpha: float = 0.5, min_elements: int = 1024) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"SmoothQuant alpha {alpha} must be in [0, 1]")
        self.channel_absmax = channel_absmax
        self.alpha = alpha
        self.min_elements = min_elements

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"smoothed": 0, "folded": 0, "inserted_mul": 0}
        skipped: list[Reason] = []
        for act, weights, amax in calibrated_groups(g, self.channel_absmax, self.min_elements, skipped):
            ws = [g.constant(w) for w in weights]
            s = smoothing_factors(amax, np.max([np.abs(w).max(1) for w in ws], axis=0), self.alpha)
            for name, w in zip(weights, ws):
                g.initializers[name].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), name))
            readers = [n for n in g.consumers[act] if not (n.op_type == "MatMul" and n.input[1] in weights)]
            if not readers and act not in g.graph_outputs and self._fold(g, act, 1.0 / s):
                stats["folded"] += 1
            else:
                inv = g.add_initializer(f"{act}_smooth", (1.0 / s).astype(np.float32))
                out = g.fresh(f"{act}_smoothed")
                for n in g.g.node:
                    if n.op_type == "MatMul" and n.input[1] in weights:
                        n.input[0] = out
                g.g.node.append(helper.make_node("Mul", [act, inv], [out], name=g.fresh("SmoothQuantMul")))
                g.toposort()
                g.reindex()
                stats["inserted_mul"] += 1
            stats["smoothed"] += len(weights)
        return PassResult(g.model, stats["smoothed"] > 0, stats, skipped)

    @staticmethod
    def _fold(g: Graph, act: str, inv: np.ndarray) -> bool:
        """Multiply the constants of the norm (and its bias Add) that produce ``act`` by ``inv``."""
        scaled: list[str] = []
        node = g.node(act)
        if node is not None and node.op_type == "Reshape" and len(g.consumers[node.input[0]]) == 1 \
                and node.input[0] not in g.graph_outputs:
            act = node.input[0]  # a Gemm-exported Linear flattens (B, S, C) to (B*S, C) first: channels stay last
            node = g.node(act)
        if node is not None and node.op_type == "Add" and node.output[0] == act:
            bias = next((i for i in node.input if g.is_constant(i)), None)
            other = next((i for i in node.input if i != bias), None)
            norm = g.node(other) if other else None
            if bias is None or norm is None or norm.op_type not in NORMS or norm.output[0] != other \
                    or len(g.consumers[other]) != 1:
                return False
            scaled, node = [bias], norm
        elif node is None or node.op_type not in NORMS or node.output[0] != act:
            return False
        params = [node.input[i] for i in NORMS[node.op_type] if i < len(node.input)]
        params = [p for p in params if p]
        if not params or not all(g.is_constant(p) for p in params):
            return False
        for name in scaled + params:
            value = g.constant(name)
            if value.shape[-1:] != inv.shape:
                return False
        for name in scaled + params:
            fresh = g.add_initializer(f"{name}_smooth", (g.constant(name) * inv).astype(np.float32))
            for n in (node, g.node(act)):
                for i, inp in enumerate(n.input):
                    if inp == name:
                        n.input[i] = fresh
        g.reindex()
        return True
