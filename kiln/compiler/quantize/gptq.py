"""GPTQ (Frantar et al. 2022) and round-to-nearest in torch on the CPU, layer by layer.

``quantize_model`` runs calibration windows through the model once to the first Transformer block, then
walks the blocks in order: each block's inputs are the outputs of the blocks before it *after* they were
quantized, its Linear layers' Hessians (2/n X^T X) are accumulated from one forward pass, every Linear is
solved, the block's weights are replaced by what the codes dequantize to, and the block runs again to feed
the next. Memory: one block's calibration activations (windows x tokens x hidden floats, twice).

Within a block the Linears are solved in stages (GPTQ's true-sequential): those sharing one input (Q, K, V;
gate, up) together, each stage's Hessians measured with the stages before it already quantized.

The solver (``solve``) is the reference algorithm: dead columns zeroed, dampening, the Cholesky factor of
the inverse Hessian, lazy batch updates in blocks of 128 columns, group parameters from the weights as
updated so far, optional act-order (columns by descending Hessian diagonal). Act-order's groups are static
by default (parameters from the original weights in the input order, codes in the input order: no Gather in
the graph); with ``static_groups=False`` they follow the solve order, the codes are kept in that order and
the graph gathers the activations to match, so groups stay contiguous for the kernel.

The grid is ``kiln.passes.quantize_nbits``'s (``grid``): symmetric with the block's largest-magnitude
weight exact at the most negative code (CPU), symmetric with a positive scale (TensorRT), or asymmetric
min/max; an optional MSE search shrinks the range.
The codes returned are the codes the artifact runs: the pass packs them without re-rounding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import UnsupportedModelError, UsageError
from kiln.passes.codes import GROUP_SIZE, Codebook, Quantized, half_exact

Progress = Callable[[str], None]
LAZY_BLOCK = 128


@dataclass(frozen=True)
class Settings:
    bits: int = 4
    group_size: int = GROUP_SIZE
    """Columns (inputs) per scale; a power of two >= 16, or 0 for one group per row."""
    grid: str = "signed"
    """kiln.passes.codes.GRIDS: signed (CPU), positive (TensorRT), asym."""
    act_order: bool = False
    static_groups: bool = True
    """With act-order: each group's parameters from the original weights, in the input order, computed before the
    solve; the columns are still solved by descending Hessian diagonal, but the codes stay in the input order, so
    the kernel needs no activation Gather (SmolLM2-135M decode 171 vs 133 tok/s with one Gather per MatMul)."""
    method: str = "gptq"  # gptq | rtn
    damp: float = 0.01
    more_bits: int = 0
    """When set (8), the Linears that read a more-bits layer's attention input (Q, K, V, packed or not) and its FFN
    down projection are solved at this many bits (``more_bits_layer``; the rest at ``bits``): llama.cpp's Q4_K_M
    mix, with the attention inputs in place of its V alone (a traced graph packs Q, K and V into one MatMul)."""
    mse: bool = False
    """Search a shrunk range per group (0.80..1.00) for the lowest squared weight error. Off by default: on
    SmolLM2-135M (group 128, 32 windows) it cost RTN 24.50 -> 26.19 and GPTQ 22.83 -> 22.59 held-out perplexity:
    shrinking gives up the signed grid's exact extreme."""


def more_bits_layer(index: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and the last eighth of the layers, and every third one between."""
    eighth = layers // 8
    return index < eighth or index >= 7 * layers // 8 or (index - eighth) % 3 == 2


def more_bits_linears(stages: list[list[str]]) -> set[str]:
    """A block's Linears that get ``Settings.more_bits``: the first stage (what reads the attention input) and, in a
    block of at most four stages (attention in / out, FFN in / down: not a mixture of experts, whose QMoE takes one
    width), a last stage of one Linear (the down projection)."""
    chosen = set(stages[0]) if stages else set()
    if 2 <= len(stages) <= 4 and len(stages[-1]) == 1:
        chosen |= set(stages[-1])
    return chosen


def grid_params(w: Any, bits: int, grid: str, mse: bool) -> tuple[Any, Any]:
    """Scale and zero point (float, per row) for a group of columns ``w`` (N, g), torch float32: the pass's
    ``rtn`` grids, with an optional search over shrunk ranges."""
    import torch

    top = (1 << bits) - 1
    mid = 1 << (bits - 1)

    def params(shrink: Any) -> tuple[Any, Any]:
        if grid == "signed":
            idx = w.abs().argmax(1, keepdim=True)
            scale = w.gather(1, idx)[:, 0] * shrink / -mid
        elif grid == "positive":
            scale = torch.maximum(-w.min(1).values / mid, w.max(1).values / (mid - 1)) * shrink
        else:
            lo = torch.clamp(w.min(1).values * shrink, max=0)
            hi = torch.clamp(w.max(1).values * shrink, min=0)
            scale = (hi - lo) / top
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
            return scale, torch.clamp(torch.round(-lo / scale), 0, top)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return scale, torch.full_like(scale, float(mid))

    scale, zero = params(torch.ones(w.shape[0], dtype=w.dtype))
    if not mse:
        return _half_exact(scale, grid), zero
    best = _qerror(w, scale, zero, top)
    for p in np.linspace(0.98, 0.80, 10):
        s, z = params(torch.full((w.shape[0],), float(p), dtype=w.dtype))
        err = _qerror(w, s, z, top)
        better = err < best
        if better.any():
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return _half_exact(scale, grid), zero


def _half_exact(scale: Any, grid: str) -> Any:
    """The pass's ``half_exact`` on a torch row of scales (the pass then stores them in half the bytes,
    ``kiln.passes.codes.HALF_MIN``); codes are computed with the rounded scales, so they stay exact."""
    import torch

    return torch.from_numpy(half_exact(scale.numpy(), grid))


def round_codes(w: Any, scale: Any, zero: Any, top: int) -> Any:
    import torch

    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, top)


def _qerror(w: Any, scale: Any, zero: Any, top: int) -> Any:
    q = (round_codes(w, scale, zero, top) - zero[:, None]) * scale[:, None]
    return ((q - w) ** 2).sum(1)


def solve(weight: Any, hessian: Any | None, s: Settings, own: bool = False) -> tuple[Quantized, Any]:
    """One Linear: weight (N, K) torch float32 and its Hessian (K, K) (None: round-to-nearest). ``own``: the
    caller hands the Hessian over (holds no other reference): it is overwritten and released as soon as its
    Cholesky factor exists instead of copied first, so at most two (K, K) matrices are alive at once (at 8B's
    down_proj, K = 14336, each is 822 MB).

    Returns the codes in the kernel's layout and the (N, K) float32 weight they dequantize to, in the
    original column order."""
    import torch

    w = weight.detach().to(torch.float32).clone()
    n, k = w.shape
    gs = s.group_size or k
    top = (1 << s.bits) - 1
    perm = None
    if s.method == "gptq" and hessian is not None:
        h = hessian.to(torch.float32)
        h = h if own or h is not hessian else h.clone()
        del hessian
        dead = torch.diag(h) == 0
        h[dead, dead] = 1
        w[:, dead] = 0
        if s.act_order:
            perm = torch.argsort(torch.diag(h), descending=True)
            w = w[:, perm]
            h = h[perm]
            h = h[:, perm]
        h.diagonal().add_(s.damp * torch.mean(torch.diag(h)))
        lower = _cholesky(h)
        del h
        inverse = torch.cholesky_inverse(lower)
        del lower
        hinv = torch.linalg.cholesky(inverse, upper=True)  # upper Cholesky factor of H^-1
        del inverse
    else:
        hinv = None
    blocks = -(-k // gs)
    scales = torch.zeros((n, blocks), dtype=torch.float32)
    zeros = torch.zeros((n, blocks), dtype=torch.float32)
    per_row = gs >= k
    static = perm is not None and s.static_groups and not per_row
    step = LAZY_BLOCK if per_row or static or LAZY_BLOCK % gs == 0 else gs  # a group never straddles two lazy blocks
    if per_row:  # one group per row: parameters from the whole row before any update (the reference's choice)
        scales[:, 0], zeros[:, 0] = grid_params(w, s.bits, s.grid, s.mse)
    if static:  # groups in the input order, parameters from the original weights (GPTQ's static_groups)
        original = w[:, torch.argsort(perm)]
        for g in range(blocks):
            scales[:, g], zeros[:, g] = grid_params(original[:, g * gs:(g + 1) * gs], s.bits, s.grid, s.mse)
        group_of = (perm // gs).tolist()  # solved column j belongs to input perm[j]'s group
    # the column loop runs on the transpose: each column of W is a contiguous row, so the per-column rank-1 updates
    # stream through memory (an (N, 128) block sliced by column was strided: 2.4x slower at N = 14336)
    wt = w.T.contiguous()
    del w
    codes_t = torch.zeros((k, n), dtype=torch.float32)
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        w1 = wt[i1:i2].clone()
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            if not per_row and not static and col % gs == 0:  # the group's parameters from its weights as updated so far
                scales[:, col // gs], zeros[:, col // gs] = grid_params(w1[i:i + gs].T, s.bits, s.grid, s.mse)
            g = group_of[col] if static else col // gs
            sc, zp = scales[:, g], zeros[:, g]
            q = round_codes(w1[i, :, None], sc, zp, top)[:, 0]
            codes_t[col] = q
            if hinv is None:
                continue
            e = (w1[i] - (q - zp) * sc) / hinv[col, col]
            w1[i:] -= hinv[col, col:i2, None] * e[None, :]
            err1[i] = e
        if hinv is not None and i2 < k:
            wt[i2:] -= hinv[i1:i2, i2:].T @ err1
    codes = codes_t.T
    if static or (per_row and perm is not None):  # one group per row: its scale ignores the order, so the codes
        codes = codes[:, torch.argsort(perm)]      # go back to input order too (no Gather; QMoE takes no permutation)
        perm = None
    full = torch.zeros((n, blocks * gs), dtype=torch.float32)
    full[:, :k] = codes
    deq = ((full.reshape(n, blocks, gs) - zeros[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]
    if perm is not None:
        deq = deq[:, torch.argsort(perm)]
    # the kernel's layout: blocks of a power of two (per-row: the next one above K), padded with the zero point
    layout = gs if not per_row else 1 << max(4, (k - 1).bit_length())
    zero_codes = zeros.numpy().astype(np.uint8)
    padded = np.repeat(zero_codes, layout, axis=1).reshape(n, blocks * layout)
    padded[:, :k] = codes.numpy().astype(np.uint8)
    q = Quantized(codes=padded.reshape(n, blocks, layout), scales=scales.numpy().astype(np.float32),
                  zeros=None if s.grid != "asym" else zero_codes, bits=s.bits, block_size=layout,
                  k=k, perm=None if perm is None else perm.numpy().astype(np.int64))
    return q, deq


def _cholesky(h: Any) -> Any:
    """Lower Cholesky factor of H, dampened further (its diagonal raised in place) while H is not positive
    definite in float32."""
    import torch

    diagonal = h.diagonal().clone()
    mean = torch.mean(diagonal)
    for extra in (0.0, 0.01, 0.1, 1.0):
        h.diagonal().copy_(diagonal + extra * mean)
        lower, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            return lower
        del lower
    raise ValueError("Hessian is not positive definite even after dampening")


def calibration_dtype() -> Any:
    """What a streamed GPTQ's calibration forward computes in: BF16 where the CPU multiplies it natively (AMX or
    AVX-512 BF16; on a 1.1B layer, 8 windows of 256 tokens: 0.38 s against FP32's 1.25 s), FP32 elsewhere (emulated
    BF16 is slower than FP32). The Hessians are accumulated and the weights solved in FP32 either way."""
    import torch

    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return torch.bfloat16 if " amx_bf16" in flags or " avx512_bf16" in flags else torch.float32


class _Stop(Exception):
    pass


def transformer_blocks(model: Any, num_layers: int) -> Any:
    """The model's Transformer blocks: the ModuleList with one entry per layer (the longest such list)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if not lists:
        raise UnsupportedModelError(f"{type(model).__name__} has no list of {num_layers} Transformer blocks, which "
                                    "kiln's GPTQ, AWQ and pruning work through block by block; compile with "
                                    "--quant-method rtn (INT4) or without --prune")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


class _Hessian:
    """2/n X^T X of one Linear's inputs, accumulated batch by batch (n: rows seen so far)."""

    def __init__(self, k: int) -> None:
        import torch

        self.h, self.n = torch.zeros((k, k)), 0

    def add(self, x: Any) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.h.dtype)
        total = self.n + x.shape[0]
        self.h *= self.n / total
        x = math.sqrt(2 / total) * x
        self.h.addmm_(x.T, x)  # in place: no (K, K) temporary
        self.n = total


def quantize_model(model: Any, windows: Sequence[dict[str, Any]], num_layers: int, settings: Settings,
                   say: Progress, skip: Callable[[str], bool] = lambda name: False,
                   named: dict[str, Quantized] | None = None, head: bool = False) -> Codebook:
    """Quantize every Linear inside the Transformer blocks of ``model`` (modified in place: each weight
    becomes what its codes dequantize to), and with ``head`` the lm_head too (a tied one is untied first: the
    embedding table keeps its weights). ``windows``: model inputs (torch tensors, batched).

    Returns the codes, found by the original (K, N) weights as the traced graph holds them; ``named``, when
    given, is filled with the blocks' codes by module name (for writing a GPTQ checkpoint)."""
    blocks = transformer_blocks(model, num_layers)
    prefix = next(name for name, m in model.named_modules() if m is blocks)
    t0 = time.perf_counter()
    states = block_inputs(model, windows, blocks[0])
    result = Codebook()
    for index, block in enumerate(blocks):
        def solved(name: str, original: Any, q: Quantized, index: int = index) -> None:
            result.add(original, q)
            if named is not None:
                named[f"{prefix}.{index}.{name}"] = q

        n = quantize_block(block, states, settings, solved, skip=lambda name, i=index: skip(f"{i}.{name}"),
                           layer=(index, len(blocks)))
        say(f"{settings.method} block {index + 1}/{len(blocks)}: {n} linears, {time.perf_counter() - t0:.0f}s")
    if head:
        _quantize_head(model, windows, settings, result)
        say(f"{settings.method} lm_head: {time.perf_counter() - t0:.0f}s")
    return result


def block_inputs(model: Any, windows: Sequence[dict[str, Any]], first: Any) -> list[tuple[Any, tuple, dict]]:
    """Every window run to the first Transformer block ``first`` and stopped there: its inputs per window
    (hidden states, other positional arguments, keyword arguments), as ``quantize_block`` takes them."""
    captured: list[tuple[tuple, dict]] = []

    def grab(module: Any, args: tuple, kwargs: dict) -> None:
        captured.append((args, kwargs))
        raise _Stop

    _run_until(model, windows, first, grab, with_kwargs=True)
    return [(a[0] if a else kw.pop("hidden_states"), a[1:], kw) for a, kw in captured]


Solved = Callable[[str, np.ndarray, Quantized], None]
"""(the Linear's name in its block, its original (K, N) FP32 weight, its codes): called as each Linear is solved."""


def quantize_block(block: Any, states: list[tuple[Any, tuple, dict]], settings: Settings, solved: Solved,
                   skip: Callable[[str], bool] = lambda name: False, compute: Any = None, feed: bool = True,
                   layer: tuple[int, int] | None = None) -> int:
    """GPTQ (or RTN) of one Transformer block's Linears on its inputs ``states`` (hidden states, other arguments,
    keyword arguments), which become the quantized block's outputs (the next block's inputs; ``feed=False``: the
    caller runs the block on them itself). Each Linear's weight becomes what its codes dequantize to. ``compute``:
    the torch dtype the block runs in (None: its own); the Linears are solved from their FP32 weights as the block
    holds them on entry. ``layer``: (index, count) of the block, for ``Settings.more_bits``. Returns the Linears
    solved."""
    import torch

    linears = {name: m for name, m in block.named_modules() if is_linear(m) and not skip(name)}
    hess = {name: _Hessian(in_features(m)) for name, m in linears.items()} if settings.method == "gptq" else {}
    originals = {name: (m.weight.detach().T if not isinstance(m, torch.nn.Linear) else m.weight.detach())
                 .to(torch.float32) for name, m in linears.items()}  # (N, K); the Parameter itself while FP32
    if compute is not None:
        block.to(compute)
    hidden = [h for h, _, _ in states]
    rest = [(a, kw) for _, a, kw in states]
    more = settings.more_bits and layer is not None and more_bits_layer(*layer)
    with torch.no_grad():
        stages = solve_stages(block, linears, hidden[0], rest[0]) if settings.method == "gptq" or more else [list(linears)]
        wider = replace(settings, bits=settings.more_bits) if more else settings
        promoted = more_bits_linears(stages) if more else set()
        if settings.method != "gptq":
            stages = [[name for st in stages for name in st]]
        for stage in stages:
            if settings.method == "gptq":  # Hessians of this stage's inputs, earlier stages already quantized
                last = linears[stage[-1]]
                hooks = [linears[name].register_forward_hook(lambda mod, args, out, h=hess[name]: h.add(args[0]))
                         for name in stage]
                hooks.append(last.register_forward_hook(_stop_after))
                try:
                    for h, (a, kw) in zip(hidden, rest):
                        try:
                            block(h, *a, **kw)
                        except _Stop:
                            pass
                finally:
                    for hk in hooks:
                        hk.remove()
            for name in stage:
                m = linears[name]
                conv = not isinstance(m, torch.nn.Linear)  # GPT-2's Conv1D holds (K, N)
                w_nk = originals.pop(name)
                original = w_nk.numpy().T.copy()  # a copy: the weight may be overwritten below
                q, deq = solve(w_nk, hess.pop(name).h if settings.method == "gptq" else None,
                               wider if name in promoted else settings, own=True)
                m.weight.copy_((deq.T if conv else deq).to(m.weight.dtype))
                solved(name, original, q)
        if feed:
            for j, (h, (a, kw)) in enumerate(zip(hidden, rest)):
                states[j] = (first_output(block(h, *a, **kw)), a, kw)
    return len(linears)


def quantize_streamed(stream: Any, windows: Sequence[dict[str, Any]], settings: Settings, book: Codebook,
                      say: Progress, head: bool = False, compute: Any = None) -> dict[str, str]:
    """``quantize_model`` for a checkpoint too large to hold (``stream``: a ``kiln.compiler.layerwise.LayerStream``):
    the windows' inputs to the first layer are captured with only the embeddings in memory, then each layer is
    read from the checkpoint, solved on the quantized layers' outputs (``quantize_block``), run to feed the next,
    and dropped; with ``head`` the lm_head is solved last on the final hidden states. Codes go into ``book`` (give
    it a directory). ``compute``: the dtype the calibration forward runs in (the solve is FP32 either way).

    Returns the codebook key of every solved weight by its parameter name (``model.layers.3.mlp.down_proj.weight``)."""
    import torch

    compute = compute or torch.float32
    stream.dtype = compute  # the embeddings too: the mask and rotary tables the layers receive follow their dtype
    keys: dict[str, str] = {}
    calls = [lambda w=w: stream.shell(**w) for w in windows]
    with stream.session():
        states = stream.capture(calls)
        for i, layer in stream.layers_filled(settings.method, sum(len(h) for h, _, _ in states)):
            def solved(name: str, original: Any, q: Quantized, i: int = i) -> None:
                keys[f"{stream.stack}.{i}.{name}.weight"] = book.add(original, q)

            quantize_block(layer, states, settings, solved, compute=compute, feed=False, layer=(i, len(stream.layers)))
            stream.apply(layer, states)  # the quantized layer's outputs feed the next one
        out = stream.head()
        if head and isinstance(out, torch.nn.Linear):
            hess = _Hessian(out.in_features)

            def grab(module: Any, args: tuple) -> None:
                hess.add(args[0])
                raise _Stop

            def until_head(call: Callable[[], Any]) -> Callable[[], None]:
                def run() -> None:
                    try:
                        call()
                    except _Stop:
                        pass
                return run

            handle = out.register_forward_pre_hook(grab)
            try:
                stream.finish([until_head(c) for c in calls], states)
            finally:
                handle.remove()
            stream.empty()  # the final norm and head the forward needed; the head is read again in FP32 to solve
            name = next(n for n, m in stream.shell.named_modules() if m is out) + ".weight"
            w_nk = stream.read(name)
            q, _ = solve(w_nk, hess.h if settings.method == "gptq" else None, settings, own=True)
            keys[name] = book.add(w_nk.numpy().T, q)
            say(f"{settings.method} lm_head solved")
    return keys


def _quantize_head(model: Any, windows: Sequence[dict[str, Any]], settings: Settings, result: Codebook) -> None:
    """The lm_head on the final hidden states of the already-quantized blocks (one more pass over the windows,
    stopped at the head's input)."""
    import torch

    out = model.get_output_embeddings()
    if out is None or not isinstance(out, torch.nn.Linear):
        return
    hess = _Hessian(out.in_features)

    def grab(module: Any, args: tuple) -> None:
        hess.add(args[0])
        raise _Stop

    _run_until(model, windows, out, grab)
    with torch.no_grad():
        if out.weight is model.get_input_embeddings().weight:  # tied: the table keeps its FP32 weights
            out.weight = torch.nn.Parameter(out.weight.detach().clone(), requires_grad=False)
        original = out.weight.detach().numpy().T.copy()
        q, deq = solve(out.weight.detach(), hess.h if settings.method == "gptq" else None, settings, own=True)
        out.weight.copy_(deq)
        result.add(original, q)


def _run_until(model: Any, windows: Sequence[dict[str, Any]], module: Any, grab: Callable, with_kwargs: bool = False
               ) -> None:
    """Run every window through ``model`` with ``grab`` as ``module``'s forward pre-hook (it raises _Stop: nothing
    after ``module`` runs)."""
    import torch

    handle = module.register_forward_pre_hook(grab, with_kwargs=with_kwargs)
    try:
        with torch.no_grad():
            for feeds in windows:
                try:
                    model(**feeds)
                except _Stop:
                    pass
    finally:
        handle.remove()


def _stop_after(module: Any, args: tuple, out: Any) -> None:
    raise _Stop


def solve_stages(block: Any, linears: dict[str, Any], hidden: Any, rest: tuple[tuple, dict]) -> list[list[str]]:
    """The block's Linears in the order its forward runs them, grouped by the input they share (Q/K/V; gate/up):
    each stage is solved on inputs produced by the stages before it already quantized (GPTQ's true-sequential)."""
    import torch

    order: list[tuple[str, Any]] = []  # (name, its input tensor): held, so no address is reused during the run
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: order.append((name, args[0])))
             for name, m in linears.items()]
    try:
        with torch.no_grad():
            block(hidden, *rest[0], **rest[1])
    finally:
        for h in hooks:
            h.remove()
    stages: list[list[str]] = []
    last_input = None
    for name, x in order:
        if name in {n for st in stages for n in st}:
            continue
        if stages and x is last_input:
            stages[-1].append(name)
        else:
            stages.append([name])
        last_input = x
    stages += [[n] for n in linears if n not in {x for st in stages for x in st}]  # never called: solved alone
    return stages


def is_linear(m: Any) -> bool:
    import torch

    if getattr(m, "kiln_router", False):  # a mixture-of-experts router stays FP32 (kiln.compiler.experts)
        return False
    return isinstance(m, torch.nn.Linear) or (type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
                                              and m.weight.dim() == 2)


def in_features(m: Any) -> int:
    return m.in_features if hasattr(m, "in_features") else m.weight.shape[0]


def first_output(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def check_group_size(model: Any, group_size: int, where: str | Path) -> None:
    """INT4's group size fits every layer of ``model`` (read from ``where``): checked once the model is loaded,
    before anything is traced."""
    g = group_size
    smallest = min((in_features(m) for m in model.modules() if is_linear(m)), default=None)
    if g and smallest is not None and g > smallest:
        raise UsageError(f"--group-size {g} is larger than the smallest layer input ({smallest} features) of "
                         f"{where}; give --group-size {1 << (smallest.bit_length() - 1)} or less")
