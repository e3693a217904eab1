"""What the passes need to know about a loaded model (``ModelFacts``): layer, head and KV-head counts, head size,
sliding windows, pruned head counts, routed-expert layers; read from the checkpoint's config."""

from __future__ import annotations

from typing import Any

from kiln.compiler import trace_seq2seq
from kiln.compiler.experts import routed_experts
from kiln.compiler.load import Checkpoint
from kiln.compiler.pipeline import ModelFacts
from kiln.errors import UnsupportedModelError


def model_facts(ckpt: Checkpoint) -> ModelFacts:
    cfg = ckpt.config
    if ckpt.kind == "seq2seq":
        s = trace_seq2seq.shapes(ckpt)
        return ModelFacts("seq2seq", s["layers"], s["heads"], s["heads"], s["head_size"], ckpt.max_length)

    def first(*keys: str) -> Any:
        return next((getattr(cfg, k) for k in keys if getattr(cfg, k, None)), None)

    layers = first("num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = first("num_attention_heads", "n_head", "n_heads", "num_heads")
    hidden = first("hidden_size", "dim", "n_embd", "d_model")
    if not (layers and heads and hidden):
        raise UnsupportedModelError(
            f"checkpoint {ckpt.path} ({ckpt.model_type}) has no attention layers kiln can count (config lacks "
            "num_hidden_layers / num_attention_heads / hidden_size); kiln compiles attention Transformers")
    kv = first("num_key_value_heads") or heads
    head_size = first("head_dim") or int(hidden) // int(heads)
    per_layer = tuple(ckpt.pruning["heads_per_layer"]) if ckpt.pruning else ()
    return ModelFacts(ckpt.kind, int(layers), int(heads), int(kv), int(head_size), ckpt.max_length,
                      sliding_windows(cfg, int(layers)), heads_per_layer=per_layer,
                      experts_layers=len(routed_experts(ckpt.model)))


def sliding_windows(cfg: Any, layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full), from ``layer_types`` where the config has them."""
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return (None,) * layers
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
