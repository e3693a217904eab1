"""Residual Add + LayerNormalization -> SkipLayerNormalization; bias Add + Gelu -> BiasGelu / FastGelu.

Both target ONNX Runtime's contrib ops (``com.microsoft``): one kernel instead of two or three,
and one pass over the activations instead of several.
"""

from __future__ import annotations

import onnx
from onnx import helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph, attr


def _shape(g: Graph, name: str) -> tuple | None:
    for vi in list(g.g.value_info) + list(g.g.input) + list(g.g.output):
        if vi.name == name and vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            return tuple(d.dim_param or d.dim_value or "?" for d in vi.type.tensor_type.shape.dim)
    return None


def _bias(g: Graph, add: onnx.NodeProto) -> tuple[str, str] | None:
    """(activation, bias) when ``add`` adds a 1-D constant to an activation."""
    for i in (0, 1):
        c = g.constant(add.input[1 - i])
        if c is not None and c.ndim == 1:
            return add.input[i], add.input[1 - i]
    return None


class FuseSkipLayerNorm(Pass):
    name = "fuse-skip-layernorm"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        fused, with_bias, skipped = 0, 0, []
        for handle in g.nodes_of("LayerNormalization"):
            ln = g.node(handle)
            where = ln.name or ln.output[0]
            add = g.parent(ln, 0, "Add")
            if add is None:
                skipped.append(Reason(where, "input is not a residual Add"))
                continue
            if attr(ln, "axis", -1) != -1 or len(ln.input) < 3:
                skipped.append(Reason(where, "normalises over an axis other than the last, or has no beta"))
                continue
            a, b = add.input
            if g.constant(a) is not None or g.constant(b) is not None:
                skipped.append(Reason(where, "Add has a constant operand (a bias, not a residual)"))
                continue
            sa, sb = _shape(g, a), _shape(g, b)
            if sa is None or sa != sb or len(sa) != 3:
                skipped.append(Reason(where, f"residual operands differ in shape ({sa} vs {sb}); SkipLayerNorm needs equal 3-D shapes"))
                continue
            remove = [add, ln]
            inputs = [a, b, ln.input[1], ln.input[2]]
            bias_add = g.parent(add, 0, "Add")
            split = _bias(g, bias_add) if bias_add is not None and g.only_consumer(bias_add.output[0]) else None
            if split is not None:
                inputs = [split[0], b, ln.input[1], ln.input[2], split[1]]
                remove.append(bias_add)
                with_bias += 1
            # The sum is also the next residual when the Add has other users: output 3 carries it.
            outputs = [ln.output[0], "", ""]
            if len(g.consumers[add.output[0]]) > 1 or add.output[0] in g.graph_outputs:
                outputs.append(add.output[0])
            node = helper.make_node("SkipLayerNormalization", inputs, outputs, name=g.fresh("SkipLayerNorm"),
                                    domain=MS_DOMAIN, epsilon=float(attr(ln, "epsilon", 1e-5)))
            g.replace_nodes(remove, [node])
            fused += 1
        if fused:
            g.ensure_opset(MS_DOMAIN, 1)
        return PassResult(g.model, fused > 0, {"fused": fused, "with_bias": with_bias}, skipped)


class FuseBiasGelu(Pass):
    name = "fuse-bias-gelu"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"bias_gelu": 0, "fast_gelu": 0}
        skipped = []
        for handle in g.nodes_of("Gelu"):
            gelu = g.node(handle)
            where = gelu.name or gelu.output[0]
            add = g.parent(gelu, 0, "Add")
            split = _bias(g, add) if add is not None else None
            if split is None or g.only_consumer(add.output[0]) is None:
                skipped.append(Reason(where, "input is not a bias Add used only by this Gelu"))
                continue
            tanh = attr(gelu, "approximate", b"none") in (b"tanh", "tanh")
            op = "FastGelu" if tanh else "BiasGelu"
            node = helper.make_node(op, list(split), [gelu.output[0]], name=g.fresh(op), domain=MS_DOMAIN)
            g.replace_nodes([add, gelu], [node])
            stats["fast_gelu" if tanh else "bias_gelu"] += 1
        if any(stats.values()):
            g.ensure_opset(MS_DOMAIN, 1)
        return PassResult(g.model, any(stats.values()), stats, skipped)
