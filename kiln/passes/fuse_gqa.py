"""Decoder self-attention -> ``com.microsoft.GroupQueryAttention`` (ONNX Runtime CPU/CUDA).

The exporter writes each decoder layer as Q/K/V projections, head splits, RotaryEmbedding on Q
and K, ``repeat_kv`` (Unsqueeze/Expand/Reshape) on K and V, the standard ``Attention`` op with a
boolean causal-and-padding mask, and a head merge. One GroupQueryAttention replaces all of it:
- Q, K and V come from one packed MatMul (the three projections' weights concatenated), or from
  the packed tensor the model already splits (GPT-2's ``c_attn`` by a Split, Phi-3's ``qkv_proj`` by three
  Slices, GPT-NeoX's ``query_key_value``, each head's Q, K, V side by side, regrouped by one Transpose);
- rotary is applied inside the kernel (``do_rotary``) from cos/sin caches computed here from the
  graph's ``inv_freq`` constant, for every position up to the model's maximum. Partial rotary (StableLM,
  GPT-NeoX, Phi-2, Phi-4-mini: the first ``d`` features of each head, exported as a Slice, RotaryEmbedding and
  Concat) is the kernel's too: caches ``d / 2`` wide rotate the first ``d`` and pass the rest through
  (measured against numpy on ONNX Runtime 1.32 for d = 16, 32, 96 of heads of 32-128). The kernel takes ``d`` in
  multiples of 16 only, so a narrower rotary (StableLM 3B's 20 of 80) is refused with that reason;
- ``repeat_kv`` disappears (the kernel shares KV heads across query heads);
- the kernel is causal itself; padding enters as an additive ``attention_bias`` built once per
  graph from ``attention_mask``.

Left padding: the kernel numbers positions from the start of the row, while the eager model
numbers real tokens from 0. Rotary attention scores depend only on position differences, and
padded keys are masked, so real tokens see the same scores (checked end to end by verification).

Per-head norms on Q and K (Qwen3, Gemma 3, OLMo 2: an RMSNorm over each head's features before rotary,
traced before or after the head split's Transpose): the kernel rotates what it is given, so the norms move in
front of it, on the projections' outputs viewed as (B, S, heads, head size), and Q, K and V reach the kernel
as three inputs (the projections stay apart; packing them would need a Split after the MatMul).

Why not onnxscript's ``ort_fusions`` gqa/rotary rules: on the opset-23 dynamo export of Llama they fuse
nothing (gqa 0, rotary_embedding 0, measured with onnxscript 0.7.2): they expect the explicit chains.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.fuse_attention import NoMatch, match_head_split, match_linear, match_onnx_attention, sole_users
from kiln.passes.graph import MS_DOMAIN, Graph, attr

_COMPARISONS = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
_HEAD_NORMS = {"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization"}


def _ancestor_ops(g: Graph, value: str) -> set[str]:
    seen, stack, ops = set(), [value], set()
    while stack:
        v = stack.pop()
        p = g.producer.get(v)
        if v in seen or p is None:
            continue
        seen.add(v)
        ops.add(p.op_type)
        stack.extend(i for i in p.input if i)
    return ops


def _used_only_within(g: Graph, nodes: list[onnx.NodeProto]) -> None:
    """Every output of every node but the last is read only by these nodes (a partial rotary's head split feeds two
    Slices): fusing them must not duplicate work or orphan a reader."""
    ids = {id(n) for n in nodes}
    for n in nodes[:-1]:
        for o in n.output:
            if o and (o in g.graph_outputs or any(id(c) not in ids for c in g.consumers.get(o, []))):
                raise NoMatch(f"{o} has other users; fusing would duplicate it")


def _constant_cut(g: Graph, sl: onnx.NodeProto, axes: tuple[int, ...], what: str) -> tuple[int, int]:
    """Slice ``sl``'s constant (start, end) on one of ``axes`` with step 1; NoMatch naming ``what`` otherwise."""
    starts, ends, axis, steps = (g.constant(sl.input[i]) if len(sl.input) > i and sl.input[i] else None
                                 for i in (1, 2, 3, 4))
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        raise NoMatch(f"Slice {sl.name} of {what} has no constant bounds")
    if axis is None or axis.size != 1 or int(axis.reshape(-1)[0]) not in axes or \
            (steps is not None and steps.reshape(-1).tolist() != [1]):
        raise NoMatch(f"Slice {sl.name} does not cut {what}'s last axis with step 1")
    return int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


class FuseGroupQueryAttention(Pass):
    name = "fuse-gqa"

    def __init__(self, num_heads: int, num_kv_heads: int, max_length: int,
                 sliding_windows: tuple[int | None, ...] = (), mask_input: str = "attention_mask",
                 ids_input: str = "input_ids", heads_per_layer: tuple[int, ...] = ()) -> None:
        self.num_heads = num_heads
        self.heads_per_layer = heads_per_layer  # per layer, in graph order (pruned layers differ); empty: num_heads
        self.num_kv_heads = num_kv_heads
        self.max_length = max_length
        self.sliding_windows = sliding_windows  # per layer, in graph order; empty: full attention everywhere
        self.mask_input = mask_input
        self.ids_input = ids_input

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        fused, rotary, packed, skipped = 0, 0, 0, []
        shared: dict[str, str] = {}  # bias / seqlens / caches, built once per graph (this run's state only)
        for layer, handle in enumerate(g.nodes_of("Attention")):
            window = self.sliding_windows[layer] if layer < len(self.sliding_windows) else None
            heads = self.heads_per_layer[layer] if layer < len(self.heads_per_layer) else self.num_heads
            node = g.node(handle)
            where = node.name or handle
            try:
                new, remove, info = self.rewrite(g, node, shared, window, heads)
            except NoMatch as e:
                skipped.append(Reason(where, str(e)))
                continue
            g.replace_nodes(remove, new)
            fused += 1
            rotary += info["rotary"]
            packed += info["packed"]
        if fused:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, fused > 0, {"fused": fused, "rotary": rotary, "packed_qkv": packed}, skipped)

    # --- matching ------------------------------------------------------------------------
    @staticmethod
    def _head_norms(g: Graph, value: str) -> tuple[str, list[onnx.NodeProto]]:
        """Norms over the last axis (each head's features) ending at ``value``: (their input, the norms, input first)."""
        norms: list[onnx.NodeProto] = []
        while (p := g.producer.get(value)) is not None and p.op_type in _HEAD_NORMS and attr(p, "axis", -1) in (-1, 3) \
                and sum(1 for o in p.output if o) == 1:
            norms.insert(0, p)
            value = p.input[0]
        return value, norms

    def _heads_source(self, g: Graph, value: str, role: str
                      ) -> tuple[str, onnx.NodeProto | None, list[onnx.NodeProto], list[onnx.NodeProto]]:
        """Walk back from an Attention input: [repeat_kv] <- [RotaryEmbedding] <- [head norms] <- head split (its
        Transpose may have head norms on either side) -> 3-D source.

        Returns the source, the rotary node, the nodes between the source and the Attention (input first) and the
        head norms among them (input first)."""
        nodes: list[onnx.NodeProto] = []
        cur = g.producer.get(value)
        if role != "q" and cur is not None and cur.op_type == "Reshape":  # repeat_kv: Unsqueeze -> Expand -> Reshape
            ex = g.parent(cur, 0, "Expand")
            un = g.parent(ex, 0, "Unsqueeze") if ex is not None else None
            if un is None:
                raise NoMatch(f"{role} input {value} is a Reshape that is not repeat_kv (Unsqueeze/Expand/Reshape)")
            nodes = [un, ex, cur]
            value = un.input[0]
            cur = g.producer.get(value)
        rope, rotary_dim = None, None
        if cur is not None and cur.op_type == "Concat" and any(
                (g.producer.get(i) is not None and g.producer[i].op_type in ("RotaryEmbedding", "Slice", "Add", "Sub", "Neg"))
                for i in cur.input):
            value, rope, rotary_dim, partial = self._partial_rotary(g, cur, role)
            nodes = partial + nodes
        elif cur is not None and cur.op_type == "RotaryEmbedding":
            rope = cur
            nodes.insert(0, rope)
            value = rope.input[0]
        value, after = self._head_norms(g, value)  # Gemma 3: normed after the Transpose
        tr = g.producer.get(value)
        before: list[onnx.NodeProto] = []
        if tr is not None and tr.op_type == "Transpose":  # Qwen3: normed between the Reshape and the Transpose
            inner, before = self._head_norms(g, tr.input[0])
            if before:
                rs = g.producer.get(inner)
                if rs is None or rs.op_type != "Reshape" or list(attr(tr, "perm", [])) != [0, 2, 1, 3]:
                    raise NoMatch(f"head split of {value} is not Reshape, norm, Transpose [0, 2, 1, 3]")
                return rs.input[0], (rope, rotary_dim), [rs, *before, tr, *after, *nodes], before + after
        if tr is not None and tr.op_type == "Split":  # GPT-NeoX: each head's q, k and v side by side
            x3d, split = self._per_head_split(g, tr, value, role)
        else:
            x3d, split = match_head_split(g, value)
        return x3d, (rope, rotary_dim), split + after + nodes, after

    @staticmethod
    def _per_head_split(g: Graph, split: onnx.NodeProto, value: str, role: str
                        ) -> tuple[str, list[onnx.NodeProto]]:
        """GPT-NeoX's ``query_key_value``: x3d viewed as (B, S, heads, 3 x head size), Transpose(0, 2, 1, 3), Split
        in three on the last axis: Q is output 0, K 1, V 2. Returns x3d and [Reshape, Transpose, Split]."""
        want = {"q": 0, "k": 1, "v": 2}[role]
        if attr(split, "axis", 0) not in (-1, 3) or len(split.output) != 3 or list(split.output).index(value) != want:
            raise NoMatch(f"{role} is output {list(split.output).index(value)} of a Split that is not Q, K, V in three "
                          "on the heads' last axis")
        sizes = g.constant(split.input[1]) if len(split.input) > 1 and split.input[1] else None
        if sizes is not None and len(set(sizes.reshape(-1).tolist())) != 1:
            raise NoMatch(f"per-head QKV split sizes {sizes.tolist()} are not equal")
        x3d, nodes = match_head_split(g, split.input[0])
        return x3d, nodes + [split]

    @staticmethod
    def _partial_rotary(g: Graph, cat: onnx.NodeProto, role: str
                        ) -> tuple[str, onnx.NodeProto, int, list[onnx.NodeProto]]:
        """Partial rotary (StableLM, GPT-NeoX, Phi-2, Phi-4-mini): Concat(RotaryEmbedding(x[..., :d]), x[..., d:])
        on the heads' last axis. GroupQueryAttention rotates the first ``d`` features of each head itself when its
        cos/sin caches are ``d / 2`` wide and passes the rest through, so the three nodes go.

        Returns x, the rotary node, ``d`` and the nodes from x to the Concat (input first)."""
        parts = [g.producer.get(i) for i in cat.input]
        if len(parts) != 2 or attr(cat, "axis", 0) not in (-1, 3) or parts[0] is None or parts[1] is None or \
                parts[0].op_type != "RotaryEmbedding" or parts[1].op_type != "Slice":
            raise NoMatch(f"partial rotary: {role} is a Concat that is not (rotated first slice, unrotated rest) "
                          "on the heads' last axis")
        rope, rest = parts
        first = g.producer.get(rope.input[0])
        if first is None or first.op_type != "Slice" or first.input[0] != rest.input[0]:
            raise NoMatch(f"partial rotary: the rotated and unrotated parts of {role} are not slices of one tensor")
        bounds = [_constant_cut(g, sl, (-1, 3), f"partial rotary {role}") for sl in (first, rest)]
        (a0, a1), (b0, b1) = bounds
        if a0 != 0 or a1 <= 0 or b0 != a1 or b1 < (1 << 31):  # the rest runs to the end (an int64 max bound)
            raise NoMatch(f"partial rotary: slices {bounds} of {role} are not [0, d) and [d, end)")
        if attr(rope, "rotary_embedding_dim", 0) not in (0, a1):
            raise NoMatch(f"partial rotary: {role}'s RotaryEmbedding rotates {attr(rope, 'rotary_embedding_dim')} "
                          f"of its {a1} features")
        return first.input[0], rope, a1, [first, rope, rest, cat]

    def _rotary(self, g: Graph, q_rope: tuple[onnx.NodeProto | None, int | None],
                k_rope: tuple[onnx.NodeProto | None, int | None], head_size: int):
        """The rotary both Q and K get, checked: (inv_freq, cos/sin scale, interleaved), or None when neither is
        rotated. ``*_rope``: the RotaryEmbedding and the features it rotates (None: the whole head, or its own
        ``rotary_embedding_dim``)."""
        (q_rope, q_dim), (k_rope, k_dim) = q_rope, k_rope
        if q_rope is None and k_rope is None:
            return None
        if q_rope is None or k_rope is None:
            raise NoMatch("rotary is applied to only one of Q and K")
        dims = set()
        for rope, dim in ((q_rope, q_dim), (k_rope, k_dim)):
            if len(rope.input) > 3 and rope.input[3]:
                raise NoMatch("RotaryEmbedding takes position_ids; only precomputed cos/sin are recognised")
            own = int(attr(rope, "rotary_embedding_dim", 0))
            dims.add(dim if dim is not None else own or head_size)
        if len(dims) != 1:
            raise NoMatch(f"Q and K rotate different numbers of features {sorted(dims)}")
        rotary_dim = dims.pop()
        if rotary_dim > head_size or rotary_dim % 16:
            raise NoMatch(f"partial rotary over {rotary_dim} of {head_size} features: GroupQueryAttention rotates a "
                          "multiple of 16 (its cos/sin cache width must be a multiple of 8)")
        if attr(q_rope, "interleaved", 0) != attr(k_rope, "interleaved", 0):
            raise NoMatch("Q and K use different rotary layouts")
        tables = []
        for i, fn in ((1, "Cos"), (2, "Sin")):
            angles = set()
            scale = set()
            for rope in (q_rope, k_rope):
                p = g.producer.get(rope.input[i])
                factor = 1.0
                if p is not None and p.op_type == "Mul":  # attention_scaling (llama3/yarn rope) multiplies cos and sin
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
        inv_freq = None
        if mul is not None and mul.op_type == "Mul":
            for i in (0, 1):
                c = g.constant(mul.input[i])
                if c is not None and c.size == rotary_dim // 2:
                    inv_freq = c.reshape(-1).astype(np.float64)
                    positions = mul.input[1 - i]
        if inv_freq is None:
            raise NoMatch(f"rotary angles are not positions x a constant inv_freq of {rotary_dim // 2} values")
        if g.ancestors_inputs(positions) - {self.mask_input}:
            raise NoMatch("rotary positions do not come from attention_mask alone")
        return inv_freq, tables[0][1], int(attr(q_rope, "interleaved", 0))

    def rewrite(self, g: Graph, node: onnx.NodeProto, shared: dict[str, str], window: int | None, heads: int):
        """Check the whole layer first (raising NoMatch with the reason), then add what the fused node needs:
        a refused layer leaves the graph exactly as it was."""
        core = match_onnx_attention(g, node)
        if core.mask is None and not core.causal:
            raise NoMatch("attention is neither causal nor masked: not decoder self-attention")
        if core.mask is not None:
            if g.ancestors_inputs(core.mask) - {self.mask_input, self.ids_input}:
                raise NoMatch(f"mask {core.mask} depends on inputs other than {self.mask_input}")
            if not _ancestor_ops(g, core.mask) & _COMPARISONS:
                raise NoMatch(f"mask {core.mask} compares no positions, so it is not causal")
        q3, q_rope, q_nodes, q_norms = self._heads_source(g, core.q, "q")
        k3, k_rope, k_nodes, k_norms = self._heads_source(g, core.k, "k")
        v3, v_rope, v_nodes, v_norms = self._heads_source(g, core.v, "v")
        if v_rope[0] is not None:
            raise NoMatch("V is rotated; the kernel rotates only Q and K")
        if v_norms:
            raise NoMatch("V is normed per head; only Q and K norms are moved in front of the kernel")
        merge_view = g.only_consumer(core.out, "Reshape")  # Phi-3: a (B, -1, S, head size) view of it first
        merge_tr = g.only_consumer(merge_view.output[0] if merge_view is not None else core.out, "Transpose")
        merge_rs = g.only_consumer(merge_tr.output[0], "Reshape") if merge_tr is not None else None
        if merge_tr is None or list(attr(merge_tr, "perm", [])) != [0, 2, 1, 3] or merge_rs is None:
            raise NoMatch("attention output is not merged back by Transpose(0,2,1,3) + Reshape")
        for x in {q3, k3, v3}:
            if len(g.consumers[x]) != 1:
                raise NoMatch(f"{x} has other users; fusing would duplicate it")
        if q3 == k3 == v3:
            if not any(n.op_type == "Split" for n in q_nodes):
                raise NoMatch(f"Q, K and V are the same tensor {q3}")
            packing, hidden = self._match_heads_pack(g, q_nodes[0], heads)
        elif len({q3, k3, v3}) < 3:
            raise NoMatch("two of Q, K and V come from one tensor and the third from another")
        else:
            packing, hidden = self._match_pack(g, q3, k3, v3, heads)
        head_size = hidden // heads
        if hidden % heads:
            raise NoMatch(f"query width {hidden} is not divisible by {heads} heads")
        if head_size % 16:
            raise NoMatch(f"head size {head_size} is not a multiple of 16, which GroupQueryAttention requires")
        if merge_view is not None and not self._is_heads_view(g, merge_view, heads, head_size):
            raise NoMatch(f"attention output goes through Reshape {merge_view.name}, which is not its own "
                          "(batch, heads, sequence, head size) shape")
        for norm in q_norms + k_norms:
            for i in norm.input[1:]:
                c = g.shape_of_constant(i) if i else None
                if i and (c is None or c not in ((head_size,), (1,), ())):
                    raise NoMatch(f"head norm {norm.name} takes {i}, not a constant of the head size {head_size}")
        if (q_norms or k_norms) and packing[0] != "projections":
            raise NoMatch("Q/K norms on a packed QKV tensor the model splits itself are not moved")
        rope = self._rotary(g, q_rope, k_rope, head_size)
        layer = list({id(n): n for n in q_nodes + k_nodes + v_nodes}.values())  # a per-head split is in all three
        _used_only_within(g, layer + [node])
        # --- every check passed: from here on the graph changes
        new: list[onnx.NodeProto] = []
        if q_norms or k_norms:  # the projections stay apart; the norms run on (B, S, heads, head size) views
            qkv = [self._emit_norms(g, new, q3, q_norms, head_size, shared),
                   self._emit_norms(g, new, k3, k_norms, head_size, shared), v3]
            proj_nodes: dict[str, list[onnx.NodeProto]] = {"new": [], "old": []}
        else:
            qkv, proj_nodes = self._emit_pack(g, packing, shared)
        new += proj_nodes["new"]
        bias = self._padding_bias(g, new, shared)
        seqlens, total = self._lengths(g, new, shared)
        cos = sin = ""
        if rope is not None:
            cos, sin = self._caches(g, *rope[:2], head_size, shared)
        inputs = [*qkv, *[""] * (3 - len(qkv)), "", "", seqlens, total, cos, sin, "", bias]
        attrs = dict(num_heads=heads, kv_num_heads=self.num_kv_heads, do_rotary=int(rope is not None),
                     rotary_interleaved=rope[2] if rope else 0,
                     scale=float(core.scale if core.scale is not None else head_size ** -0.5))
        if window:
            attrs["local_window_size"] = int(window)
        # The kernel writes (B, S, H*hd), the layout Transpose(0,2,1,3) gave the merge Reshape, so that
        # Reshape stays (it may flatten to 2-D for a Gemm, as GPT-2's does) and only the Transpose goes.
        out = g.fresh("gqa_out")
        new.append(helper.make_node("GroupQueryAttention", inputs, [out], name=g.fresh("GroupQueryAttention"),
                                    domain=MS_DOMAIN, **attrs))
        new.append(helper.make_node("Reshape", [out, merge_rs.input[1]], [merge_rs.output[0]], name=merge_rs.name))
        remove = core.nodes + layer + proj_nodes["old"] + [merge_tr, merge_rs] + \
            ([merge_view] if merge_view is not None else [])
        return new, remove, {"rotary": int(rope is not None), "packed": int(len(qkv) == 1)}

    @staticmethod
    def _emit_norms(g: Graph, new: list, x3d: str, norms: list[onnx.NodeProto], head_size: int,
                    shared: dict[str, str]) -> str:
        """``norms`` (copied, in order) on ``x3d`` (B, S, H * hd) viewed as (B, S, H, hd), flattened back; the two
        shape constants are made once per graph."""
        if not norms:
            return x3d
        key = f"head_view:{head_size}"
        if key not in shared:
            shared[key] = g.add_initializer("head_view", np.array([0, 0, -1, head_size], np.int64))
        if "head_flat" not in shared:
            shared["head_flat"] = g.add_initializer("head_flat", np.array([0, 0, -1], np.int64))
        heads, flat = shared[key], shared["head_flat"]
        cur = g.fresh(f"{x3d}_heads")
        new.append(helper.make_node("Reshape", [x3d, heads], [cur], name=g.fresh("HeadView")))
        for norm in norms:
            out = g.fresh(f"{norm.output[0]}_bshd")
            copy = helper.make_node(norm.op_type, [cur, *norm.input[1:]], [out], name=g.fresh(norm.name or "HeadNorm"),
                                    domain=norm.domain)
            copy.attribute.extend(norm.attribute)
            new.append(copy)
            cur = out
        out = g.fresh(f"{x3d}_normed")
        new.append(helper.make_node("Reshape", [cur, flat], [out], name=g.fresh("HeadFlat")))
        return out

    def _match_pack(self, g: Graph, q3: str, k3: str, v3: str, hq: int):
        """How Q, K, V reach the kernel as one packed (B, S, (H + 2 KV) hd) input: the model's own packed
        tensor, or the three projections to concatenate. Checks only; ``_emit_pack`` builds it."""
        hk = self.num_kv_heads
        split = g.producer.get(q3)
        if split is not None and split.op_type == "Split" and list(split.output) == [q3, k3, v3]:
            sizes = g.constant(split.input[1]) if len(split.input) > 1 and split.input[1] else None
            width = self._width(g, split.input[0])
            if attr(split, "axis", 0) not in (-1, 2):
                raise NoMatch("packed QKV is split on an axis other than the last")
            if sizes is not None and (sizes[1] != sizes[2] or sizes[0] * hk != sizes[1] * hq):
                raise NoMatch(f"packed QKV split sizes {list(sizes)} do not match {hq} query / {hk} KV heads")
            hidden = int(sizes[0]) if sizes is not None else (width // 3 if width else None)
            if hidden is None:
                raise NoMatch("width of the packed QKV tensor is unknown")
            return ("split", split), hidden
        sliced = self._match_slices(g, q3, k3, v3, hq)
        if sliced is not None:
            return sliced
        q, k, v = (match_linear(g, x) for x in (q3, k3, v3))
        if not (q.x == k.x == v.x):
            raise NoMatch("Q, K and V project different inputs (cross-attention)")
        hidden = q.weight.shape[1]
        if k.weight.shape != v.weight.shape or k.weight.shape[1] * hq != hidden * hk:
            raise NoMatch(f"K/V projection widths {k.weight.shape[1]}, {v.weight.shape[1]} do not match {hk} KV heads")
        for p in (q, k, v):
            sole_users(g, p.nodes)
        return ("projections", (q, k, v)), hidden

    def _match_heads_pack(self, g: Graph, view: onnx.NodeProto, hq: int):
        """GPT-NeoX's per-head packing (``view`` reshapes the projection to (B, S, heads, 3 x head size)): the
        kernel's packed layout is Q, K, V each across all heads, so the projection's output is regrouped by a
        (B, S, heads, 3, head size) view and one Transpose, which replaces the graph's own Transpose (the weights
        stay as they are, so codes solved for them are found). Multi-head only: no KV heads are shared."""
        if hq != self.num_kv_heads:
            raise NoMatch(f"per-head packed QKV with {hq} query and {self.num_kv_heads} KV heads: only equal counts "
                          "are packed this way")
        target = g.constant(view.input[1])  # constant, or Concat(batch, sequence, heads, 3 x head size) as exported
        cat = g.parent(view, 1, "Concat") if target is None else None
        dims = [g.constant(i) for i in cat.input[2:]] if cat is not None and len(cat.input) == 4 else [None]
        if target is None and all(d is not None and d.size == 1 for d in dims):
            target = np.concatenate([[0, 0], *(d.reshape(-1) for d in dims)])
        if target is None or target.size != 4 or int(target[2]) not in (-1, hq) or int(target[3]) % 3:
            raise NoMatch(f"per-head packed QKV view {view.name} is not (batch, sequence, {hq}, 3 x head size)")
        head_size = int(target[3]) // 3
        return ("heads", (view.input[0], hq, head_size)), hq * head_size

    def _match_slices(self, g: Graph, q3: str, k3: str, v3: str, hq: int):
        """Phi-3's ``qkv_proj``: Q, K and V cut from one tensor by three Slices along its last axis, back to back
        and in that order, which is already the kernel's packed layout. None when they are not Slices."""
        hk = self.num_kv_heads
        nodes = [g.producer.get(x) for x in (q3, k3, v3)]
        if not all(n is not None and n.op_type == "Slice" for n in nodes):
            return None
        source = nodes[0].input[0]
        if any(n.input[0] != source for n in nodes):
            raise NoMatch("Q, K and V are slices of different tensors")
        width = self._width(g, source)
        if width is None:
            raise NoMatch("width of the packed QKV tensor is unknown")
        bounds = []
        for n in nodes:
            cut = _constant_cut(g, n, (-1, 2), "the packed QKV tensor")
            bounds.append(tuple(v + width if v < 0 else min(v, width) for v in cut))
        (q0, q1), (k0, k1), (v0, v1) = bounds
        if not (q0 == 0 and q1 == k0 and k1 == v0 and v1 == width and k1 - k0 == v1 - v0 and
                (k1 - k0) * hq == q1 * hk):
            raise NoMatch(f"packed QKV slices {bounds} of width {width} are not Q, K, V back to back for {hq} "
                          f"query / {hk} KV heads")
        return ("slices", (source, nodes)), q1

    def _is_heads_view(self, g: Graph, view: onnx.NodeProto, heads: int, head_size: int) -> bool:
        """Whether Reshape ``view`` of the (B, heads, S, head size) attention output is its own shape: the target is
        Concat(batch, -1 or heads, sequence, head size), batch and sequence read from the mask or ids input."""
        cat = g.parent(view, 1, "Concat")
        if cat is None or len(cat.input) != 4:
            return False
        dims = [g.producer.get(i) for i in cat.input]
        if not all(d is not None and d.op_type == "Shape" for d in (dims[0], dims[2])):
            return False
        b, s = dims[0], dims[2]
        if b.input[0] != s.input[0] or b.input[0] not in (self.mask_input, self.ids_input) or \
                (attr(b, "start", 0), attr(b, "end", None), attr(s, "start", 0), attr(s, "end", None)) != (0, 1, 1, 2):
            return False
        h, d = g.constant(cat.input[1]), g.constant(cat.input[3])
        return h is not None and d is not None and h.tolist() in ([-1], [heads]) and d.tolist() == [head_size]

    @staticmethod
    def _emit_pack(g: Graph, packing, shared: dict[str, str]) -> tuple[list[str], dict[str, list[onnx.NodeProto]]]:
        kind, found = packing
        if kind == "heads":  # (B, S, H * 3 * hd) -> (B, S, H, 3, hd) -> (B, S, 3, H, hd) -> (B, S, 3 * H * hd)
            x3d, heads, head_size = found
            key = f"qkv_heads_view:{heads}:{head_size}"
            if key not in shared:
                shared[key] = g.add_initializer("qkv_heads_view", np.array([0, 0, heads, 3, head_size], np.int64))
            if "head_flat" not in shared:
                shared["head_flat"] = g.add_initializer("head_flat", np.array([0, 0, -1], np.int64))
            view, flat = shared[key], shared["head_flat"]
            t = [g.fresh(f"{x3d}_{k}") for k in ("heads", "grouped", "packed")]
            return [t[2]], {"new": [
                helper.make_node("Reshape", [x3d, view], [t[0]], name=g.fresh("QKVHeads")),
                helper.make_node("Transpose", [t[0]], [t[1]], perm=[0, 1, 3, 2, 4], name=g.fresh("QKVGroup")),
                helper.make_node("Reshape", [t[1], flat], [t[2]], name=g.fresh("QKVPacked"))], "old": []}
        if kind == "split":
            return [found.input[0]], {"new": [], "old": [found]}
        if kind == "slices":
            return [found[0]], {"new": [], "old": list(found[1])}
        q, k, v = found
        weight = g.add_initializer("qkv_weight", np.concatenate([q.weight, k.weight, v.weight], 1))
        out = g.fresh("qkv")
        new = [helper.make_node("MatMul", [q.x, weight], [out], name=g.fresh("QKV"))]
        if any(p.bias is not None for p in (q, k, v)):
            biases = [p.bias if p.bias is not None else np.zeros(p.weight.shape[1], p.weight.dtype) for p in (q, k, v)]
            b = g.add_initializer("qkv_bias", np.concatenate(biases).astype(q.weight.dtype))
            biased = g.fresh("qkv_biased")
            new.append(helper.make_node("Add", [out, b], [biased], name=g.fresh("QKVBias")))
            out = biased
        return [out], {"new": new, "old": [n for p in (q, k, v) for n in p.nodes]}

    @staticmethod
    def _width(g: Graph, value: str) -> int | None:
        p = g.producer.get(value)
        if p is not None and p.op_type == "Reshape":
            shape = g.constant(p.input[1])
            if shape is not None and shape.size == 3 and shape[2] > 0:
                return int(shape[2])
            p = g.producer.get(p.input[0])
        if p is not None and p.op_type in ("Gemm", "MatMul"):
            dims = g.shape_of_constant(p.input[1])  # an initializer's shape, without reading its data
            if dims is None and (w := g.constant(p.input[1])) is not None:
                dims = w.shape
            if dims is not None and len(dims) == 2:
                return int(dims[0] if attr(p, "transB", 0) else dims[1])
        return None

    # --- shared inputs, built once per graph -------------------------------------------------
    @staticmethod
    def _shape_of(g: Graph, new: list, value: str, start: int, end: int, shared: dict[str, str]) -> str:
        key = f"shape:{value}:{start}"
        if key not in shared:
            out = g.fresh(f"{value}_dim{start}")
            new.append(helper.make_node("Shape", [value], [out], start=start, end=end, name=g.fresh("Shape")))
            shared[key] = out
        return shared[key]

    def _padding_bias(self, g: Graph, new: list, shared: dict[str, str]) -> str:
        """attention_mask (B, T) -> additive bias (B, 1, S, T): 0 for real tokens, float32 min for padding."""
        if "bias" in shared:
            return shared["bias"]
        c = {k: g.add_initializer(k, v) for k, v in (
            ("pad_one", np.array(1.0, np.float32)), ("pad_neg", np.array(np.finfo(np.float32).min, np.float32)),
            ("pad_axes", np.array([1, 2], np.int64)), ("pad_ones2", np.array([1, 1], np.int64)),
            ("pad_one1", np.array([1], np.int64)))}
        t = {k: g.fresh(f"pad_{k}") for k in ("f", "inv", "b2", "b4", "shape", "bias")}
        seq = self._shape_of(g, new, self.ids_input, 1, 2, shared)
        new += [
            helper.make_node("Cast", [self.mask_input], [t["f"]], to=TensorProto.FLOAT, name=g.fresh("PadCast")),
            helper.make_node("Sub", [c["pad_one"], t["f"]], [t["inv"]], name=g.fresh("PadInv")),
            helper.make_node("Mul", [t["inv"], c["pad_neg"]], [t["b2"]], name=g.fresh("PadBias")),
            helper.make_node("Unsqueeze", [t["b2"], c["pad_axes"]], [t["b4"]], name=g.fresh("PadUnsqueeze")),
            helper.make_node("Concat", [c["pad_ones2"], seq, c["pad_one1"]], [t["shape"]], axis=0, name=g.fresh("PadShape")),
            helper.make_node("Expand", [t["b4"], t["shape"]], [t["bias"]], name=g.fresh("PadExpand")),
        ]
        shared["bias"] = t["bias"]
        return t["bias"]

    def _lengths(self, g: Graph, new: list, shared: dict[str, str]) -> tuple[str, str]:
        """seqlens_k (B,): each row's index of its last 1 in the mask, and total_sequence_length T. A left-padded
        batch has T - 1 in every row (its padding is in the bias); a right-padded row (continuous batching,
        ``kiln.runtimes.scheduler``) gets its own past length, where the kernel writes its new token and from which
        it takes the row's rotary position."""
        if "total" in shared:
            return shared["seqlens"], shared["total"]
        length = self._shape_of(g, new, self.mask_input, 1, 2, shared)
        c = {k: g.add_initializer(k, v) for k, v in (
            ("len_zero", np.array(0, np.int64)), ("len_one", np.array(1, np.int64)),
            ("len_scalar", np.array([], np.int64)), ("len_axes", np.array([1], np.int64)))}
        t = {k: g.fresh(f"len_{k}") for k in ("total64", "total", "steps", "where", "last", "seqlens")}
        opset = next((o.version for o in g.model.opset_import if o.domain in ("", "ai.onnx")), 18)
        axes = {"inputs": [t["where"], c["len_axes"]]} if opset >= 18 else {"inputs": [t["where"]], "axes": [1]}
        new += [
            helper.make_node("Reshape", [length, c["len_scalar"]], [t["total64"]], name=g.fresh("TotalLength")),
            helper.make_node("Cast", [t["total64"]], [t["total"]], to=TensorProto.INT32, name=g.fresh("TotalCast")),
            helper.make_node("Range", [c["len_zero"], t["total64"], c["len_one"]], [t["steps"]],
                             name=g.fresh("Positions")),
            helper.make_node("Mul", [self.mask_input, t["steps"]], [t["where"]], name=g.fresh("RealPositions")),
            helper.make_node("ReduceMax", axes.pop("inputs"), [t["last"]], keepdims=0, name=g.fresh("LastReal"),
                             **axes),
            helper.make_node("Cast", [t["last"]], [t["seqlens"]], to=TensorProto.INT32, name=g.fresh("SeqLens")),
        ]
        shared.update(seqlens=t["seqlens"], total=t["total"])
        return t["seqlens"], t["total"]

    def _caches(self, g: Graph, inv_freq: np.ndarray, scale: float, head_size: int,
                shared: dict[str, str]) -> tuple[str, str]:
        key = f"rope:{inv_freq.tobytes().hex()}:{scale}"
        if key not in shared:
            angles = np.arange(self.max_length, dtype=np.float64)[:, None] * inv_freq[None, :]  # (max_len, hd/2)
            cos = g.add_initializer("cos_cache", (np.cos(angles) * scale).astype(np.float32))
            sin = g.add_initializer("sin_cache", (np.sin(angles) * scale).astype(np.float32))
            shared[key] = f"{cos}|{sin}"
        cos, sin = shared[key].split("|")
        return cos, sin
