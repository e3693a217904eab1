"""Structured pruning of the eager model before export: whole attention heads and whole FFN channels.

``--prune heads=R,ffn=R`` removes that fraction of every layer's query heads and FFN channels (the same count
in every layer, so the fused attention kernels see one head count), chosen on calibration text:
- ``magnitude``: the weights only (no data): the norm of the output projection's columns a head or channel
  writes through (``o_proj``/``attention.output.dense``, ``down_proj``/``output.dense``);
- ``wanda``: |W| times the norm of the column's input over calibration tokens, summed per head or channel;
- ``flap`` (default): input fluctuation, the variance of each column's input over calibration tokens times the
  squared norm of its weight column; the removed columns' mean contribution is folded into the output
  projection's bias (exact when a removed input never varies).
Grouped-query models drop the same number of query heads inside every KV group (the grouped kernel still
applies); when a group holds one query head the whole KV head goes with it.

Families: BERT-style encoders (``attention.self.query/key/value``, ``attention.output.dense``,
``intermediate.dense``, ``output.dense``) and Llama-style decoders (``self_attn.q/k/v/o_proj``,
``mlp.gate/up/down_proj``). Other layouts are refused with the module names kiln looked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.errors import UnsupportedModelError, UsageError

METHODS = ("flap", "wanda", "magnitude")
COST_KEYS = {"cosine": "cosine_min", "ppl": "ppl_increase_pct", "top1": "top1_agreement", "kl": "kl_mean"}
"""--max-drop metric -> the ``cost`` entry that measures it."""
COMPONENTS = ("heads", "ffn")


@dataclass(frozen=True)
class Spec:
    heads: float = 0.0
    ffn: float = 0.0
    method: str = "flap"
    auto: bool = False
    """``--prune auto``: the largest equal heads/FFN ratio that meets ``--max-drop`` (``build.prune_checkpoint``)."""


def parse(text: str, method: str = "flap") -> Spec:
    """``heads=0.25,ffn=0.25`` -> Spec; every ratio in [0, 1). ``auto``: chosen under the budget."""
    if method not in METHODS:
        raise UsageError(f"--prune-method {method!r} is unknown; choose one of {', '.join(METHODS)}")
    if text.strip() == "auto":
        return Spec(method=method, auto=True)
    ratios: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in COMPONENTS or not value:
            raise UsageError(f"--prune {text!r}: give COMPONENT=RATIO pairs, components {', '.join(COMPONENTS)} "
                             "(e.g. heads=0.25,ffn=0.25), or auto with --max-drop")
        try:
            r = float(value)
        except ValueError as e:
            raise UsageError(f"--prune {text!r}: {value!r} is not a number") from e
        if not 0 <= r < 1:
            raise UsageError(f"--prune {text!r}: a ratio is in [0, 1) (got {name}={value})")
        ratios[name] = r
    return Spec(ratios.get("heads", 0.0), ratios.get("ffn", 0.0), method)


@dataclass
class Layer:
    """One Transformer layer's prunable modules."""

    qkv: list[Any]  # query, key, value Linears (key/value: the KV heads)
    out: Any  # the attention output projection (its input columns: the heads)
    ffn_in: list[Any]  # Linears producing the FFN channels (gate and up, or intermediate)
    ffn_out: Any  # the FFN output projection (its input columns: the channels)
    attn: Any  # the attention module (its head attributes are updated)


def layers(model: Any, num_layers: int) -> list[Layer]:
    from kiln.compiler.quantize.gptq import transformer_blocks

    try:
        blocks = transformer_blocks(model, num_layers)
    except ValueError as e:
        raise UnsupportedModelError(f"{type(model).__name__}: {e}; kiln prunes BERT- and Llama-style layers") from e
    out = []
    for b in blocks:
        if hasattr(b, "self_attn") and hasattr(b, "mlp") and hasattr(b.mlp, "down_proj"):
            a, m = b.self_attn, b.mlp
            out.append(Layer([a.q_proj, a.k_proj, a.v_proj], a.o_proj, [m.gate_proj, m.up_proj], m.down_proj, a))
        elif hasattr(b, "attention") and hasattr(b, "intermediate") and hasattr(b.attention, "self"):
            s = b.attention.self
            out.append(Layer([s.query, s.key, s.value], b.attention.output.dense, [b.intermediate.dense],
                             b.output.dense, s))
        else:
            raise UnsupportedModelError(
                f"{type(model).__name__}: kiln prunes layers with self_attn.q/k/v/o_proj + mlp.gate/up/down_proj "
                f"(Llama) or attention.self + intermediate + output (BERT); {type(b).__name__} has neither")
    return out


class Inputs:
    """Per-column sum, sum of squares and count of a Linear's input over calibration tokens (float64)."""

    def __init__(self) -> None:
        self.s = self.sq = None
        self.n = 0

    def add(self, x: Any) -> None:
        import torch

        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        s, sq = x.sum(0), (x * x).sum(0)
        self.s, self.sq = (s, sq) if self.s is None else (self.s + s, self.sq + sq)
        self.n += x.shape[0]

    @property
    def mean(self) -> Any:
        return self.s / self.n

    @property
    def var(self) -> Any:
        return (self.sq / self.n - self.mean ** 2).clamp(min=0)

    @property
    def norm(self) -> Any:
        return self.sq.sqrt()


def column_scores(w: Any, inputs: Inputs | None, method: str) -> Any:
    """Importance of each input column of an output projection ``w`` (out, in)."""
    w = w.detach().to(inputs.s.dtype if inputs is not None else w.dtype)
    if method == "magnitude" or inputs is None:
        return (w * w).sum(0)
    if method == "wanda":
        return w.abs().sum(0) * inputs.norm
    return inputs.var * (w * w).sum(0)  # flap: fluctuation


def prune(model: Any, num_layers: int, num_heads: int, num_kv_heads: int, head_size: int, spec: Spec,
          feeds: Sequence[dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """Prune ``model`` in place (and its config); return what was removed, per layer."""
    import torch

    found = layers(model, num_layers)
    stats: dict[int, tuple[Inputs, Inputs]] = {}
    if spec.method != "magnitude":
        hooks = []
        for i, layer in enumerate(found):
            stats[i] = (Inputs(), Inputs())
            hooks += [layer.out.register_forward_pre_hook(lambda m, a, s=stats[i][0]: s.add(a[0])),
                      layer.ffn_out.register_forward_pre_hook(lambda m, a, s=stats[i][1]: s.add(a[0]))]
        try:
            with torch.no_grad():
                for f in feeds:
                    model(**f)
        finally:
            for h in hooks:
                h.remove()
    group = num_heads // num_kv_heads
    drop_per_group = round(spec.heads * group) if group > 1 else 0
    drop_kv = round(spec.heads * num_kv_heads) if group == 1 else 0
    heads_left = num_heads - drop_per_group * num_kv_heads - drop_kv * group
    if spec.heads and heads_left == num_heads:
        raise UsageError(f"--prune heads={spec.heads}: rounds to no head of {num_heads} (KV groups of {group}); "
                         f"give at least {1 / (group if group > 1 else num_kv_heads):.3g}")
    if heads_left < 1:
        raise UsageError(f"--prune heads={spec.heads} would leave a layer with no attention heads; give less")
    record = []
    inter = found[0].ffn_out.in_features
    drop_ffn = int(round(spec.ffn * inter))
    if drop_ffn >= inter:
        raise UsageError(f"--prune ffn={spec.ffn} would leave a layer with no FFN channels; give less")
    for i, layer in enumerate(found):
        head_in, ffn_in = stats.get(i, (None, None))
        col = column_scores(layer.out.weight, head_in, spec.method)
        per_head = col.reshape(num_heads, head_size).sum(1)
        keep_heads = []
        if drop_kv:  # one query head per KV head: whole KV heads go
            keep_kv = sorted(per_head.argsort(descending=True)[:num_kv_heads - drop_kv].tolist())
            keep_heads = keep_kv
        else:
            keep_kv = list(range(num_kv_heads))
            for g in range(num_kv_heads):
                members = per_head[g * group:(g + 1) * group]
                kept = sorted(members.argsort(descending=True)[:group - drop_per_group].tolist())
                keep_heads += [g * group + k for k in kept]
        ch = column_scores(layer.ffn_out.weight, ffn_in, spec.method)
        keep_ch = sorted(ch.argsort(descending=True)[:inter - drop_ffn].tolist())
        removed_heads = sorted(set(range(num_heads)) - set(keep_heads))
        removed_ch = sorted(set(range(inter)) - set(keep_ch))
        head_cols = [h * head_size + j for h in keep_heads for j in range(head_size)]
        kv_cols = [h * head_size + j for h in keep_kv for j in range(head_size)]
        with torch.no_grad():
            if spec.method == "flap":  # the removed columns' mean contribution, into the bias
                for lin, inputs, removed in ((layer.out, head_in, [h * head_size + j for h in removed_heads
                                                                  for j in range(head_size)]),
                                             (layer.ffn_out, ffn_in, removed_ch)):
                    if removed:
                        _add_bias(lin, lin.weight[:, removed].to(torch.float64) @ inputs.mean[removed])
            _rows(layer.qkv[0], head_cols)
            for lin in layer.qkv[1:]:  # key and value: the KV heads kept
                _rows(lin, kv_cols)
            _cols(layer.out, head_cols)
            for lin in layer.ffn_in:
                _rows(lin, keep_ch)
            _cols(layer.ffn_out, keep_ch)
        _update_attention(layer.attn, len(keep_heads), len(keep_kv), head_size)
        record.append({"layer": i, "heads_removed": removed_heads, "ffn_removed": len(removed_ch)})
    cfg = model.config
    cfg.head_dim = head_size
    cfg.num_attention_heads = heads_left
    if hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = num_kv_heads - drop_kv
    cfg.intermediate_size = inter - drop_ffn
    say(f"prune ({spec.method}): heads {num_heads} -> {heads_left} per layer, FFN channels {inter} -> "
        f"{inter - drop_ffn}")
    return {"method": spec.method, "heads": spec.heads, "ffn": spec.ffn, "heads_per_layer": [num_heads, heads_left],
            "kv_heads_per_layer": [num_kv_heads, num_kv_heads - drop_kv], "ffn_per_layer": [inter, inter - drop_ffn],
            "calibration_tokens": sum(int(f["attention_mask"].sum()) for f in feeds) if stats else 0, "layers": record}


def _rows(lin: Any, keep: list[int]) -> None:
    import torch

    lin.weight = torch.nn.Parameter(lin.weight.detach()[keep].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = torch.nn.Parameter(lin.bias.detach()[keep].clone(), requires_grad=False)
    lin.out_features = len(keep)


def _cols(lin: Any, keep: list[int]) -> None:
    import torch

    lin.weight = torch.nn.Parameter(lin.weight.detach()[:, keep].clone(), requires_grad=False)
    lin.in_features = len(keep)


def _add_bias(lin: Any, delta: Any) -> None:
    import torch

    delta = delta.to(lin.weight.dtype)
    lin.bias = torch.nn.Parameter(delta.clone() if lin.bias is None else lin.bias.detach() + delta,
                                  requires_grad=False)


def _update_attention(attn: Any, heads: int, kv_heads: int, head_size: int) -> None:
    if hasattr(attn, "num_attention_heads"):  # BERT
        attn.num_attention_heads, attn.all_head_size = heads, heads * head_size
    if hasattr(attn, "num_key_value_groups"):  # Llama: heads per KV head
        attn.num_key_value_groups = heads // kv_heads


def torch_feeds(ckpt: Any, texts: Sequence[str], batch: int = 16) -> list[dict[str, Any]]:
    """Texts as padded torch batches (the checkpoint's padding side), at most 128 tokens each."""
    import torch

    tok = ckpt.tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(list(texts[i:i + batch]), padding=True, truncation=True, max_length=min(128, ckpt.max_length),
                  return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return [f for f in out if int(torch.as_tensor(f["attention_mask"]).sum()) > 0]


def cost(original: Any, pruned: Any, feeds: Sequence[dict[str, Any]], kind: str) -> dict[str, float]:
    """The pruned model against the original on ``feeds``: encoders the mean-pooled last hidden state's cosine
    (min and mean over texts); decoders perplexity increase (%), top-1 agreement and mean KL."""
    import numpy as np
    import torch

    from kiln.compiler.quantize.budget import next_token_metrics
    from kiln.compiler.verify import metrics

    refs, gots, np_feeds = [], [], []
    with torch.no_grad():
        for f in feeds:
            a, b = original(**f)[0].double(), pruned(**f)[0].double()
            m = f["attention_mask"]
            if kind == "encoder":
                w = m[..., None].double()
                a, b = (a * w).sum(1) / w.sum(1), (b * w).sum(1) / w.sum(1)
            refs.append(a.numpy())
            gots.append(b.numpy())
            np_feeds.append({k: v.numpy() for k, v in f.items()})
    if kind == "encoder":
        r, g = np.concatenate(refs), np.concatenate(gots)
        cos = metrics.row_cosines(r, g)
        return {"texts": int(len(r)), "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean())}
    out = next_token_metrics(refs, gots, np_feeds)
    return {"texts": int(sum(len(f["input_ids"]) for f in feeds)), "ppl_increase_pct": out["ppl"],
            "top1_agreement": out["top1"], "kl_mean": out["kl"]}

