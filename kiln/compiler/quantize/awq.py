"""AWQ (Lin et al. 2023): activation-aware scaling before 4-bit rounding, in torch on the CPU, block by block.

A weight column that multiplies a large activation channel matters more than one that multiplies a small one.
AWQ multiplies each input column of a Linear by a factor ``s`` (and divides the activation by ``s``, folded into
the module that produced it), so the important columns take more of their group's grid. Per group of Linears
that read one tensor (Q, K, V; gate, up; down):

    s = mean|x| ** a / mean|W|_group ** (1 - a),  normalised to a geometric mean of 1

with ``a`` searched over ``GRID`` points in [0, 1] for the smallest output error of the quantized Linears on
calibration tokens, ``sum ||Q(W diag(s)) (x / s) - W x||^2`` (``Q``: kiln's own group grid, so the search sees the
rounding the artifact will have); ``s = 1`` (no scaling) is always a candidate, so a group is never made worse on
its calibration tokens.

The divisor is folded where the model already multiplies: a norm's weight (and bias) of the right size, or the
rows of the Linear that produced the tensor (``up`` before ``down``: ``act(gate) * up`` is linear in ``up``).
Anything else (a fused ``gate_up``, an attention output under grouped-query attention, a norm that adds one to its
weight) is checked, not assumed: after folding, the block runs again on a calibration window and its output must be
unchanged (relative 1e-4); a fold that changes it is undone and the group is left unscaled with the reason.

The scaled model computes the same function as the original (to float rounding), so it is what kiln traces;
the rounding afterwards is the pass's round-to-nearest (``--quant-method awq``) or GPTQ on the scaled weights
(``awq+gptq``), and the codes keep the codes-are-the-codes guarantee of either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kiln.compiler.quantize import gptq

GRID = 20
"""Exponents tried: 0, 1/GRID, ..., (GRID - 1) / GRID (AutoAWQ's n_grid)."""
TOKENS = 4096
"""Calibration tokens per group the search measures its output error on (every token feeds mean|x|)."""
EQUIVALENCE = 1e-4
"""Largest relative change of a block's output a fold may make (FP32 rounding is about 1e-6)."""

Progress = Callable[[str], None]


def fake_quantize(w: Any, settings: gptq.Settings) -> Any:
    """(N, K) torch float32 -> its values on the pass's group grid (zero padding to whole groups)."""
    import torch

    n, k = w.shape
    g = settings.group_size or k
    pad = (-k) % g
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    groups = wp.reshape(-1, g)
    scale, zero = gptq.grid_params(groups, settings.bits, settings.grid, False)
    q = (gptq.round_codes(groups, scale, zero, (1 << settings.bits) - 1) - zero[:, None]) * scale[:, None]
    return q.reshape(n, k + pad)[:, :k]


def weight_magnitude(weights: Sequence[Any], group: int) -> Any:
    """mean over output rows of |W| / its group's max |W|, per input channel (K,), over the group's Linears."""
    import torch

    rows = torch.cat(list(weights), 0).abs()
    n, k = rows.shape
    g = group or k
    pad = (-k) % g
    rp = torch.nn.functional.pad(rows, (0, pad)) if pad else rows
    grouped = rp.reshape(n, -1, g)
    norm = grouped / grouped.amax(-1, keepdim=True).clamp(min=1e-12)
    return norm.reshape(n, -1)[:, :k].mean(0)


def search(weights: Sequence[Any], x: Any, x_mean: Any, settings: gptq.Settings) -> tuple[Any, float, float, float]:
    """The scale for one group of Linears: (s (K,), chosen exponent or -1 for none, its error, the unscaled error)."""
    import torch

    w_mean = weight_magnitude(weights, settings.group_size)
    exact = [x @ w.T for w in weights]

    def error(s: Any) -> float:
        xs = x / s
        return sum(float(((xs @ fake_quantize(w * s, settings).T - y) ** 2).sum()) for w, y in zip(weights, exact))

    ones = torch.ones_like(x_mean)
    best = (ones, -1.0, error(ones))
    base = best[2]
    for i in range(GRID):
        a = i / GRID
        s = (x_mean.clamp(min=1e-4) ** a / w_mean.clamp(min=1e-4) ** (1 - a)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        e = error(s)
        if e < best[2]:
            best = (s, a, e)
    return best[0], best[1], best[2], base


def scale_model(model: Any, windows: Sequence[dict[str, Any]], num_layers: int, settings: gptq.Settings,
                say: Progress, skip: Callable[[str], bool] = lambda name: False) -> dict[str, Any]:
    """Scale every group of Linears inside the Transformer blocks of ``model`` in place (the function unchanged);
    returns what was done: groups scaled, their exponents, groups left unscaled and why, seconds."""
    blocks = gptq.transformer_blocks(model, num_layers)
    t0 = time.perf_counter()
    states = gptq.block_inputs(model, windows, blocks[0])
    summary: dict[str, Any] = {"groups": 0, "scaled": 0, "alphas": [], "unscaled": {}, "error_ratio": []}
    for index, block in enumerate(blocks):
        scale_block(block, states, settings, summary, prefix=f"{index}.", skip=lambda n, i=index: skip(f"{i}.{n}"))
        say(f"awq block {index + 1}/{len(blocks)}: {summary['scaled']} of {summary['groups']} groups scaled so far, "
            f"{time.perf_counter() - t0:.0f}s")
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def scale_block(block: Any, states: list[tuple[Any, tuple, dict]], settings: gptq.Settings, summary: dict[str, Any],
                prefix: str = "", skip: Callable[[str], bool] = lambda name: False) -> None:
    """AWQ of one block on its inputs ``states``, which then become the block's outputs (the next block's inputs)."""
    import torch

    linears = {name: m for name, m in block.named_modules() if gptq.is_linear(m) and not skip(name)}
    if not linears:
        return
    hidden = [h for h, _, _ in states]
    rest = [(a, kw) for _, a, kw in states]
    with torch.no_grad():
        stages = gptq.solve_stages(block, linears, hidden[0], rest[0])
        inputs, producers = _observe(block, linears, stages, hidden, rest)
        modules = dict(block.named_modules())
        reference = gptq.first_output(block(hidden[0], *rest[0][0], **rest[0][1]))
        for stage in stages:
            summary["groups"] += 1
            where = prefix + "/".join(stage)
            fold = _fold_target(modules, linears, stage, producers)
            if fold is None:
                summary["unscaled"][where] = "no norm or Linear produces its input"
                continue
            ws = [_weight_nk(linears[n]) for n in stage]
            x, x_mean = inputs[stage[0]]
            s, a, err, base = search(ws, x, x_mean, settings)
            if a < 0:
                summary["unscaled"][where] = "no exponent beat the unscaled weights"
                continue
            undo = _apply(modules, stage, fold, s)
            out = gptq.first_output(block(hidden[0], *rest[0][0], **rest[0][1]))
            change = float((out - reference).abs().max() / reference.abs().max().clamp(min=1e-12))
            if change > EQUIVALENCE:
                undo()
                summary["unscaled"][where] = f"folding into {fold[0]} changed the block output by {change:.1e}"
                continue
            summary["scaled"] += 1
            summary["alphas"].append(round(a, 2))
            summary["error_ratio"].append(round(err / max(base, 1e-30), 4))
        for j, (h, (a, kw)) in enumerate(zip(hidden, rest)):
            states[j] = (gptq.first_output(block(h, *a, **kw)), a, kw)


def _weight_nk(m: Any) -> Any:
    import torch

    w = m.weight.detach()
    return (w if isinstance(m, torch.nn.Linear) else w.T).to(torch.float32)


def _observe(block: Any, linears: dict[str, Any], stages: list[list[str]], hidden: list[Any],
             rest: list[tuple[tuple, dict]]) -> tuple[dict[str, tuple[Any, Any]], dict[str, str | None]]:
    """Per stage (by its first Linear): (up to TOKENS input rows, mean |x| over every token), and which module
    produced each stage's input on the first window (by the identity of its output tensor)."""
    import torch

    sums: dict[str, Any] = {}
    counts: dict[str, int] = {}
    rows: dict[str, list[Any]] = {}
    firsts = {st[0] for st in stages}

    def pre(name: str) -> Callable:
        def hook(mod: Any, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            sums[name] = sums.get(name, 0) + x.abs().sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
            have = sum(r.shape[0] for r in rows.setdefault(name, []))
            if have < TOKENS:
                rows[name].append(x[:TOKENS - have].clone())
        return hook

    outputs: list[tuple[str, Any]] = []
    seen: dict[str, Any] = {}
    hooks = [linears[n].register_forward_pre_hook(pre(n)) for n in firsts]
    first_pass = [True]

    def record(name: str) -> Callable:
        def hook(mod: Any, args: tuple, out: Any) -> None:
            if first_pass[0] and isinstance(out, torch.Tensor):
                outputs.append((name, out))
        return hook

    def grab_input(name: str) -> Callable:
        def hook(mod: Any, args: tuple) -> None:
            if first_pass[0]:
                seen[name] = args[0]
        return hook

    hooks += [m.register_forward_hook(record(n)) for n, m in block.named_modules() if n]
    hooks += [linears[n].register_forward_pre_hook(grab_input(n)) for n in firsts]
    try:
        for h, (a, kw) in zip(hidden, rest):
            block(h, *a, **kw)
            first_pass[0] = False
    finally:
        for hk in hooks:
            hk.remove()
    producers = {}
    for n in firsts:
        made = [name for name, out in outputs if out is seen.get(n)]
        producers[n] = made[-1] if made else None
    inputs = {n: (torch.cat(rows[n], 0), sums[n] / counts[n]) for n in firsts if n in rows}
    return inputs, producers


def _fold_target(modules: dict[str, Any], linears: dict[str, Any], stage: list[str],
                 producers: dict[str, str | None]) -> tuple[str, str] | None:
    """Where the divisor goes: (module name, "norm" | "rows"), or None. The input's producer when it is a norm
    (a 1-D weight of the input's size) or a Linear with that many outputs; else an ``up`` Linear of the same
    block with that many outputs when the stage is a ``down`` projection (``act(gate) * up`` feeds it)."""
    import torch

    k = gptq.in_features(linears[stage[0]])
    name = producers.get(stage[0])
    if name is not None and name not in stage:
        m = modules[name]
        if isinstance(m, torch.nn.Linear) and m.out_features == k:
            return name, "rows"
        w = getattr(m, "weight", None)
        if not isinstance(m, torch.nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 1 and w.numel() == k:
            return name, "norm"
    if name is None and stage[0].rsplit(".", 1)[-1] in ("down_proj", "down", "w2", "fc2"):
        parent = stage[0].rsplit(".", 1)[0] + "." if "." in stage[0] else ""
        for up in ("up_proj", "up", "w3"):
            m = modules.get(parent + up)
            if isinstance(m, torch.nn.Linear) and m.out_features == k:
                return parent + up, "rows"
    return None


def _apply(modules: dict[str, Any], stage: list[str], fold: tuple[str, str], s: Any) -> Callable[[], None]:
    """Multiply the stage's weight columns by ``s`` and divide the fold target by it; returns the undo."""
    import torch

    touched: list[tuple[Any, Any]] = []

    def keep(t: Any) -> None:
        touched.append((t, t.detach().clone()))

    for n in stage:
        m = modules[n]
        keep(m.weight)
        if isinstance(m, torch.nn.Linear):
            m.weight.mul_(s.to(m.weight.dtype)[None, :])
        else:  # Conv1D holds (K, N)
            m.weight.mul_(s.to(m.weight.dtype)[:, None])
    name, how = fold
    m = modules[name]
    keep(m.weight)
    if how == "rows":
        m.weight.div_(s.to(m.weight.dtype)[:, None])
    else:
        m.weight.div_(s.to(m.weight.dtype))
    if getattr(m, "bias", None) is not None:
        keep(m.bias)
        m.bias.div_(s.to(m.bias.dtype))

    def undo() -> None:
        for t, old in touched:
            t.copy_(old)
    return undo

