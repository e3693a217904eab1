"""Mixture-of-experts layers as the exported graph sees them: every expert is its own pair of MatMuls.

transformers runs routed experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, ...) through its experts-function
registry (``use_experts_implementation``). Its default forward loops over the experts the batch happens to hit
and gathers their tokens (``nonzero``, ``where``, ``index_add_``): data-dependent shapes that ``torch.onnx.export``
cannot turn into a graph. kiln registers one more implementation, ``kiln_dense``, and loads every checkpoint
with it: each expert runs on every token and its output is scaled by that token's routing weight, which is zero
for the experts the router did not pick, so the sum equals the routed one (adding exact zeros). The graph is
then plain MatMuls with 2-D constant weights, one per expert and projection: the passes quantize them like any
other Linear (INT8, INT4, GPTQ) and the router (a MatMul to ``num_experts`` logits, TopK, Softmax) stays FP32.

Each expert is an ``nn.Linear`` pair (``kiln_experts``) whose weights are views of the module's 3-D tensors, so
GPTQ, the fake-quantized reference and the quantizers' bookkeeping, which all work on Linears, need nothing new.

Run as exported, that costs ``num_experts / top_k`` times the routed FLOPs in every MoE layer (2x in the test model,
16x for 128 experts, top 8); the ``fuse-moe`` pass folds each layer back into ONNX Runtime's ``com.microsoft.MoE``
(``QMoE`` once quantized), which computes only the picked experts (kiln/passes/fuse_moe.py). Streaming does not take MoE checkpoints yet: the
expert views have no tensor of their own in the checkpoint (``config_experts`` lets ``stream`` say so).
"""

from __future__ import annotations

from typing import Any

NAME = "kiln_dense"


def dense_experts_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """``hidden_states`` (T, H), ``top_k_index`` / ``top_k_weights`` (T, k) -> (T, H), through ``self.kiln_experts``
    (``attach_linears``); the gate, the activation and a norm after each expert are the module's own."""
    import torch

    experts = torch.arange(self.num_experts, device=top_k_index.device)
    # (T, E): each expert's routing weight per token, zero where it was not picked
    routing = ((top_k_index.unsqueeze(-1) == experts).to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(1)
    out = None
    for e, expert in enumerate(self.kiln_experts):
        h = expert.up(hidden_states)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = expert.down(h)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        h = h * routing[:, e:e + 1]
        out = h if out is None else out + h
    return out.to(hidden_states.dtype)


def attach_linears(module: Any) -> None:
    """Give an experts module one ``nn.Linear`` pair per expert whose weights are views of its 3-D parameters (no
    copy): the quantizers, GPTQ and the fake-quantized model then treat each expert like any other Linear."""
    from torch import nn

    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    pairs = nn.ModuleList()
    for e in range(module.num_experts):
        pair = nn.Module()
        for attr, name in (("up", up_name), ("down", "down_proj")):
            w = getattr(module, name).data[e]
            w = w.T if module.is_transposed else w  # the Linear holds (out, in)
            linear = nn.Linear(w.shape[1], w.shape[0], bias=module.has_bias, device="meta")
            linear.weight = nn.Parameter(w, requires_grad=False)
            if module.has_bias:
                linear.bias = nn.Parameter(getattr(module, f"{name}_bias").data[e], requires_grad=False)
            setattr(pair, attr, linear)
        pairs.append(pair)
    module.kiln_experts = pairs


def config_experts(raw: dict[str, Any]) -> int:
    """How many routed experts a config.json asks for (0: a dense model), from the keys MoE families use."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        v = raw.get(key)
        if isinstance(v, int) and v > 1:
            return v
    return 0


def routed_experts(model: Any) -> list[Any]:
    """The model's experts modules (those transformers dispatches through its experts registry)."""
    return [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "_is_expert_parallel")
            and (hasattr(m, "gate_up_proj") or hasattr(m, "up_proj"))]


def use_dense_experts(model: Any) -> int:
    """Route ``model``'s experts through ``kiln_dense``; returns how many experts modules it has (0: nothing done)."""
    found = routed_experts(model)
    if not found:
        return 0
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, dense_experts_forward)
    for m in found:
        attach_linears(m)
        m.config._experts_implementation = NAME
    experts = {id(m) for m in found}
    for parent in model.modules():  # a router that is an nn.Linear (AFMoE) is marked: GPTQ leaves it in FP32 too
        children = list(parent.children())
        width = next((m.num_experts for m in children if id(m) in experts), None)
        for child in children if width is not None else []:
            if getattr(child, "out_features", None) == width and type(child).__name__ == "Linear":
                child.kiln_router = True
    return len(found)
