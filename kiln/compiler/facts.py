"""What the passes need to know about a loaded model (``ModelFacts``): layer, head and KV-head counts, head size,
routed-expert layers; read from the checkpoint's config. Per-layer facts (head counts after pruning, sliding
windows, scales) travel in the captured attention nodes themselves (``kiln.passes.attention_node``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import onnx

from kiln.compiler import trace_seq2seq
from kiln.compiler.expert_loops import loop_experts
from kiln.compiler.experts import routed_experts
from kiln.compiler.load import Checkpoint
from kiln.compiler.pipeline import ModelFacts
from kiln.errors import UnsupportedModelError
from kiln.passes import attention_node


def experts_layers(model: Any) -> int:
    """Routed-experts layers: those transformers' experts registry runs, and those that loop over their tokens."""
    return len(routed_experts(model)) + len(loop_experts(model))


def model_facts(ckpt: Checkpoint) -> ModelFacts:
    cfg = ckpt.config
    if ckpt.kind == "seq2seq":
        s = trace_seq2seq.shapes(ckpt)
        return ModelFacts("seq2seq", s["layers"], s["heads"], s["heads"], s["head_size"], ckpt.max_length)

    def read(key: str) -> Any:
        try:
            return getattr(cfg, key, None)
        except Exception:  # noqa: BLE001 - configs whose per-layer values refuse one global answer
            return None

    def first(*keys: str) -> Any:
        return next((read(k) for k in keys if read(k)), None)

    layers = first("num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = first("num_attention_heads", "n_head", "n_heads", "num_heads")
    hidden = first("hidden_size", "dim", "n_embd", "d_model")
    if not layers:
        raise UnsupportedModelError(
            f"checkpoint {ckpt.path} ({ckpt.model_type}) has no layers kiln can count (config lacks num_hidden_layers "
            "/ n_layer / num_layers); kiln compiles Transformers")
    if not (heads and hidden):  # no attention the config names (a Fourier mixer), or per-layer counts: the graph says
        return ModelFacts(ckpt.kind, int(layers), 0, 0, 0, ckpt.max_length, attentions_per_layer=0,
                          experts_layers=experts_layers(ckpt.model))
    kv = first("num_key_value_heads") or heads
    head_size = first("head_dim") or int(hidden) // int(heads)
    return ModelFacts(ckpt.kind, int(layers), int(heads), int(kv), int(head_size), ckpt.max_length,
                      experts_layers=experts_layers(ckpt.model))


def from_graph(facts: ModelFacts, graph: Path) -> ModelFacts:
    """``facts`` with the head counts and head size the traced graph's captured attention nodes carry, where every
    node agrees: the graph is what runs, and configs name these many ways (multi-query flags, latent attention's
    split heads, a ``head_dim`` that differs from hidden / heads)."""
    model = onnx.load(str(graph), load_external_data=False)
    nodes = [attention_node.read(n) for n in model.graph.node if attention_node.is_captured(n)]
    if not nodes:
        return facts
    seen = {k: {getattr(c, k) for c in nodes} for k in ("q_heads", "kv_heads", "head_size")}
    one = {k: v.pop() if len(v) == 1 else max(v) for k, v in seen.items()}
    return dataclasses.replace(facts, num_heads=one["q_heads"], num_kv_heads=one["kv_heads"],
                               head_size=one["head_size"], captured=len(nodes))
