"""The captured attention node: ``ai.kiln.CapturedAttention``, one per call of transformers' attention interface.

kiln traces a model with its own function registered where transformers computes attention
(``kiln.compiler.capture``): every family hands that function Q, K and V after its own projections, norms, rotary
and cache update, plus the mask, the scale and the options of the call. The function emits this one node, so no pass
has to rediscover attention from a Softmax or a Transpose; the lowering passes replace it by what the backend runs
best (``fuse-gqa``, ``fuse-attention``, ``fuse-mha``), and ``lower-attention`` turns whatever is left into standard
ONNX ops. No artifact ships this node.

Contract (inputs by position, empty when absent):
- ``query`` (B, Hq, S, Dk), ``key`` (B, Hkv, T, Dk), ``value`` (B, Hkv, T, Dv): Hq a multiple of Hkv (key/value heads
  are shared by Hq / Hkv query heads each, in order);
- ``mask``: boolean (True = attend) or additive float, broadcastable to (B, Hq, S, T); absent = no mask;
- ``sinks`` (Hq,): one extra logit per head that takes part in the softmax and contributes no value (attention sinks);
- ``bias``: additive float scores broadcastable to (B, Hq, S, T) (a relative position bias);
- output ``Y`` (B, S, Hq, Dv), the layout transformers' attention functions return.

Attributes: ``scale`` (scores = Q Kᵀ x scale), ``softcap`` (0: none; scores = softcap x tanh(scores / softcap),
before the mask and bias), ``causal`` (only when there is no mask: key j visible to query i iff j <= i),
``window`` (0: none; the call's sliding window as the model declared it: informational, the mask carries it),
``q_heads``, ``kv_heads``, ``head_size`` (Dk), ``v_head_size`` (Dv), ``layer`` (the module's layer index, -1 unknown).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper
from onnx.defs import OpSchema

DOMAIN = "ai.kiln"
OP = "CapturedAttention"
INPUTS = ("query", "key", "value", "mask", "sinks", "bias")
FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]


@dataclass(frozen=True)
class Captured:
    """One captured attention call, read from its node."""

    node: onnx.NodeProto
    q: str
    k: str
    v: str
    mask: str | None
    sinks: str | None
    bias: str | None
    out: str
    scale: float
    softcap: float
    causal: bool
    window: int
    q_heads: int
    kv_heads: int
    head_size: int
    v_head_size: int
    layer: int

    @property
    def where(self) -> str:
        return self.node.name or self.out


def is_captured(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type == OP


def read(node: onnx.NodeProto) -> Captured:
    ins = list(node.input) + [""] * (len(INPUTS) - len(node.input))
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    return Captured(node, ins[0], ins[1], ins[2], ins[3] or None, ins[4] or None, ins[5] or None, node.output[0],
                    float(a.get("scale", 1.0)), float(a.get("softcap", 0.0)), bool(a.get("causal", 0)),
                    int(a.get("window", 0)), int(a["q_heads"]), int(a["kv_heads"]), int(a["head_size"]),
                    int(a.get("v_head_size", a["head_size"])), int(a.get("layer", -1)))


def make(inputs: list[str], output: str, name: str, *, scale: float, q_heads: int, kv_heads: int, head_size: int,
         v_head_size: int, causal: bool = False, window: int = 0, softcap: float = 0.0, layer: int = -1
         ) -> onnx.NodeProto:
    while inputs and not inputs[-1]:
        inputs = inputs[:-1]
    return helper.make_node(OP, inputs, [output], name=name, domain=DOMAIN, scale=float(scale), causal=int(causal),
                            window=int(window), softcap=float(softcap), q_heads=int(q_heads), kv_heads=int(kv_heads),
                            head_size=int(head_size), v_head_size=int(v_head_size), layer=int(layer))


def register_schema() -> None:
    """Tell ONNX (its checker and shape inference, and onnxscript, which the exporter builds nodes with) what the node
    is. Idempotent."""
    if onnx.defs.has(OP, DOMAIN):
        return
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    attrs = [OpSchema.Attribute(n, OpSchema.AttrType.FLOAT, "") for n in ("scale", "softcap")]
    attrs += [OpSchema.Attribute(n, OpSchema.AttrType.INT, "") for n in
              ("causal", "window", "q_heads", "kv_heads", "head_size", "v_head_size", "layer")]
    schema = OpSchema(
        OP, DOMAIN, 1, doc=__doc__ or "",
        inputs=[param("query", "T"), param("key", "T"), param("value", "T"), param("mask", "M", param_option=optional),
                param("sinks", "T", param_option=optional), param("bias", "T", param_option=optional)],
        outputs=[param("Y", "T")],
        type_constraints=[("T", FLOATS, "queries, keys, values"), ("M", ["tensor(bool)", *FLOATS], "mask")],
        attributes=attrs)
    onnx.defs.register_schema(schema)


register_schema()
