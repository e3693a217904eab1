"""Captured attention -> ``com.microsoft.MultiHeadAttention`` (ONNX Runtime CPU/CUDA), keeping Q, K and V as
separate MatMuls (so static INT8 can wrap them in Q/DQ pairs and INT4 can quantize them) and taking the three
attentions of an encoder-decoder:
- self-attention without a cache (encoders): Q, K, V as (B, S, H x D);
- decoder self-attention with a cache: K and V are Concat(past graph input, new keys) whose result is the
  ``present`` graph output -> MHA's past_key / past_value inputs and present outputs;
- cross-attention: K and V are the encoder's cross keys / values, graph inputs already in (batch, heads, source,
  head size) layout -> passed to MHA as they are.
The model's mask (padding, causal, a window, whatever it computed) and a relative position bias become MHA's additive
``attention_bias``, so the rewrite needs no knowledge of how a family builds its masks. What MHA does not take (soft-cap,
sinks, fewer KV heads than query heads, causal attention without a mask) stays for ``lower-attention``.
"""

from __future__ import annotations

import onnx

from kiln.passes import attention_node as an
from kiln.passes.base import NoMatch, Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Constants, Graph, attr
from kiln.passes.matching import additive, flat_operand, operand, unflatten
from kiln.passes.pin_norms import value_types


class FuseMultiHeadAttention(Pass):
    name = "fuse-mha"

    def run(self, model: onnx.ModelProto) -> PassResult:
        types = value_types(model)
        g = Graph(model)
        consts, shared = Constants(g), {}
        stats = {"fused": 0, "self": 0, "cached_self": 0, "cross": 0}
        skipped = []
        for handle in [n.output[0] for n in g.g.node if an.is_captured(n)]:
            c = an.read(g.node(handle))
            try:
                plan = self.match(g, c, types)
            except NoMatch as e:
                skipped.append(Reason(c.where, str(e)))
                continue
            new, remove = self.emit(g, c, plan, types, consts, shared)
            g.replace_nodes(remove, new)
            stats["fused"] += 1
            stats[{"cached": "cached_self"}.get(plan[0], plan[0])] += 1
        if stats["fused"]:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, stats["fused"] > 0, stats, skipped)

    @staticmethod
    def _kv(g: Graph, c: an.Captured, value: str):
        """K or V -> ("self", Operand) | ("cached", (past, new operand, present)) | ("cross", BNSH graph input)."""
        if value in g.graph_inputs:
            return "cross", value
        p = g.producer.get(value)
        if p is not None and p.op_type == "Concat" and len(p.input) == 2 and p.input[0] in g.graph_inputs \
                and value in g.graph_outputs and attr(p, "axis", 0) in (-2, 2):
            return "cached", (p.input[0], operand(g, p.input[1], p, rotary=False), value, p)
        return "self", operand(g, value, c.node, rotary=False)

    def match(self, g: Graph, c: an.Captured, types: dict[str, int]):
        if c.sinks is not None or c.softcap:
            raise NoMatch("attention sinks or a soft-cap, which MultiHeadAttention does not take")
        if c.q_heads != c.kv_heads or c.head_size != c.v_head_size:
            raise NoMatch(f"{c.q_heads} query / {c.kv_heads} KV heads of {c.head_size} / {c.v_head_size} features: "
                          "MultiHeadAttention takes equal heads")
        if c.mask is None and c.causal:
            raise NoMatch("causal attention without an explicit mask")
        for m in (c.mask, c.bias):
            if m is not None and types.get(m) is None:
                raise NoMatch(f"type of mask {m} is unknown, so it cannot be turned into an additive bias")
        k_kind, k = self._kv(g, c, c.k)
        v_kind, v = self._kv(g, c, c.v)
        if k_kind != v_kind:
            raise NoMatch(f"K is {k_kind} but V is {v_kind}")
        return k_kind, operand(g, c.q, c.node, rotary=False), k, v

    def emit(self, g: Graph, c: an.Captured, plan, types: dict[str, int], consts: Constants, shared: dict[str, str]):
        kind, q, k, v = plan
        new: list[onnx.NodeProto] = []
        remove = [c.node] + q.nodes
        inputs = [flat_operand(g, new, q, c.q_heads, c.head_size, consts), "", "", "", "",
                  additive(g, new, c, types, consts, shared), "", ""]
        outputs = [g.fresh("mha_out")]
        if kind == "cached":
            (past_k, new_k, present_k, cat_k), (past_v, new_v, present_v, cat_v) = k, v
            inputs[1] = flat_operand(g, new, new_k, c.kv_heads, c.head_size, consts)
            inputs[2] = flat_operand(g, new, new_v, c.kv_heads, c.v_head_size, consts)
            inputs[6], inputs[7] = past_k, past_v
            outputs += [present_k, present_v]
            remove += [cat_k, cat_v] + new_k.nodes + new_v.nodes
        elif kind == "cross":
            inputs[1], inputs[2] = k, v
        else:
            inputs[1] = flat_operand(g, new, k, c.kv_heads, c.head_size, consts)
            inputs[2] = flat_operand(g, new, v, c.kv_heads, c.v_head_size, consts)
            remove += k.nodes + v.nodes
        while not inputs[-1]:
            inputs.pop()
        new.append(onnx.helper.make_node("MultiHeadAttention", inputs, outputs, name=g.fresh("MultiHeadAttention"),
                                         domain=MS_DOMAIN, num_heads=c.q_heads, scale=c.scale))
        new += unflatten(g, outputs[0], c, consts)
        return new, list({id(n): n for n in remove}.values())
