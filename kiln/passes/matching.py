"""Matching helpers the attention lowerings share, each returning a typed record or raising ``NoMatch`` with the
reason: projections (MatMul + bias), head splits, the way Q, K or V reaches a captured attention node (``Operand``),
the rotary embedding both Q and K get (``Rotary``), packed projections (``Packing``).

What these recognise is layout, not families: a tensor viewed as heads and transposed, a rotary embedding whose
angles are positions times a constant, one projection cut in three. Where one does not apply, the lowering takes
the general route (a Transpose, the rotary left in the graph) instead of refusing the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.attention_node import Captured
from kiln.passes.base import NoMatch
from kiln.passes.graph import Constants, Graph, attr, emit

HEAD_NORMS = {"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization"}
INT64_MAX = (1 << 63) - 1
NEG = float(np.finfo(np.float32).min)


@dataclass
class Projection:
    nodes: list[onnx.NodeProto]
    x: str
    weight: np.ndarray
    bias: np.ndarray | None


def transpose_perm(node: onnx.NodeProto | None) -> list[int] | None:
    return list(attr(node, "perm", [])) if node is not None and node.op_type == "Transpose" else None


def match_head_split(g: Graph, value: str, transpose_k: bool = False) -> tuple[str, list[onnx.NodeProto]]:
    """value = Transpose(Reshape(x3d), perm (0,2,1,3)) -> (x3d, [reshape, transpose])."""
    tr = g.producer.get(value)
    want = [0, 2, 3, 1] if transpose_k else [0, 2, 1, 3]
    if transpose_perm(tr) != want:
        raise NoMatch(f"head split of {value} is not a Transpose {want}")
    rs = g.parent(tr, 0, "Reshape")
    if rs is None:
        raise NoMatch(f"head split of {value} has no Reshape")
    return rs.input[0], [rs, tr]


def match_linear(g: Graph, value: str) -> Projection:
    """value = MatMul(x, W) [+ b] with constant W (2-D) and b (1-D) -> Projection."""
    add = g.producer.get(value)
    add = add if add is not None and add.op_type == "Add" else None
    mm = g.parent(add, 0, "MatMul") if add is not None else g.producer.get(value)
    bias = None
    if add is not None:
        if mm is None:
            mm = g.parent(add, 1, "MatMul")
            bias = g.constant(add.input[0])
        else:
            bias = g.constant(add.input[1])
        if mm is None or bias is None or bias.ndim != 1:
            raise NoMatch(f"projection {value} is not MatMul + 1-D bias")
    if mm is None or mm.op_type != "MatMul":
        raise NoMatch(f"projection {value} is not a MatMul")
    w = g.constant(mm.input[1])
    if w is None or w.ndim != 2:
        raise NoMatch(f"projection weight {mm.input[1]} is not a constant matrix")
    return Projection([n for n in (mm, add) if n is not None], mm.input[0], w, bias)


def sole_users(g: Graph, nodes: list[onnx.NodeProto]) -> None:
    """Every node but the last feeds only the next: fusing them must not duplicate work."""
    for n in nodes[:-1]:
        if len(g.consumers[n.output[0]]) != 1 or n.output[0] in g.graph_outputs:
            raise NoMatch(f"{n.output[0]} has other users; fusing would duplicate it")


def private(g: Graph, nodes: list[onnx.NodeProto], reader: onnx.NodeProto) -> bool:
    """Whether every output of ``nodes`` is read only by ``nodes`` and ``reader`` (so all of them can go)."""
    ids = {id(n) for n in nodes} | {id(reader)}
    return all(o not in g.graph_outputs and all(id(c) in ids for c in g.consumers.get(o, []))
               for n in nodes for o in n.output if o)


def constant_cut(g: Graph, sl: onnx.NodeProto, axes: tuple[int, ...], what: str) -> tuple[int, int]:
    """Slice ``sl``'s constant (start, end) on one of ``axes`` with step 1; NoMatch naming ``what`` otherwise."""
    starts, ends, axis, steps = (g.constant(sl.input[i]) if len(sl.input) > i and sl.input[i] else None
                                 for i in (1, 2, 3, 4))
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        raise NoMatch(f"Slice {sl.name} of {what} has no constant bounds")
    if axis is None or axis.size != 1 or int(axis.reshape(-1)[0]) not in axes or \
            (steps is not None and steps.reshape(-1).tolist() != [1]):
        raise NoMatch(f"Slice {sl.name} does not cut {what}'s last axis with step 1")
    return int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


# --- how Q, K or V reaches a captured node ------------------------------------------------------------------------
@dataclass
class Rope:
    """A rotary embedding on one of Q / K: the RotaryEmbedding node, the features it rotates (None: its own
    ``rotary_embedding_dim`` or the whole head) and the nodes a partial rotary adds (Slices, Concat)."""

    node: onnx.NodeProto
    dim: int | None
    nodes: list[onnx.NodeProto]


@dataclass
class Operand:
    """Q, K or V of one attention, traced back from the node's (B, H, S, D) input.

    ``value`` is what the kernel's (B, S, H x D) input is made from: with ``layout`` "flat" it already is that
    (a projection's output), "bshd" is (B, S, H, D) (one Reshape flattens it), "bhsd" is (B, H, S, D) (a Transpose
    first). ``norms`` are per-head norms met on the way, re-applied on a (B, S, H, D) view; ``nodes`` go with the
    fusion; ``rope`` is the rotary found at the top (None when there is none or it stays in the graph)."""

    value: str
    layout: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    norms: list[onnx.NodeProto] = field(default_factory=list)
    rope: Rope | None = None
    split: onnx.NodeProto | None = None
    """The head split's Reshape when ``layout`` is "flat" (its target names the head count)."""


def _head_norms(g: Graph, value: str) -> tuple[str, list[onnx.NodeProto]]:
    """Norms over the last axis (each head's features) ending at ``value``: (their input, the norms, input first)."""
    norms: list[onnx.NodeProto] = []
    while (p := g.producer.get(value)) is not None and p.op_type in HEAD_NORMS and attr(p, "axis", -1) in (-1, 3) \
            and sum(1 for o in p.output if o) == 1:
        norms.insert(0, p)
        value = p.input[0]
    return value, norms


def _partial_rotary(g: Graph, cat: onnx.NodeProto) -> tuple[str, Rope] | None:
    """Concat(RotaryEmbedding(x[..., :d]), x[..., d:]) on the heads' last axis -> (x, Rope); None otherwise."""
    parts = [g.producer.get(i) for i in cat.input]
    if len(parts) != 2 or attr(cat, "axis", 0) not in (-1, 3) or parts[0] is None or parts[1] is None or \
            parts[0].op_type != "RotaryEmbedding" or parts[1].op_type != "Slice":
        return None
    rope, rest = parts
    first = g.producer.get(rope.input[0])
    if first is None or first.op_type != "Slice" or first.input[0] != rest.input[0]:
        return None
    try:
        (a0, a1), (b0, b1) = (constant_cut(g, sl, (-1, 3), "partial rotary") for sl in (first, rest))
    except NoMatch:
        return None
    if a0 != 0 or a1 <= 0 or b0 != a1 or b1 < (1 << 31) or attr(rope, "rotary_embedding_dim", 0) not in (0, a1):
        return None
    return first.input[0], Rope(rope, a1, [first, rope, rest, cat])


def operand(g: Graph, value: str, reader: onnx.NodeProto, rotary: bool) -> Operand:
    """Walk back from a captured node's Q / K / V input through [rotary] [head norms] Transpose(0,2,1,3)
    [head norms] Reshape, as far as the nodes on the way serve only this input; never raises."""
    chain: list[onnx.NodeProto] = []  # nodes from `value` back, input last
    rope = None
    cur = g.producer.get(value)
    if rotary and cur is not None:
        found = _partial_rotary(g, cur) if cur.op_type == "Concat" else None
        if found is not None and private(g, found[1].nodes, reader):
            value, rope = found
        elif cur.op_type == "RotaryEmbedding" and not (len(cur.input) > 3 and cur.input[3]) \
                and private(g, [cur], reader):
            value, rope = cur.input[0], Rope(cur, None, [cur])
    taken = rope.nodes if rope else []
    inner, after = _head_norms(g, value)
    tr = g.producer.get(inner)
    if transpose_perm(tr) != [0, 2, 1, 3] or not private(g, taken + after + [tr], reader):
        return Operand(value, "bhsd", taken, [], rope)
    x4, before = _head_norms(g, tr.input[0])
    rs = g.producer.get(x4)
    chain = taken + after + [tr] + before
    target = g.constant(rs.input[1]) if rs is not None and rs.op_type == "Reshape" else None
    flat = rs is not None and rs.op_type == "Reshape" and private(g, chain + [rs], reader) and \
        (target is None or target.size == 4) and g.rank(rs.input[0]) == 3
    if flat:
        return Operand(rs.input[0], "flat", chain + [rs], before + after, rope, rs)
    if not private(g, chain, reader):
        return Operand(value, "bhsd", taken, [], rope)
    return Operand(x4, "bshd", chain, before + after, rope)


@dataclass
class Rotary:
    """The rotary both Q and K get, foldable into a kernel: angles = positions x ``inv_freq``, cos / sin scaled by
    ``scale``, over the first ``dim`` features of each head."""

    inv_freq: np.ndarray
    scale: float
    interleaved: int
    dim: int


def rotary(g: Graph, q: Rope | None, k: Rope | None, head_size: int, positions_from: set[str]) -> Rotary | None:
    """The shared rotary of Q and K (None when neither is rotated); NoMatch when it cannot be folded."""
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise NoMatch("rotary is applied to only one of Q and K")
    dims = {r.dim if r.dim is not None else int(attr(r.node, "rotary_embedding_dim", 0)) or head_size for r in (q, k)}
    if len(dims) != 1:
        raise NoMatch(f"Q and K rotate different numbers of features {sorted(dims)}")
    dim = dims.pop()
    if dim > head_size or dim % 16:
        raise NoMatch(f"rotary over {dim} of {head_size} features: GroupQueryAttention rotates a multiple of 16")
    if attr(q.node, "interleaved", 0) != attr(k.node, "interleaved", 0):
        raise NoMatch("Q and K use different rotary layouts")
    tables = []
    for i, fn in ((1, "Cos"), (2, "Sin")):
        angles, scale = set(), set()
        for r in (q, k):
            p = g.producer.get(r.node.input[i])
            if p is not None and p.op_type == "Expand":  # tables broadcast to the batch (broadcast-rotary)
                p = g.producer.get(p.input[0])
            factor = 1.0
            if p is not None and p.op_type == "Mul":  # an attention scaling (scaled rotary variants) multiplies cos and sin
                c = g.constant(p.input[1])
                if c is None or c.size != 1:
                    raise NoMatch(f"rotary {fn.lower()} table is scaled by a non-constant")
                factor = float(c.reshape(()))
                p = g.producer.get(p.input[0])
            if p is None or p.op_type != fn:
                raise NoMatch(f"rotary {fn.lower()} input is not {fn}(positions x inv_freq)")
            angles.add(p.input[0])
            scale.add(factor)
        if len(angles) != 1 or len(scale) != 1:
            raise NoMatch("Q and K rotate by different angle tables")
        tables.append((angles.pop(), scale.pop()))
    if tables[0][0] != tables[1][0]:
        raise NoMatch("cos and sin come from different angle tables")
    mul = g.producer.get(tables[0][0])
    inv_freq, positions = None, ""
    if mul is not None and mul.op_type == "Mul":
        for i in (0, 1):
            c = g.constant(mul.input[i])
            if c is not None and c.size == dim // 2:
                inv_freq, positions = c.reshape(-1).astype(np.float64), mul.input[1 - i]
    if inv_freq is None:
        raise NoMatch(f"rotary angles are not positions x a constant inv_freq of {dim // 2} values")
    if not g.ancestors_inputs(positions) or g.ancestors_inputs(positions) - positions_from:
        raise NoMatch(f"rotary positions do not come from {' / '.join(sorted(positions_from))} alone")
    return Rotary(inv_freq, tables[0][1], int(attr(q.node, "interleaved", 0)), dim)


# --- one packed Q/K/V input --------------------------------------------------------------------------------------
@dataclass
class Packing:
    """How Q, K, V can reach a kernel as one (B, S, (Hq + 2 Hkv) D) tensor: "split" (the model's own packed
    tensor, cut by a Split), "slices" (cut by three Slices), "projections" (three MatMuls to concatenate) or
    "heads" (one projection holding each head's Q, K and V side by side, regrouped by one Transpose)."""

    kind: str
    source: str = ""
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    projections: tuple[Projection, ...] = ()
    heads: int = 0
    head_size: int = 0


def width(g: Graph, value: str) -> int | None:
    p = g.producer.get(value)
    if p is not None and p.op_type == "Reshape":
        shape = g.constant(p.input[1])
        if shape is not None and shape.size == 3 and shape[2] > 0:
            return int(shape[2])
        p = g.producer.get(p.input[0])
    if p is not None and p.op_type in ("Gemm", "MatMul"):
        dims = g.shape_of_constant(p.input[1])
        if dims is None and (w := g.constant(p.input[1])) is not None:
            dims = w.shape
        if dims is not None and len(dims) == 2:
            return int(dims[0] if attr(p, "transB", 0) else dims[1])
    return None


def packing(g: Graph, q3: str, k3: str, v3: str, hq: int, hk: int, head_size: int) -> Packing:
    """How flat Q, K, V (each read only by its own path) pack into one input; NoMatch when they do not."""
    p = g.producer.get(q3)
    if p is not None and p.op_type == "Split" and list(p.output) == [q3, k3, v3]:
        sizes = g.constant(p.input[1]) if len(p.input) > 1 and p.input[1] else None
        if attr(p, "axis", 0) not in (-1, 2):
            raise NoMatch("packed QKV is split on an axis other than the last")
        want = [hq * head_size, hk * head_size, hk * head_size]
        if (sizes.reshape(-1).tolist() if sizes is not None else None) not in (want, None) or \
                (sizes is None and width(g, p.input[0]) != sum(want)):
            raise NoMatch(f"packed QKV split does not cut {want}")
        return Packing("split", p.input[0], [p])
    nodes = [g.producer.get(x) for x in (q3, k3, v3)]
    if all(n is not None and n.op_type == "Slice" for n in nodes):
        source = nodes[0].input[0]
        total = width(g, source)
        if any(n.input[0] != source for n in nodes) or total is None:
            raise NoMatch("Q, K and V are slices of different tensors, or of one of unknown width")
        bounds = []
        for n in nodes:
            cut = constant_cut(g, n, (-1, 2), "the packed QKV tensor")
            bounds.append(tuple(v + total if v < 0 else min(v, total) for v in cut))
        q_w, kv_w = hq * head_size, hk * head_size
        if bounds != [(0, q_w), (q_w, q_w + kv_w), (q_w + kv_w, q_w + 2 * kv_w)] or q_w + 2 * kv_w != total:
            raise NoMatch(f"packed QKV slices {bounds} of width {total} are not Q, K, V back to back")
        return Packing("slices", source, nodes)
    projections = tuple(match_linear(g, x) for x in (q3, k3, v3))
    if len({p.x for p in projections}) != 1:
        raise NoMatch("Q, K and V project different inputs")
    for p in projections:
        sole_users(g, p.nodes)
    return Packing("projections", projections=projections)


def heads_packing(g: Graph, q: str, k: str, v: str, reader: onnx.NodeProto, heads: int, head_size: int) -> Packing:
    """Q, K, V (B, H, S, D) as outputs 0, 1, 2 of a Split in three on the last axis of Transpose(0, 2, 1, 3) of
    Reshape(x3d, (B, S, H, 3 D)): each head's Q, K and V lie side by side in x3d. NoMatch otherwise."""
    split = g.producer.get(q)
    if split is None or split.op_type != "Split" or list(split.output) != [q, k, v] or \
            attr(split, "axis", 0) not in (-1, 3):
        raise NoMatch("Q, K and V are not one Split of each head's packed features")
    sizes = g.constant(split.input[1]) if len(split.input) > 1 and split.input[1] else None
    if sizes is not None and sizes.reshape(-1).tolist() != [head_size] * 3:
        raise NoMatch(f"per-head split sizes {sizes.reshape(-1).tolist()} are not three heads of {head_size}")
    tr = g.producer.get(split.input[0])
    rs = g.producer.get(tr.input[0]) if tr is not None and transpose_perm(tr) == [0, 2, 1, 3] else None
    if rs is None or rs.op_type != "Reshape" or g.rank(rs.input[0]) != 3:
        raise NoMatch("the per-head packed tensor is not a head split of a projection's output")
    target = g.constant(rs.input[1])
    if target is not None and (target.size != 4 or int(target[3]) != 3 * head_size):
        raise NoMatch(f"the per-head view {target.tolist()} is not (batch, sequence, heads, 3 x {head_size})")
    if not private(g, [rs, tr], split):
        raise NoMatch("the per-head packed tensor has other readers")
    return Packing("heads", rs.input[0], [rs, tr, split], heads=heads, head_size=head_size)


# --- the node's output from a kernel's ------------------------------------------------------------------------
def unflatten(g: Graph, flat: str, c: Captured, consts: Constants) -> list[onnx.NodeProto]:
    """The node's (B, S, H, Dv) output from a kernel's (B, S, H x Dv): the model's own merge Reshape reads the flat
    tensor directly when it is the only reader and flattens the same way (its target (B, S, -1 or H x Dv)); else one
    Reshape restores the node's layout."""
    readers = g.consumers.get(c.out, [])
    if len(readers) == 1 and readers[0].op_type == "Reshape" and c.out not in g.graph_outputs and \
            _flattens(g, readers[0], c.q_heads * c.v_head_size):
        readers[0].input[0] = flat
        return []
    view = consts.int64(f"head_view:{c.q_heads}:{c.v_head_size}", [0, 0, c.q_heads, c.v_head_size])
    return [helper.make_node("Reshape", [flat, view], [c.out], name=g.fresh("HeadsView"))]


def _flattens(g: Graph, rs: onnx.NodeProto, width: int) -> bool:
    target = g.constant(rs.input[1])
    if target is not None:
        return target.size == 3 and int(target[2]) in (-1, width) and all(int(d) in (0,) for d in target[:2])
    cat = g.producer.get(rs.input[1])
    if cat is None or cat.op_type != "Concat" or len(cat.input) != 3:
        return False
    last = g.constant(cat.input[2])
    return last is not None and last.size == 1 and int(last.reshape(-1)[0]) in (-1, width) and \
        all(g.producer.get(i) is not None and g.producer[i].op_type in ("Shape", "Squeeze", "Unsqueeze", "Gather",
                                                                           "Reshape") for i in cat.input[:2])


def flat_operand(g: Graph, new: list, o: Operand, heads: int, head_size: int, consts: Constants) -> str:
    """``o`` as (B, S, H x D), its head norms re-applied on a (B, S, H, D) view."""
    value = o.value
    if o.layout == "bhsd":
        value = emit(g, new, "Transpose", [value], "bshd", perm=[0, 2, 1, 3])
    elif o.layout == "flat" and o.norms:
        value = emit(g, new, "Reshape", [value, consts.int64(f"head_view:{heads}:{head_size}",
                                                             [0, 0, heads, head_size])], "heads")
    for norm in o.norms:
        copy = helper.make_node(norm.op_type, [value, *norm.input[1:]], [g.fresh(f"{norm.output[0]}_bshd")],
                                     name=g.fresh(norm.name or "HeadNorm"), domain=norm.domain)
        copy.attribute.extend(norm.attribute)
        new.append(copy)
        value = copy.output[0]
    if o.layout != "flat" or o.norms:
        value = emit(g, new, "Reshape", [value, consts.int64("head_flat", [0, 0, -1])], "flat")
    return value


def additive(g: Graph, new: list, c: Captured, types: dict[str, int], consts: Constants,
             shared: dict[str, str]) -> str:
    """The node's mask and position bias as one additive float bias ("" when it has neither), built once per pair."""
    key = f"bias:{c.mask}:{c.bias}"
    if key not in shared:
        parts = []
        if c.mask is not None:
            parts.append(c.mask if types.get(c.mask) != TensorProto.BOOL else
                         emit(g, new, "Where", [c.mask, consts.float32("zero", 0.0), consts.float32("neg", NEG)],
                              "mask_bias"))
        if c.bias is not None:
            parts.append(c.bias)
        shared[key] = parts[0] if len(parts) == 1 else \
            emit(g, new, "Add", parts, "bias_sum") if parts else ""
    return shared[key]
