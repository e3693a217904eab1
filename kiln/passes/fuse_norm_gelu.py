"""Residual Add + LayerNormalization -> SkipLayerNormalization; bias Add + Gelu -> BiasGelu / FastGelu.

Both target ONNX Runtime's contrib ops (``com.microsoft``): one kernel instead of two or three,
and one pass over the activations instead of several.

onnxscript's ``ort_fusions`` has skip-layernorm and bias-gelu rules that do fire on the opset-23 export
(on an encoder: 4 and 2); kiln keeps its own because it needs what they lack: RMSNorm-only
fusion on CPU decoders (ORT's LayerNorm kernel is slow, see decompose_norm.py), a written-out tanh
gelu, and a reason for every refused candidate.
"""

from __future__ import annotations

import onnx
from onnx import helper

from kiln.passes.base import NoMatch, Pass, PassResult, Reason
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


_SKIP_OPS = {"LayerNormalization": "SkipLayerNormalization", "RMSNormalization": "SkipSimplifiedLayerNormalization"}


class FuseSkipLayerNorm(Pass):
    """Residual Add (+ bias) + LayerNorm/RMSNorm -> Skip(Simplified)LayerNormalization.

    ``norms`` picks which norms to fuse: ONNX Runtime's CPU RMSNorm kernel is fast and its LayerNorm
    kernel slow (see decompose_norm.py), so the CPU decoder pipeline fuses RMSNorm only."""

    name = "fuse-skip-layernorm"

    def __init__(self, norms: tuple[str, ...] = ("LayerNormalization", "RMSNormalization")) -> None:
        self.norms = norms

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        fused, with_bias, skipped = 0, 0, []
        for op in self.norms:
            for handle in g.nodes_of(op):
                ln = g.node(handle)
                try:
                    biased = self._fuse(g, ln, op)
                except NoMatch as e:
                    skipped.append(Reason(ln.name or ln.output[0], str(e)))
                    continue
                fused += 1
                with_bias += int(biased)
        if fused:
            g.ensure_opset(MS_DOMAIN, 1)
        return PassResult(g.model, fused > 0, {"fused": fused, "with_bias": with_bias}, skipped)

    def _fuse(self, g: Graph, ln: onnx.NodeProto, op: str) -> bool:
        """Rewrite one norm (NoMatch with the reason when it cannot be); True when a bias Add was folded in."""
        add = g.parent(ln, 0, "Add")
        if add is None:
            raise NoMatch("input is not a residual Add")
        rms = op == "RMSNormalization"
        if attr(ln, "axis", -1) != -1 or (not rms and len(ln.input) < 3):
            raise NoMatch("normalises over an axis other than the last, or has no beta")
        if any(o for o in ln.output[1:]):
            raise NoMatch("mean/inv-std outputs are used")
        a, b = add.input
        if g.is_constant(a) or g.is_constant(b):
            raise NoMatch("Add has a constant operand (a bias, not a residual)")
        sa, sb = _shape(g, a), _shape(g, b)
        if sa is None or sa != sb or len(sa) != 3:
            raise NoMatch(f"residual operands differ in shape ({sa} vs {sb}); the fused op needs equal 3-D shapes")
        remove = [add, ln]
        norm_params = [ln.input[1]] if rms else [ln.input[1], ln.input[2]]
        inputs = [a, b, *norm_params]
        bias_add = g.parent(add, 0, "Add")
        split = _bias(g, bias_add) if bias_add is not None and g.only_consumer(bias_add.output[0]) else None
        if split is not None:
            inputs = [split[0], b, *norm_params, split[1]]
            remove.append(bias_add)
        # The sum is also the next residual when the Add has other users: output 3 carries it.
        outputs = [ln.output[0], "", ""]
        if len(g.consumers[add.output[0]]) > 1 or add.output[0] in g.graph_outputs:
            outputs.append(add.output[0])
        node = helper.make_node(_SKIP_OPS[op], inputs, outputs, name=g.fresh(_SKIP_OPS[op]),
                                domain=MS_DOMAIN, epsilon=float(attr(ln, "epsilon", 1e-5)))
        g.replace_nodes(remove, [node])
        return split is not None


def _scalar(g: Graph, node: onnx.NodeProto, value: float) -> str | None:
    """The non-constant operand of a binary ``node`` whose other operand is the scalar ``value``."""
    for i in (0, 1):
        c = g.constant(node.input[i])
        if c is not None and c.size == 1 and abs(float(c.reshape(())) - value) <= 1e-4 * max(1.0, abs(value)):
            return node.input[1 - i]
    return None


def match_tanh_gelu(g: Graph, tanh: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]]:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) written out (``gelu_new``) -> (x, its nodes)."""
    scaled = g.parent(tanh, 0, "Mul")
    inner = g.producer.get(_scalar(g, scaled, 0.7978845608) or "") if scaled is not None else None
    if inner is None or inner.op_type != "Add":
        raise NoMatch("tanh input is not sqrt(2/pi) * (x + 0.044715 x^3)")
    cube_mul = next((g.producer.get(i) for i in inner.input if g.producer.get(i) is not None
                     and g.producer[i].op_type == "Mul" and _scalar(g, g.producer[i], 0.044715)), None)
    if cube_mul is None:
        raise NoMatch("no 0.044715 x^3 term")
    pow_ = g.producer.get(_scalar(g, cube_mul, 0.044715))
    if pow_ is None or pow_.op_type != "Pow" or _scalar(g, pow_, 3.0) != pow_.input[0]:
        raise NoMatch("cubic term is not Pow(x, 3)")
    x = pow_.input[0]
    if x not in inner.input:
        raise NoMatch("inner sum does not add x")
    one = g.only_consumer(tanh.output[0], "Add")
    outer = g.only_consumer(one.output[0], "Mul") if one is not None and _scalar(g, one, 1.0) else None
    half = next((g.producer.get(i) for i in outer.input if i != one.output[0]), None) if outer is not None else None
    if half is None or half.op_type != "Mul" or _scalar(g, half, 0.5) != x:
        raise NoMatch("output is not 0.5 x (1 + tanh(...))")
    nodes = [pow_, cube_mul, inner, scaled, tanh, one, half, outer]
    for n in nodes[:-1]:
        if any(c not in nodes for c in g.consumers[n.output[0]]) or n.output[0] in g.graph_outputs:
            raise NoMatch(f"{n.output[0]} is used outside the gelu")
    return x, nodes


class FuseBiasGelu(Pass):
    """bias Add + Gelu -> BiasGelu / FastGelu; the written-out tanh gelu chain -> FastGelu."""

    name = "fuse-bias-gelu"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"bias_gelu": 0, "fast_gelu": 0, "tanh_chain": 0}
        skipped = []
        for handle in g.nodes_of("Tanh"):
            tanh = g.node(handle)
            try:
                x, nodes = match_tanh_gelu(g, tanh)
            except NoMatch as e:
                skipped.append(Reason(tanh.name or handle, str(e)))
                continue
            inputs = [x]
            add = g.producer.get(x)
            split = _bias(g, add) if add is not None and add.op_type == "Add" else None
            if split is not None and all(c in nodes for c in g.consumers[x]):
                inputs, nodes = list(split), nodes + [add]
            g.replace_nodes(nodes, [helper.make_node("FastGelu", inputs, [nodes[7].output[0]], name=g.fresh("FastGelu"),
                                                     domain=MS_DOMAIN)])
            stats["tanh_chain"] += 1
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
