"""Encoder-decoder attention -> ``com.microsoft.MultiHeadAttention`` (ONNX Runtime CPU/CUDA).

One rule covers the three attentions of T5 and BART, for the exporter's ``Attention`` op and for
the explicit MatMul -> [scale] -> [mask Add] -> Softmax -> MatMul chain (T5's eager attention):
- self-attention without a cache (encoders): Q, K, V are head splits of projections;
- decoder self-attention with a cache: K and V are Concat(past graph input, new head split) whose
  result is the ``present`` graph output -> MHA's past_key/past_value inputs and present outputs;
- cross-attention: K and V are the encoder's cross keys/values, graph inputs already in
  (batch, heads, source, head size) layout -> passed to MHA as they are, never re-projected.
The mask the model computed (padding, causal, T5's relative position bias, or all of them) is kept
exactly: a boolean mask becomes an additive bias (0 / float32 min), a float one is used as is, as
MHA's ``attention_bias``. So the rewrite needs no knowledge of how a family builds its masks.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.fuse_attention import Core, NoMatch, attention_candidates, match_core, match_head_split
from kiln.passes.graph import MS_DOMAIN, Graph, attr
from kiln.passes.pin_norms import value_types


class FuseMultiHeadAttention(Pass):
    name = "fuse-mha"

    def __init__(self, num_heads: int, head_size: int) -> None:
        self.num_heads = num_heads
        self.head_size = head_size

    def run(self, model: onnx.ModelProto) -> PassResult:
        types = value_types(model)  # is a mask boolean (-> additive bias) or already additive?
        g = Graph(model)
        biases: dict[str, str] = {}  # mask -> its additive bias, built once per graph (this run's state only)
        stats = {"fused": 0, "self": 0, "cached_self": 0, "cross": 0}
        skipped = []
        for handle in attention_candidates(g):
            node = g.node(handle)
            if node is None:
                continue
            try:
                new, remove, kind = self.rewrite(g, match_core(g, node), types, biases)
            except NoMatch as e:
                skipped.append(Reason(node.name or handle, str(e)))
                continue
            g.replace_nodes(remove, new)
            stats["fused"] += 1
            stats[kind] += 1
        if stats["fused"]:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, stats["fused"] > 0, stats, skipped)

    def _kv(self, g: Graph, value: str, transposed: bool):
        """K or V -> ("self", 3-D source, nodes) | ("cached", (past, new 3-D, present), nodes) | ("cross", BNSH input, nodes)."""
        nodes = []
        p = g.producer.get(value)
        if transposed:  # explicit chain: scores use Kᵀ
            if p is None or p.op_type != "Transpose" or list(attr(p, "perm", [])) not in ([0, 1, 3, 2], [0, 2, 3, 1]):
                raise NoMatch(f"K {value} is not transposed for the score MatMul")
            if list(attr(p, "perm", [])) == [0, 2, 3, 1]:  # head split straight into Kᵀ
                x3d, split = match_head_split(g, value, transpose_k=True)
                return "self", x3d, split
            nodes.append(p)
            value = p.input[0]
            p = g.producer.get(value)
        if value in g.graph_inputs:
            return "cross", value, nodes
        if p is not None and p.op_type == "Concat" and len(p.input) == 2 and p.input[0] in g.graph_inputs \
                and value in g.graph_outputs and attr(p, "axis", 0) in (-2, 2):
            x3d, split = match_head_split(g, p.input[1])
            return "cached", (p.input[0], x3d, value), nodes + [p] + split
        x3d, split = match_head_split(g, value)
        return "self", x3d, nodes + split

    @staticmethod
    def _check_mask(mask: str, types: dict[str, int]) -> None:
        if types.get(mask) is None:
            raise NoMatch(f"type of mask {mask} is unknown, so it cannot be turned into an additive bias")

    @staticmethod
    def _attention_bias(g: Graph, mask: str, new: list, types: dict[str, int], biases: dict[str, str]) -> str:
        """The additive form of ``mask`` (checked by ``_check_mask`` first), built once per graph."""
        if mask in biases:
            return biases[mask]
        dtype = types[mask]
        if dtype == TensorProto.FLOAT:
            biases[mask] = mask
            return mask
        zero = g.add_initializer("mha_zero", np.array(0.0, np.float32))
        neg = g.add_initializer("mha_neg", np.array(np.finfo(np.float32).min, np.float32))
        out = g.fresh("mha_bias")
        cond = mask
        if dtype != TensorProto.BOOL:
            cond = g.fresh("mha_mask_bool")
            new.append(helper.make_node("Cast", [mask], [cond], to=TensorProto.BOOL, name=g.fresh("MaskBool")))
        new.append(helper.make_node("Where", [cond, zero, neg], [out], name=g.fresh("MaskBias")))
        biases[mask] = out
        return out

    def rewrite(self, g: Graph, core: Core, types: dict[str, int], biases: dict[str, str]):
        """Check the whole block (raising NoMatch with the reason), then build: a refused block leaves the
        graph, and the biases shared by later blocks, exactly as they were."""
        if core.causal:
            raise NoMatch("is_causal attention without an explicit mask is not rewritten")
        chain = core.nodes[0].op_type == "Softmax"
        q3d, q_nodes = match_head_split(g, core.q)
        k_kind, k_src, k_nodes = self._kv(g, core.k, transposed=chain)
        v_kind, v_src, v_nodes = self._kv(g, core.v, transposed=False)
        if k_kind != v_kind:
            raise NoMatch(f"K is {k_kind} but V is {v_kind}")
        merge_tr = g.only_consumer(core.out, "Transpose")
        merge_rs = g.only_consumer(merge_tr.output[0], "Reshape") if merge_tr is not None else None
        if merge_tr is None or list(attr(merge_tr, "perm", [])) != [0, 2, 1, 3] or merge_rs is None:
            raise NoMatch("attention output is not merged back by Transpose(0,2,1,3) + Reshape")
        for n in q_nodes + k_nodes + v_nodes:
            users = g.consumers[n.output[0]]
            if n.output[0] not in g.graph_outputs and len(users) != 1:
                raise NoMatch(f"{n.output[0]} has other users; fusing would duplicate it")
        for mask in ((core.mask,) if core.mask is not None else ()) + core.extra_masks:
            self._check_mask(mask, types)
        # --- every check passed: from here on the graph changes
        new: list[onnx.NodeProto] = []
        bias = self._attention_bias(g, core.mask, new, types, biases) if core.mask is not None else ""
        for extra in core.extra_masks:  # T5: relative position bias + padding mask, summed once for all layers
            key = f"sum:{bias}:{extra}"
            if key not in biases:
                biases[key] = g.fresh("mha_bias_sum")
                new.append(helper.make_node("Add", [bias, self._attention_bias(g, extra, new, types, biases)],
                                            [biases[key]], name=g.fresh("BiasSum")))
            bias = biases[key]
        inputs = [q3d, "", "", "", "", bias, "", ""]
        outputs = [g.fresh("mha_out")]
        if k_kind == "cached":
            (past_k, k3d, present_k), (past_v, v3d, present_v) = k_src, v_src
            inputs[1], inputs[2], inputs[6], inputs[7] = k3d, v3d, past_k, past_v
            outputs += [present_k, present_v]
        else:
            inputs[1], inputs[2] = k_src, v_src
        while inputs and not inputs[-1]:
            inputs.pop()
        scale = core.scale if core.scale is not None else self.head_size ** -0.5
        new.append(helper.make_node("MultiHeadAttention", inputs, outputs, name=g.fresh("MultiHeadAttention"),
                                    domain=MS_DOMAIN, num_heads=self.num_heads, scale=float(scale)))
        new.append(helper.make_node("Reshape", [outputs[0], merge_rs.input[1]], [merge_rs.output[0]], name=merge_rs.name))
        remove = core.nodes + q_nodes + k_nodes + v_nodes + [merge_tr, merge_rs]
        return new, remove, {"self": "self", "cached": "cached_self", "cross": "cross"}[k_kind]
