"""Routed experts -> ``com.microsoft.MoE``: ONNX Runtime computes only the experts each token picked.

kiln exports a mixture-of-experts layer densely (``kiln.compiler.experts``): every expert's gate-up Linear,
SwiGLU and down Linear run over every token, each output is scaled by a routing tensor R (tokens, experts) that is
zero where the router did not pick the expert, and the E products are summed. That is E / k times the routed work
(2x for 4 experts, top 2; 16x for 128 experts, top 8). This pass folds one layer's E branches into one MoE node.

Recognised, per layer (kiln's own dense export; a family's router is whatever produced the TopK):

    R   = ReduceSum(Cast(Equal(Unsqueeze(TopK.indices), arange(E))) * Unsqueeze(weights), axis 1)   # (T, E)
    o_e = Linear_down(silu(g_e) * u_e) * Slice(R, e:e+1 on the last axis),  g_e, u_e = Split(Linear_up(x))
    out = an Add tree over o_0 .. o_{E-1}, each once

with every Linear a MatMul or Gemm over a constant FP32 weight without bias, all experts one shape, one ``x``.

Routing: when R's weights are the top-k of a softmax over the router's logits z, renormalised (the
common top-k softmax router with ``norm_topk_prob``), the MoE node routes from z itself (``normalize_routing_weights=1``) and R
is dropped. Any other routing stays the family's graph: the node gets log(R) as its router logits, so its softmax
over the experts is R / sum(R) and its top-k picks exactly R's non-zero entries (the rest are -inf); the output is
scaled back by sum(R). Sigmoid scores, a top-k left unnormalised, a routed scaling factor: the mixing weights are
R's whichever (the weights must be provably positive: softmax, sigmoid or exp through top-k, renormalisation and
positive constants). ONNX Runtime's CPU kernel takes SwiGLU with gate and up rows interleaved
(``swiglu_fusion=1``, alpha 1, beta 0: silu(gate) * up), so fc1 is (E, 2I, H) with row 2i the gate's i-th
output and row 2i + 1 the up's; fc2 is (E, H, I).

``quantize-nbits`` turns the node into ``QMoE`` (4- or 8-bit experts, GPTQ's codes where it has them). Measured
(ONNX Runtime 1.32, 2 cores AVX2; one layer of 64 experts, top 8, hidden 1024, expert width 384): the dense graph
17.4 ms per decode token, MoE 1.7 ms; 4-bit, dense MatMulNBits 3.99 ms, QMoE 0.41 ms (tools/bench_families.py
measures whole models).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph, attr

SWIGLU = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0, "activation_beta": 0.0}
"""silu(gate) * up with gate and up rows interleaved: the only SwiGLU layout ONNX Runtime's CPU MoE takes."""


@dataclass(frozen=True)
class Expert:
    up: onnx.NodeProto
    down: onnx.NodeProto
    gate_first: bool
    """The Split's first half is the gate (transformers' ``gate, up = gate_up.chunk(2, -1)``)."""
    nodes: tuple[onnx.NodeProto, ...]
    """Everything from the up projection to the routed product, the Slice of R included."""
    output: str


@dataclass(frozen=True)
class Layer:
    routing: str
    x: str
    k: int
    logits: str | None
    """The router's logits when R is softmax -> top-k -> renormalised: the MoE node then routes from them itself."""
    experts: tuple[Expert, ...]
    adds: tuple[onnx.NodeProto, ...]
    output: str


def interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(I, ...) gate rows and (I, ...) up rows -> (2I, ...) with row 2i = gate[i], row 2i + 1 = up[i]."""
    out = np.empty((2 * gate.shape[0], *gate.shape[1:]), gate.dtype)
    out[0::2], out[1::2] = gate, up
    return out


def deinterleave(rows: np.ndarray) -> np.ndarray:
    """The inverse of ``interleave``: (2I, ...) -> gate rows then up rows."""
    return np.concatenate([rows[0::2], rows[1::2]])


class FuseMixtureOfExperts(Pass):
    name = "fuse-moe"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"fused": 0, "experts": 0}
        skipped: list[Reason] = []
        for handle in g.nodes_of("ReduceSum"):
            rs = g.node(handle)
            if rs is None or not any(c.op_type == "Slice" for c in g.consumers.get(rs.output[0], [])):
                continue
            try:
                k, width, logits = self._routing(g, rs)
                layer = self._layer(g, rs.output[0], k, width, logits)
            except NoMatch as e:
                skipped.append(Reason(rs.name or handle, str(e)))
                continue
            self._rewrite(g, layer)  # each layer checked whole before its rewrite: a refused one stays as it was
            stats["fused"] += 1
            stats["experts"] += len(layer.experts)
        if stats["fused"]:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, bool(stats["fused"]), stats, skipped)

    # --- matching ------------------------------------------------------------------------
    def _routing(self, g: Graph, rs: onnx.NodeProto) -> tuple[int, int, str | None]:
        """Check that R is kiln's dense routing over one TopK; returns (k, E, the router's logits when the weights are
        its softmax's top-k renormalised, else None)."""
        axes = g.constant(rs.input[1]) if len(rs.input) > 1 and rs.input[1] else None
        if axes is None or list(np.atleast_1d(axes)) != [1] or attr(rs, "keepdims", 1) != 0:
            raise NoMatch("not a sum over the top-k axis (kiln's dense routing)")
        mul = g.parent(rs, 0, "Mul")
        if mul is None:
            raise NoMatch("the routing sum does not read a Mul of the picks and their weights")
        casts = [g.parent(mul, i, "Cast") for i in range(2)]
        if sum(c is not None for c in casts) != 1:
            raise NoMatch("the routing Mul has no one-hot (Cast of Equal) operand")
        eq = g.parent(next(c for c in casts if c is not None), 0, "Equal")
        unsq = g.parent(mul, casts.index(None), "Unsqueeze")
        if eq is None or unsq is None or not self._last_axis(g, unsq):
            raise NoMatch("the routing Mul is not one-hot(picks) * Unsqueeze(weights, -1)")
        if not self._positive(g, unsq.input[0]):
            raise NoMatch("the routing weights are not provably positive (softmax or sigmoid scores, top-k, "
                          "renormalised or scaled by a positive constant): log(R) needs them > 0")
        arange = next((g.constant(i) for i in eq.input if g.is_constant(i)), None)
        if arange is None or arange.ndim != 1 or not np.array_equal(arange, np.arange(arange.size)):
            raise NoMatch("the one-hot does not compare the picks with arange(experts)")
        idx = g.parent(eq, 0 if not g.is_constant(eq.input[0]) else 1, "Unsqueeze")
        picks = idx.input[0] if idx is not None and self._last_axis(g, idx) else ""
        topk = g.producer.get(picks)
        while topk is not None and topk.op_type == "Cast":
            picks = topk.input[0]
            topk = g.producer.get(picks)
        if topk is None or topk.op_type != "TopK" or picks != topk.output[1]:
            raise NoMatch("the picks are not a TopK's indices")
        k = g.constant(topk.input[1])
        k = int(np.atleast_1d(k)[0]) if k is not None else arange.size + 1
        if k > arange.size:
            raise NoMatch("the TopK's k is not a constant at most the number of experts")
        return k, int(arange.size), self._renormalised_softmax(g, unsq.input[0], topk)

    @staticmethod
    def _renormalised_softmax(g: Graph, weights: str, topk: onnx.NodeProto) -> str | None:
        """``weights = TopK(Softmax(z)).values / their sum`` (+ an epsilon of at most 1e-6), the largest along the
        experts' axis -> z, else None. ONNX Runtime's MoE with ``normalize_routing_weights`` computes exactly that
        from z (measured 2.3e-7 relative; its QMoE renormalises whatever the attribute says)."""
        div = g.producer.get(weights)
        if div is None or attr(topk, "largest", 1) != 1 or attr(topk, "axis", -1) not in (-1, 1):
            return None
        node = FuseMixtureOfExperts._own_sum(g, div, lambda eps: ((0 <= eps) & (eps <= 1e-6)).all())
        axes = g.constant(node.input[1]) if node is not None and len(node.input) > 1 and node.input[1] else None
        if node is None or div.input[0] != topk.output[0] or axes is None or \
                list(np.atleast_1d(axes)) not in ([-1], [1]) or attr(node, "keepdims", 1) != 1:
            return None
        soft = g.producer.get(topk.input[0])
        if soft is None or soft.op_type != "Softmax" or attr(soft, "axis", -1) not in (-1, 1):
            return None
        return soft.input[0]

    @staticmethod
    def _own_sum(g: Graph, div: onnx.NodeProto, eps_ok: Callable[[np.ndarray], bool]) -> onnx.NodeProto | None:
        """``div`` is ``x / ReduceSum(x)``, or ``x / (ReduceSum(x) + eps)`` with ``eps_ok(eps)``: the ReduceSum, else
        None (a renormalisation of x by its own sum)."""
        if div.op_type != "Div" or len(div.input) != 2:
            return None
        top, total = div.input
        node = g.producer.get(total)
        if node is not None and node.op_type == "Add":
            eps = next((i for i in node.input if g.is_constant(i)), None)
            if eps is None or not eps_ok(np.asarray(g.constant(eps))):
                return None
            node = g.producer.get(next(i for i in node.input if i != eps))
        return node if node is not None and node.op_type == "ReduceSum" and node.input[0] == top else None

    @staticmethod
    def _last_axis(g: Graph, unsq: onnx.NodeProto) -> bool:
        """An Unsqueeze of a (T, k) tensor at its new last axis (-1 or 2)."""
        axes = g.constant(unsq.input[1]) if len(unsq.input) > 1 and unsq.input[1] else attr(unsq, "axes")
        return axes is not None and list(np.atleast_1d(axes)) in ([-1], [2])

    @staticmethod
    def _positive(g: Graph, value: str, depth: int = 8) -> bool:
        """Whether ``value`` is > 0 by construction: a softmax / sigmoid / exp, through top-k values, casts, a
        renormalisation by its own sum (plus a positive epsilon) and products with positive constants."""
        for _ in range(depth):
            node = g.producer.get(value)
            if node is None:
                return False
            if node.op_type in ("Softmax", "Sigmoid", "Exp"):
                return True
            if node.op_type in ("Cast", "Identity", "TopK") and value == node.output[0]:
                value = node.input[0]
                continue
            if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
                return False
            a, b = node.input
            const = next((i for i in (a, b) if g.is_constant(i)), None)
            if const is not None:
                if not (np.asarray(g.constant(const)) > 0).all():
                    return False
                value = b if const == a else a
                continue
            if FuseMixtureOfExperts._own_sum(g, node, lambda eps: (eps > 0).all()) is None:
                return False
            value = a
        return False

    def _layer(self, g: Graph, routing: str, k: int, width: int, logits: str | None) -> Layer:
        slices = [c for c in g.consumers.get(routing, []) if c.op_type == "Slice"]
        experts: dict[int, Expert] = {}
        for s in slices:
            e = self._slice_index(g, s)
            if e in experts:
                raise NoMatch(f"expert {e}'s routing weight is read twice")
            experts[e] = self._expert(g, s, e)
        if sorted(experts) != list(range(width)):
            missing = sorted(set(range(width)) - set(experts))
            raise NoMatch(f"experts {missing[:4]} of {width} have no routed product")
        order = tuple(experts[e] for e in range(width))
        xs = {ex.up.input[0] for ex in order}
        if len(xs) != 1:
            raise NoMatch("the experts read different inputs")
        shapes = {(self._shape(g, ex.up), self._shape(g, ex.down)) for ex in order}
        if len(shapes) != 1:
            raise NoMatch("the experts' weights differ in shape")
        (n_up, h), (h_out, inner) = shapes.pop()
        if n_up != 2 * inner or h_out != h:
            raise NoMatch(f"gate-up {n_up}x{h} and down {h_out}x{inner} are not a SwiGLU expert")
        adds, out = self._sum(g, [ex.output for ex in order])
        return Layer(routing, xs.pop(), k, logits, order, adds, out)

    def _slice_index(self, g: Graph, s: onnx.NodeProto) -> int:
        """``Slice(R, e, e + 1)`` along R's last axis (axis 1 or -1), step 1 -> e."""
        vals = [g.constant(i) if i else None for i in list(s.input[1:]) + [""] * (4 - len(s.input[1:]))]
        starts, ends, axes, steps = vals[:4]
        if starts is None or ends is None or axes is None or list(np.atleast_1d(axes)) not in ([1], [-1]):
            raise NoMatch(f"{s.name}: the routing is not sliced along the experts' axis by constants")
        if steps is not None and list(np.atleast_1d(steps)) != [1]:
            raise NoMatch(f"{s.name}: the routing slice has a step")
        e = int(np.atleast_1d(starts)[0])
        if int(np.atleast_1d(ends)[0]) != e + 1:
            raise NoMatch(f"{s.name}: the routing slice is not one expert wide")
        return e

    def _expert(self, g: Graph, s: onnx.NodeProto, e: int) -> Expert:
        def one(value: str, op: str, what: str) -> onnx.NodeProto:
            node = g.only_consumer(value, op)
            if node is None:
                raise NoMatch(f"expert {e}: {what} is not read by one {op}")
            return node

        def made(value: str, ops: tuple[str, ...], what: str) -> onnx.NodeProto:
            node = g.producer.get(value)
            if node is None or node.op_type not in ops or len(g.consumers.get(value, [])) != 1 or \
                    value in g.graph_outputs:
                raise NoMatch(f"expert {e}: {what} is not a {'/'.join(ops)} read only there")
            return node

        routed = one(s.output[0], "Mul", "its routing weight")
        down = made(next(i for i in routed.input if i != s.output[0]), ("MatMul", "Gemm"), "the routed product's input")
        glu = made(down.input[0], ("Mul",), "the down projection's input")
        silu_at = [i for i, v in enumerate(glu.input) if self._silu_input(g, v) is not None]
        if len(silu_at) != 1:
            raise NoMatch(f"expert {e}: the down projection does not read silu(gate) * up")
        silu = g.producer[glu.input[silu_at[0]]]
        gate = self._silu_input(g, glu.input[silu_at[0]])
        up_half = glu.input[1 - silu_at[0]]
        split = g.producer.get(gate)
        if split is None or split.op_type != "Split" or list(split.output) not in ([gate, up_half], [up_half, gate]):
            raise NoMatch(f"expert {e}: gate and up are not the two halves of one Split")
        sizes = g.constant(split.input[1]) if len(split.input) > 1 and split.input[1] else None
        if attr(split, "axis", 0) not in (1, -1) or (sizes is not None and len(set(sizes.tolist())) != 1) or \
                (len(split.input) > 1 and split.input[1] and sizes is None):
            raise NoMatch(f"expert {e}: the gate-up Split is not into equal halves of the last axis")
        sig = g.parent(silu, [i for i, v in enumerate(silu.input) if v != gate][0], "Sigmoid")
        users = {n.output[0] for n in g.consumers.get(gate, [])}
        if users != {sig.output[0], silu.output[0]} or len(g.consumers.get(up_half, [])) != 1 or \
                len(g.consumers.get(silu.output[0], [])) != 1 or len(g.consumers.get(sig.output[0], [])) != 1:
            raise NoMatch(f"expert {e}: its gate or up half is read elsewhere")
        up = made(split.input[0], ("MatMul", "Gemm"), "the gate-up Split's input")
        for lin, role in ((up, "gate-up"), (down, "down")):
            self._weight_check(g, lin, f"expert {e}'s {role} projection")
        return Expert(up, down, list(split.output).index(gate) == 0, (s, routed, down, glu, silu, sig, split, up),
                      routed.output[0])

    @staticmethod
    def _silu_input(g: Graph, value: str) -> str | None:
        """``x * Sigmoid(x)`` (either order) -> x, else None."""
        node = g.producer.get(value)
        if node is None or node.op_type != "Mul":
            return None
        for i in range(2):
            sig = g.parent(node, i, "Sigmoid")
            if sig is not None and sig.input[0] == node.input[1 - i]:
                return sig.input[0]
        return None

    @staticmethod
    def _weight_check(g: Graph, lin: onnx.NodeProto, what: str) -> None:
        if not g.is_constant(lin.input[1]):
            raise NoMatch(f"{what} has no constant weight")
        if lin.op_type == "Gemm" and ((len(lin.input) > 2 and lin.input[2]) or attr(lin, "transA", 0) or
                                      attr(lin, "alpha", 1.0) != 1.0):
            raise NoMatch(f"{what} is a Gemm with a bias, a transposed input or a scale")

    @staticmethod
    def _shape(g: Graph, lin: onnx.NodeProto) -> tuple[int, int]:
        """(out, in) of a Linear's weight, without reading it when it is an initializer."""
        shape = g.shape_of_constant(lin.input[1]) or g.constant(lin.input[1]).shape
        if len(shape) != 2:
            raise NoMatch(f"{lin.name}: the weight is not a matrix")
        trans = lin.op_type == "Gemm" and attr(lin, "transB", 0)
        return (int(shape[0]), int(shape[1])) if trans else (int(shape[1]), int(shape[0]))

    @staticmethod
    def _rows(g: Graph, lin: onnx.NodeProto) -> np.ndarray:
        """A Linear's weight as (out, in) FP32 rows."""
        w = g.constant(lin.input[1])
        if w.dtype != np.float32:
            raise NoMatch(f"{lin.name}: the weight is {w.dtype}, not FP32")
        return w if lin.op_type == "Gemm" and attr(lin, "transB", 0) else w.T

    @staticmethod
    def _sum(g: Graph, terms: list[str]) -> tuple[tuple[onnx.NodeProto, ...], str]:
        """The Add tree summing ``terms`` each once (E - 1 binary Adds, every term and partial sum read once by
        the next Add), and its result."""
        values, adds = set(terms), {}
        grew = True
        while grew:
            grew = False
            for v in list(values):
                users = g.consumers.get(v, [])
                if len(users) == 1 and users[0].op_type == "Add" and users[0].output[0] not in adds and \
                        all(i in values for i in users[0].input):
                    adds[users[0].output[0]] = users[0]
                    values.add(users[0].output[0])
                    grew = True
        summed = {i for a in adds.values() for i in a.input}
        roots = [v for v in values if v not in summed]
        if len(adds) != len(terms) - 1 or len(roots) != 1 or \
                any(len(g.consumers.get(v, [])) != 1 or v in g.graph_outputs for v in summed):
            raise NoMatch("the experts' products are not summed by one Add tree of their own")
        return tuple(adds.values()), roots[0]

    # --- rewrite -------------------------------------------------------------------------
    def _rewrite(self, g: Graph, layer: Layer) -> None:
        fc1 = np.stack([self._fc1(g, ex) for ex in layer.experts])  # (E, 2I, H) interleaved
        fc2 = np.stack([self._rows(g, ex.down) for ex in layer.experts])  # (E, H, I)
        base = layer.output
        weights = [g.add_initializer(f"{base}_fc1", fc1), "", g.add_initializer(f"{base}_fc2", fc2)]
        if layer.logits is not None:  # the kernel's own softmax, top-k and renormalisation: R is left to prune
            new = [helper.make_node("MoE", [layer.x, layer.logits, *weights], [layer.output], name=g.fresh("MoE"),
                                    domain=MS_DOMAIN, k=layer.k, normalize_routing_weights=1, **SWIGLU)]
        else:
            logits, raw, scale = g.fresh(f"{base}_router_log"), g.fresh(f"{base}_moe"), g.fresh(f"{base}_routed_sum")
            axes = g.add_initializer(f"{base}_experts_axis", np.array([-1], np.int64))
            new = [helper.make_node("Log", [layer.routing], [logits], name=g.fresh("MoERouterLog")),
                   helper.make_node("MoE", [layer.x, logits, *weights], [raw], name=g.fresh("MoE"), domain=MS_DOMAIN,
                                    k=layer.k, normalize_routing_weights=0, **SWIGLU),
                   helper.make_node("ReduceSum", [layer.routing, axes], [scale], name=g.fresh("MoERoutedSum"),
                                    keepdims=1),
                   helper.make_node("Mul", [raw, scale], [layer.output], name=g.fresh("MoEScale"))]
        old = [n for ex in layer.experts for n in ex.nodes] + list(layer.adds)
        g.replace_nodes(old, new)

    def _fc1(self, g: Graph, ex: Expert) -> np.ndarray:
        rows = self._rows(g, ex.up)
        half = rows.shape[0] // 2
        gate, up = (rows[:half], rows[half:]) if ex.gate_first else (rows[half:], rows[:half])
        return interleave(gate, up)
