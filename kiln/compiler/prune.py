"""Structured pruning of the eager model before export: whole attention heads and whole FFN channels.

``--prune heads=R,ffn=R`` removes that fraction of every layer's query heads and FFN channels, chosen on
calibration text:
- ``magnitude``: the weights only (no data): the norm of the output projection's columns a head or channel
  writes through (``o_proj``/``attention.output.dense``, ``down_proj``/``output.dense``);
- ``wanda``: |W| times the norm of the column's input over calibration tokens, summed per head or channel;
- ``flap`` (default): input fluctuation, the variance of each column's input over calibration tokens times the
  squared norm of its weight column; the removed columns' mean contribution is folded into the output
  projection's bias (exact when a removed input never varies).
Grouped-query models drop the same number of query heads inside every KV group (the grouped kernel still
applies); when a group holds one query head the whole KV head goes with it.

Per-layer counts: by default the same count leaves every layer. ``--prune-layers adaptive`` takes the same
total where FLAP's per-layer standardised scores are lowest across the model (FLAP's structure search), so
layers keep different head and channel counts (recorded per layer; the fusion passes read them). Measured on
the two real models here it costs more than uniform counts (docs/pruning.md), hence not the default. A decoder
whose KV groups hold one query head keeps uniform head counts (one KV-cache layout for every layer).

Families: BERT-style encoders (``attention.self.query/key/value``, ``attention.output.dense``,
``intermediate.dense``, ``output.dense``) and Llama-style decoders (``self_attn.q/k/v/o_proj``,
``mlp.gate/up/down_proj``). Other layouts are refused with the module names kiln looked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.compiler.options import PruneSpec
from kiln.errors import UnsupportedModelError, UsageError

COST_KEYS = {"cosine": "cosine_min", "ppl": "ppl_increase_pct", "top1": "top1_agreement", "kl": "kl_mean"}
"""--max-drop metric -> the ``cost`` entry that measures it."""


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

    blocks = transformer_blocks(model, num_layers)
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


def prune(model: Any, num_layers: int, num_heads: int, num_kv_heads: int, head_size: int, spec: PruneSpec,
          feeds: Sequence[dict[str, Any]], say: Callable[[str], None], kv_cache: bool = False) -> dict[str, Any]:
    """Prune ``model`` in place (and its config); return what was removed, per layer. ``kv_cache``: a decoder,
    whose KV heads must stay the same in every layer (one cache layout), so whole-KV-head removal stays uniform."""
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
    inter = found[0].ffn_out.in_features
    head_scores, ch_scores = [], []
    for i, layer in enumerate(found):
        head_in, ffn_in = stats.get(i, (None, None))
        head_scores.append(column_scores(layer.out.weight, head_in, spec.method))
        ch_scores.append(column_scores(layer.ffn_out.weight, ffn_in, spec.method))
    plan = Plan.make(spec, head_scores, ch_scores, num_heads, num_kv_heads, head_size, kv_cache)
    record = []
    for i, layer in enumerate(found):  # every count checked in the plan: from here on the model changes
        head_in, ffn_in = stats.get(i, (None, None))
        keep_heads, keep_kv, keep_ch = plan.heads[i], plan.kv[i], plan.channels[i]
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
        record.append({"layer": i, "heads": len(keep_heads), "ffn": len(keep_ch), "heads_removed": removed_heads,
                       "ffn_removed": len(removed_ch)})
    heads_per_layer = [r["heads"] for r in record]
    ffn_per_layer = [r["ffn"] for r in record]
    cfg = model.config
    cfg.head_dim = head_size
    cfg.num_attention_heads = max(heads_per_layer)  # per layer: the record (and ModelFacts.heads_per_layer)
    if hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = len(plan.kv[0])
    cfg.intermediate_size = max(ffn_per_layer)
    say(f"prune ({spec.method}{', per-layer counts' if plan.adaptive else ''}): heads {num_heads} -> "
        f"{span(heads_per_layer)} per layer, FFN channels {inter} -> {span(ffn_per_layer)}")
    return {"method": spec.method, "heads": spec.heads, "ffn": spec.ffn, "adaptive": plan.adaptive,
            "original": {"heads": num_heads, "kv_heads": num_kv_heads, "ffn": inter},
            "kv_heads": len(plan.kv[0]), "heads_per_layer": heads_per_layer, "ffn_per_layer": ffn_per_layer,
            "heads_removed_total": num_layers * num_heads - sum(heads_per_layer),
            "ffn_removed_total": num_layers * inter - sum(ffn_per_layer),
            "calibration_tokens": sum(int(f["attention_mask"].sum()) for f in feeds) if stats else 0, "layers": record}


def span(counts: list[int]) -> str:
    """Per-layer counts for reading: ``9`` when every layer kept 9, ``5-12`` otherwise."""
    return str(counts[0]) if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}"


def summary(pruning: dict[str, Any], lat: dict[str, Any] | None = None) -> dict[str, Any]:
    """What --prune removed and cost (against the original, held-out text), and, given verification's ``lat``,
    what it gained: the artifact's latency against the original eager model, timed on the same feeds."""
    out = {k: pruning[k] for k in ("method", "adaptive", "original", "heads_per_layer", "ffn_per_layer", "cost")
           if k in pruning}
    if lat and pruning.get("original_eager_ms"):
        out["original_eager_ms"] = pruning["original_eager_ms"]
        out["speedup_vs_original_eager"] = pruning["original_eager_ms"] / lat["artifact_ms"]
        out["eager_speedup"] = pruning["original_eager_ms"] / lat["eager_ms"]
    return out


def _standardised(x: Any) -> Any:
    """FLAP's per-layer standardisation: scores of one layer to zero mean and unit deviation, so one global
    threshold compares layers whose raw scores differ by orders of magnitude."""
    sd = x.std()
    return (x - x.mean()) / (sd if float(sd) > 0 else 1.0)


@dataclass
class Plan:
    """What every layer keeps (query heads, KV heads, FFN channels: sorted indices), decided before any change."""

    heads: list[list[int]]
    kv: list[list[int]]
    channels: list[list[int]]
    adaptive: bool

    @classmethod
    def make(cls, spec: PruneSpec, head_scores: list[Any], ch_scores: list[Any], num_heads: int, num_kv_heads: int,
             head_size: int, kv_cache: bool) -> Plan:
        """Uniform (the default): the same count leaves every layer. Adaptive: the same total leaves the model,
        taken where the per-layer standardised scores are lowest (FLAP's across-layer structure); query heads by
        group slots (a layer drops its k weakest heads in every KV group together), whole KV heads only where no
        KV cache fixes their count."""
        layers, inter = len(head_scores), ch_scores[0].numel()
        group = num_heads // num_kv_heads
        drop_per_group = round(spec.heads * group) if group > 1 else 0
        drop_kv = round(spec.heads * num_kv_heads) if group == 1 else 0
        heads_left = num_heads - drop_per_group * num_kv_heads - drop_kv * group
        if spec.heads and heads_left == num_heads:
            raise UsageError(f"--prune heads={spec.heads}: rounds to no head of {num_heads} (KV groups of {group}); "
                             f"give at least {1 / (group if group > 1 else num_kv_heads):.3g}")
        if heads_left < 1:
            raise UsageError(f"--prune heads={spec.heads} would leave a layer with no attention heads; give less")
        drop_ffn = int(round(spec.ffn * inter))
        if drop_ffn >= inter:
            raise UsageError(f"--prune ffn={spec.ffn} would leave a layer with no FFN channels; give less")
        adaptive = spec.adaptive and layers > 1
        # units a layer can lose, weakest first, each with the score it is ranked by
        per_head = [s.reshape(num_heads, head_size) for s in head_scores]
        if adaptive:  # FLAP squares the attention scores before standardising them
            per_head = [_standardised(s * s) for s in per_head]
        per_head = [(s.mean(1) if adaptive else s.sum(1)).tolist() for s in per_head]
        order_in_group = [[sorted(range(g * group, (g + 1) * group), key=lambda h, s=s: (s[h], h))
                           for g in range(num_kv_heads)] for s in per_head]
        if group > 1:
            unit_scores = [[sum(s[order[g][k]] for g in range(num_kv_heads)) / num_kv_heads
                            for k in range(group - 1)] for s, order in zip(per_head, order_in_group)]
            per_layer_units, cap = drop_per_group, group - 1
        else:
            kv_order = [sorted(range(num_kv_heads), key=lambda h, s=s: (s[h], h)) for s in per_head]
            unit_scores = [[s[h] for h in order[:-1]] for s, order in zip(per_head, kv_order)]
            per_layer_units, cap = drop_kv, num_kv_heads - 1
        head_units = _counts(unit_scores, per_layer_units, cap, adaptive and not (group == 1 and kv_cache))
        ch = [(_standardised(s) if adaptive else s).tolist() for s in ch_scores]
        ch_order = [sorted(range(inter), key=lambda c, s=s: (s[c], c)) for s in ch]
        ffn_units = _counts([[s[c] for c in order[:-1]] for s, order in zip(ch, ch_order)], drop_ffn, inter - 1,
                            adaptive)
        heads: list[list[int]] = []
        kv: list[list[int]] = []
        channels: list[list[int]] = []
        for i in range(layers):
            if group > 1:
                gone = {order_in_group[i][g][k] for g in range(num_kv_heads) for k in range(head_units[i])}
                kv.append(list(range(num_kv_heads)))
                heads.append([h for h in range(num_heads) if h not in gone])
            else:
                kept = sorted(kv_order[i][head_units[i]:])
                kv.append(kept)
                heads.append(kept)
            channels.append(sorted(ch_order[i][ffn_units[i]:]))
        return cls(heads, kv, channels, adaptive)


def _counts(unit_scores: list[list[float]], per_layer: int, cap: int, adaptive: bool) -> list[int]:
    """How many of its weakest units each layer loses: ``per_layer`` everywhere, or (adaptive) the same total
    taken lowest-score first across layers, at most ``cap`` from one layer. ``unit_scores[i]``: layer i's
    units weakest first."""
    layers = len(unit_scores)
    if not adaptive or not per_layer:
        return [per_layer] * layers
    ranked = sorted((score, k, i) for i, scores in enumerate(unit_scores) for k, score in enumerate(scores[:cap]))
    counts, left = [0] * layers, per_layer * layers
    for _, k, i in ranked:  # a layer's scores ascend, so its units come in order (k == counts[i])
        if not left:
            break
        counts[i] += 1
        left -= 1
    return counts


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

