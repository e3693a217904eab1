"""Outlier channels in FP32, the rest in INT8 (LLM.int8()'s decomposition, with channels chosen at calibration).

A Transformer's activations have a handful of channels 6-15x larger than the median one (an
encoder's FFN inputs, post-GELU). One per-tensor activation scale then spends most of its 256 levels on
them and the other channels lose their resolution. For a MatMul ``y = x @ W`` whose input has
outlier channels ``o``:

    y = (x * keep) @ W_main + x[..., o] @ W[o, :]      keep: 1 except 0 at o;  W_main: W with rows o zeroed

The first product is the big one and is quantized (its input no longer holds the outliers); the
second has an inner dimension of a few channels and stays FP32. The ``Mul`` and ``Gather`` are
shared by every MatMul reading the same activation; the outlier product is added after the bias
Add, so the quantizer still folds the bias into its kernel. Channels count as outliers when their
calibrated absolute maximum exceeds ``ratio`` times the median channel's (at most ``max_channels``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph
from kiln.passes.quantize_qdq import calibrated_groups


def outlier_channels(channel_absmax: np.ndarray, ratio: float, max_channels: int) -> np.ndarray:
    """Indices of channels above ``ratio`` x the median absolute maximum, largest first, at most ``max_channels``."""
    med = float(np.median(channel_absmax))
    if med <= 0:
        return np.zeros(0, np.int64)
    idx = np.flatnonzero(channel_absmax > ratio * med)
    return idx[np.argsort(-channel_absmax[idx])][:max_channels].astype(np.int64)


class SplitOutlierChannels(Pass):
    name = "split-outliers"

    def __init__(self, channel_absmax: dict[str, np.ndarray], ratio: float = 6.0, max_channels: int = 8,
                 min_elements: int = 1024) -> None:
        self.channel_absmax = channel_absmax
        self.ratio = ratio
        self.max_channels = max_channels
        self.min_elements = min_elements

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"split": 0, "activations": 0, "channels": 0}
        skipped: list[Reason] = []
        new: list[onnx.NodeProto] = []
        for act, weights, amax in calibrated_groups(g, self.channel_absmax, self.min_elements, skipped):
            k = len(amax)
            idx = outlier_channels(amax, self.ratio, self.max_channels)
            if len(idx) == 0:
                skipped.append(Reason(act, f"no channel above {self.ratio} x the median calibrated maximum"))
                continue
            keep = np.ones(k, np.float32)
            keep[idx] = 0.0
            kept, picked = g.fresh(f"{act}_inliers"), g.fresh(f"{act}_outliers")
            new += [helper.make_node("Mul", [act, g.add_initializer(f"{act}_keep", keep)], [kept], name=g.fresh("OutlierMask")),
                    helper.make_node("Gather", [act, g.add_initializer(f"{act}_outlier_idx", idx)], [picked],
                                     name=g.fresh("OutlierGather"), axis=-1)]
            for weight in weights:
                mm = next(n for n in g.g.node if n.op_type == "MatMul" and n.input[1] == weight)
                w = g.constant(weight)
                main = w.copy()
                main[idx] = 0.0
                mm.input[0], mm.input[1] = kept, g.add_initializer(f"{weight}_inliers", main)
                tail = g.only_consumer(mm.output[0], "Add")
                if tail is None or not any(g.is_constant(i) for i in tail.input):
                    tail = mm  # no bias Add to keep next to the MatMul
                out = tail.output[0]
                tail.output[0] = g.fresh(f"{out}_inliers")
                side = g.fresh(f"{weight}_outlier_product")
                new += [helper.make_node("MatMul", [picked, g.add_initializer(f"{weight}_outlier_rows", w[idx])], [side],
                                         name=g.fresh("OutlierMatMul")),
                        helper.make_node("Add", [tail.output[0], side], [out], name=g.fresh("OutlierAdd"))]
                stats["split"] += 1
            stats["activations"] += 1
            stats["channels"] += len(idx)
            g.reindex()
        if new:
            g.g.node.extend(new)
            g.toposort()
            g.reindex()
            g.prune()
        return PassResult(g.model, stats["split"] > 0, stats, skipped)
