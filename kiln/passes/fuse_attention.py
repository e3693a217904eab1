"""Attention fusion for ONNX Runtime CPU (encoders): Q/K/V projections + head split + attention +
head merge -> one ``com.microsoft.Attention`` with packed QKV weights and a 2-D key padding mask.

Recognised attention cores, each a rule with its own matcher:
- the exporter's standard ONNX ``Attention`` op (opset 23) on (B, nh, S, hd) inputs;
- the explicit chain MatMul(Q, Kᵀ) -> scale (Mul/Div) -> [mask Add] -> Softmax -> MatMul(V).
Both must be fed by Reshape+Transpose head splits of MatMul(+bias) projections of one input, and
followed by Transpose+Reshape back to (B, S, H); the exporter writes an identity Reshape to (B, -1, S, hd)
before that Transpose when a layer keeps one head (pruning), which is recognised and removed with it.
The head count is read per layer from the Q projection's width and the head size (pruned layers may keep
different counts). A candidate that does not fit says why.

Why not onnxscript's ``rewriter.ort_fusions`` (0.7.2): on the graphs torch.onnx's dynamo exporter writes
at opset 23 (the standard ``Attention`` op) it fuses no attention at all (sdpa/mha/attention counts 0 on
BERT and Llama, measured); its rules match the older explicit MatMul/Softmax chains only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph, attr


@dataclass
class Projection:
    nodes: list[onnx.NodeProto]
    x: str
    weight: np.ndarray
    bias: np.ndarray | None


@dataclass
class Core:
    nodes: list[onnx.NodeProto]  # the attention core, from Q/K/V (B,nh,S,hd) to its output
    q: str
    k: str
    v: str
    out: str
    scale: float | None
    mask: str | None  # the mask tensor the core consumes (any form); traced back to a graph input
    causal: bool
    extra_masks: tuple[str, ...] = ()  # further additive terms (T5: position bias, then the padding mask)


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
        if len(g.consumers[n.output[0]]) != 1:
            raise NoMatch(f"{n.output[0]} has other users; fusing would duplicate it")


def match_projection(g: Graph, value: str, transpose_k: bool = False) -> Projection:
    """value = Transpose(Reshape(MatMul(x, W) [+ b]), perm (0,2,1,3)) -> Projection."""
    x3d, split = match_head_split(g, value, transpose_k)
    proj = match_linear(g, x3d)
    proj.nodes += split
    sole_users(g, proj.nodes)
    return proj


def match_onnx_attention(g: Graph, node: onnx.NodeProto) -> Core:
    if len(node.output) > 1 and any(node.output[1:]):
        raise NoMatch("Attention returns present/qk outputs (KV cache); handled by the KV-cache pass")
    if attr(node, "softcap", 0.0):
        raise NoMatch("softcap is not supported by the fused kernel")
    mask = node.input[3] if len(node.input) > 3 and node.input[3] else None
    scale = attr(node, "scale", None)
    return Core([node], node.input[0], node.input[1], node.input[2], node.output[0], scale, mask,
                bool(attr(node, "is_causal", 0)))


def match_explicit_chain(g: Graph, sm: onnx.NodeProto) -> Core:
    """Softmax over scores = [Add mask](Mul|Div(MatMul(Q, Kt), s)) feeding MatMul(probs, V)."""
    if attr(sm, "axis", -1) not in (-1, 3):
        raise NoMatch("Softmax is not over the last axis")
    out_mm = g.only_consumer(sm.output[0], "MatMul")
    if out_mm is None or out_mm.input[0] != sm.output[0]:
        raise NoMatch("Softmax output does not feed a MatMul with V")
    nodes = [sm, out_mm]
    cur, masks = g.producer.get(sm.input[0]), []
    while cur is not None and cur.op_type == "Add" and len(masks) < 3:  # mask, bias, ... added to the scores
        score_ops = ("Mul", "Div", "MatMul", "Add")
        mask_idx = 1 if g.producer.get(cur.input[0]) is not None and g.producer[cur.input[0]].op_type in score_ops else 0
        masks.insert(0, cur.input[mask_idx])
        nodes.append(cur)
        cur = g.producer.get(cur.input[1 - mask_idx])
    scale = 1.0
    if cur is not None and cur.op_type in ("Mul", "Div"):
        c = g.constant(cur.input[1])
        if c is None or c.size != 1:
            raise NoMatch("score scaling is not by a constant")
        scale = float(c.reshape(())) if cur.op_type == "Mul" else 1.0 / float(c.reshape(()))
        nodes.append(cur)
        cur = g.producer.get(cur.input[0])
    if cur is None or cur.op_type != "MatMul":
        raise NoMatch("scores are not MatMul(Q, Kᵀ)")
    nodes.append(cur)
    for n in nodes[2:]:
        if len(g.consumers[n.output[0]]) != 1:
            raise NoMatch(f"{n.output[0]} has other users")
    return Core(nodes, cur.input[0], cur.input[1], out_mm.input[1], out_mm.output[0], scale, masks[0] if masks else None,
                False, tuple(masks[1:]))


def _identity_head_reshape(g: Graph, out: str, q_split: onnx.NodeProto, head_size: int) -> onnx.NodeProto | None:
    """The Reshape of the attention output (B, nh, S, hd) to (B, -1, S, hd) that the exporter writes for a
    one-head layer, else None. Identity only when its target's batch and sequence are the same Shape slices
    the Q head split (B, S, -1, hd) uses: anything else is left for the merge check to refuse."""
    rs = g.only_consumer(out, "Reshape")
    if rs is None:
        return None
    target, q_target = g.producer.get(rs.input[1]), g.producer.get(q_split.input[1])
    if target is None or q_target is None or target.op_type != "Concat" or q_target.op_type != "Concat" or \
            len(target.input) != 4 or len(q_target.input) != 4:
        return None
    minus_one, size = g.constant(target.input[1]), g.constant(target.input[3])
    if minus_one is None or size is None or minus_one.tolist() != [-1] or size.tolist() != [head_size]:
        return None
    return rs if (target.input[0], target.input[2]) == (q_target.input[0], q_target.input[1]) else None


def attention_candidates(g: Graph) -> list[str]:
    """Handles of every attention core's anchor: the exporter's Attention ops, then explicit Softmaxes."""
    return g.nodes_of("Attention") + g.nodes_of("Softmax")


def match_core(g: Graph, node: onnx.NodeProto) -> Core:
    return match_onnx_attention(g, node) if node.op_type == "Attention" else match_explicit_chain(g, node)


class FuseAttention(Pass):
    """Encoder self-attention -> ``com.microsoft.Attention`` (ONNX Runtime CPU/CUDA)."""

    name = "fuse-attention"

    def __init__(self, head_size: int, mask_input: str = "attention_mask") -> None:
        self.head_size = head_size
        self.mask_input = mask_input

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        fused, skipped = 0, []
        mask_index: str | None = None
        for handle in attention_candidates(g):
            node = g.node(handle)
            if node is None:  # removed by an earlier fusion
                continue
            where = node.name or node.output[0]
            try:
                new, remove, mask_index = self.rewrite(g, match_core(g, node), mask_index)
            except NoMatch as e:
                skipped.append(Reason(where, str(e)))
                continue
            g.replace_nodes(remove, new)
            fused += 1
        if fused:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, fused > 0, {"fused": fused}, skipped)

    def rewrite(self, g: Graph, core: Core, mask_index: str | None):
        if core.causal:
            raise NoMatch("causal attention belongs to the decoder rules")
        if core.extra_masks:
            raise NoMatch("scores get several additive terms (a position bias); the 2-D padding mask cannot carry them")
        q = match_projection(g, core.q)
        k_tr = g.producer.get(core.k)
        k = match_projection(g, core.k, transpose_k=transpose_perm(k_tr) == [0, 2, 3, 1])
        v = match_projection(g, core.v)
        if not (q.x == k.x == v.x):
            raise NoMatch("Q, K and V project different inputs (cross-attention)")
        if not (q.weight.shape == k.weight.shape == v.weight.shape):
            raise NoMatch(f"Q/K/V weights differ in shape {q.weight.shape}, {k.weight.shape}, {v.weight.shape}")
        hidden = q.weight.shape[1]
        if hidden % self.head_size:
            raise NoMatch(f"query width {hidden} is not a whole number of heads of size {self.head_size}")
        num_heads = hidden // self.head_size
        identity = _identity_head_reshape(g, core.out, q.nodes[-2], self.head_size)
        merge_tr = g.only_consumer(identity.output[0] if identity is not None else core.out, "Transpose")
        merge_rs = g.only_consumer(merge_tr.output[0], "Reshape") if merge_tr is not None else None
        if transpose_perm(merge_tr) != [0, 2, 1, 3] or merge_rs is None:
            raise NoMatch("attention output is not merged back by Transpose(0,2,1,3) + Reshape")
        if core.mask is not None and g.ancestors_inputs(core.mask) - {self.mask_input, "input_ids", "token_type_ids"}:
            raise NoMatch(f"mask {core.mask} depends on inputs other than {self.mask_input}")
        if core.mask is not None and self.mask_input not in g.ancestors_inputs(core.mask):
            raise NoMatch(f"mask {core.mask} is not derived from {self.mask_input}")
        if core.mask is None and self.mask_input in g.graph_inputs:
            raise NoMatch("attention ignores the padding mask; fusing would start honouring it")
        inputs = [q.x, g.add_initializer("qkv_weight", np.concatenate([q.weight, k.weight, v.weight], 1))]
        zeros = np.zeros(hidden, dtype=q.weight.dtype)
        biases = [p.bias if p.bias is not None else zeros for p in (q, k, v)]
        inputs.append(g.add_initializer("qkv_bias", np.concatenate(biases).astype(q.weight.dtype)))
        new = []
        if core.mask is not None:
            if mask_index is None:
                mask_index = g.fresh("mask_index")
                new.append(helper.make_node("Cast", [self.mask_input], [mask_index], name=g.fresh("CastMask"),
                                            to=onnx.TensorProto.INT32))
            inputs.append(mask_index)
        scale = core.scale if core.scale is not None else 1.0 / math.sqrt(self.head_size)
        new.append(helper.make_node("Attention", inputs, [merge_rs.output[0]], name=g.fresh("Attention"),
                                    domain=MS_DOMAIN, num_heads=num_heads, scale=float(scale)))
        remove = core.nodes + [n for p in (q, k, v) for n in p.nodes] + [merge_tr, merge_rs] + \
            ([identity] if identity is not None else [])
        return new, remove, mask_index
