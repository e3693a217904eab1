"""Attention captured where transformers computes it: while a model is traced, kiln's function stands in for the
``sdpa`` and ``eager`` entries of transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``), which every family
of transformers 5 calls with Q, K and V after its own projections, norms, rotary (partial, scaled, YaRN, LongRoPE,
MLA's split heads) and cache update. The function calls one torch custom op, ``kiln::attention``, whose ONNX
translation is exactly one ``ai.kiln.CapturedAttention`` node (its contract: ``kiln.passes.attention_node``), so the traced
graph says where attention is, with what mask, scale, soft-cap, sinks and head counts, and no pass has to rediscover it.

A call the node cannot carry (an argument kiln does not know that changes the result, such as the key indices of a
sparse attention) runs the model's own function instead, and the call is recorded with the reason: that layer is
traced as the model computes it and verified like any other.

The eager model used as the reference in verification never runs inside the capture: it keeps its own attention.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler import decided
from kiln.compiler.expert_loops import dense_loops
from kiln.compiler.exportable import exportable
from kiln.errors import UnsupportedModelError
from kiln.passes import attention_node

# Arguments that select a kernel or ask for debugging output; they never change what attention computes.
IGNORED = {"dropout", "is_causal", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
           "max_length_k", "position_ids", "deterministic", "use_cache", "cache_position", "layer_idx",
           "position_embeddings", "past_key_values", "past_key_value", "head_mask", "use_top_left_mask", "target_dtype",
           "implementation", "q_len", "query_length"}
SINKS = ("s_aux", "sinks")
ENTRIES = ("sdpa", "eager")


@torch.library.custom_op("kiln::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sinks: torch.Tensor | None, bias: torch.Tensor | None, scale: float, softcap: float, causal: bool,
              window: int, layer: int) -> torch.Tensor:
    """The node's semantics in PyTorch (``kiln.passes.attention_node``): (B, Hq, S, Dk) x (B, Hkv, T, Dk) x
    (B, Hkv, T, Dv) -> (B, S, Hq, Dv)."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, S, T)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    elif causal:
        s, t = scores.shape[-2], scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a fully masked row attends to nothing (as ONNX Attention)
    return (probs @ v).transpose(1, 2).contiguous()


@attention.register_fake
def _(q, k, v, mask, sinks, bias, scale, softcap, causal, window, layer):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[3]))


def _onnx(q, k, v, mask=None, sinks=None, bias=None, scale: float = 1.0, softcap: float = 0.0, causal: bool = False,
          window: int = 0, layer: int = -1):
    """The ONNX translation: one ``ai.kiln.CapturedAttention`` (head counts and sizes are static at trace time)."""
    from onnxscript.values import Opset

    op = Opset(attention_node.DOMAIN, 1)
    return op.CapturedAttention(q, k, v, mask, sinks, bias, scale=float(scale), softcap=float(softcap),
                                causal=int(causal), window=int(window), layer=int(layer), q_heads=int(q.shape[1]),
                                kv_heads=int(k.shape[1]), head_size=int(q.shape[3]), v_head_size=int(v.shape[3]))


def _all_true(x):
    """``aten._is_all_true``: the operand of a data check (``torch._check`` on a tensor, transformers'
    ``torch_compilable_check``). The exporter drops the assertion that reads it and the optimizer then this node, but
    torch's ONNX library has no translation for it, so without one the export stops."""
    from onnxscript import opset18 as op

    return op.Cast(op.ReduceMin(op.Cast(x, to=6), keepdims=0), to=9)  # int32 min over every element -> bool


TRANSLATIONS = {torch.ops.kiln.attention.default: _onnx, torch.ops.aten._is_all_true.default: _all_true}
"""For ``torch.onnx.export(custom_translation_table=...)``."""


@dataclass
class Log:
    """What a capture saw: calls turned into nodes, and calls left to the model's own function with the reason."""

    captured: int = 0
    delegated: list[dict[str, Any]] = field(default_factory=list)
    assumptions: list[dict[str, Any]] = field(default_factory=list)
    """Decisions on tensor data the graph was traced for (``kiln.compiler.decided``): output, value, where."""
    blocks: dict[str, int] = field(default_factory=dict)
    """Dynamic axis name -> the block its length is traced in (``kiln.compiler.decided.in_blocks``)."""

    def delegate(self, module: Any, why: str) -> None:
        entry = {"module": type(module).__name__, "layer": _layer(module), "why": why}
        if entry not in self.delegated:
            self.delegated.append(entry)


def _layer(module: Any) -> int:
    value = getattr(module, "layer_idx", None)
    return int(value) if isinstance(value, int) else -1


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    found = [kwargs[k] for k in SINKS if kwargs.get(k) is not None]
    return found[0] if found else None


def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
                kwargs: dict[str, Any]) -> str | None:
    """Why the node cannot carry this call (None when it can). A tensor argument kiln does not know (the key
    indices of a sparse attention, a second query) changes the result; flags passed down with the model's other
    keyword arguments (``output_router_logits``, ...) do not."""
    extra = sorted(k for k, v in kwargs.items() if isinstance(v, (torch.Tensor, list, tuple)) and k not in IGNORED
                   and k not in SINKS and k not in ("scaling", "softcap", "sliding_window", "position_bias"))
    if extra:
        return f"the call passes {', '.join(extra)}, which kiln's attention node does not carry"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return f"Q/K/V are {query.dim()}-D, not (batch, heads, sequence, head size)"
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        return f"{query.shape[1]} query heads cannot share {key.shape[1]} key / {value.shape[1]} value heads"
    if mask is not None and not isinstance(mask, torch.Tensor):
        return f"the mask is a {type(mask).__name__}, not a tensor"
    return None


def _function(entry: str, original: Any, log: Log):
    def kiln_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        why = unsupported(query, key, value, attention_mask, kwargs)
        if why is not None:
            log.delegate(module, why)
            own = original if original is not None else _own_eager(module)
            return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        window = kwargs.get("sliding_window")
        out = torch.ops.kiln.attention(query, key, value, attention_mask, _sinks(kwargs), kwargs.get("position_bias"),
                                       scale, float(kwargs.get("softcap") or 0.0), causal,
                                       int(window) if isinstance(window, int) else 0, _layer(module))
        log.captured += 1
        return out, None

    kiln_attention.__name__ = f"kiln_attention_{entry}"
    return kiln_attention


def _own_eager(module: Any):
    """The module's own eager attention (transformers' convention: ``eager_attention_forward`` in its modeling file),
    for a call kiln does not capture under an ``eager`` model."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        own = sdpa_attention_forward
    return own


@contextlib.contextmanager
def capture() -> Iterator[Log]:
    """Inside: every model's ``sdpa`` / ``eager`` attention emits ``kiln::attention`` (the interface's other entries,
    and families that compute attention themselves, are untouched)."""
    log = Log()
    try:
        from transformers.modeling_utils import AttentionInterface

        mapping = AttentionInterface._global_mapping
    except (ImportError, AttributeError):  # a transformers without the interface: attention runs as traced
        yield log
        return
    saved = dict(mapping)
    try:
        for entry in ENTRIES:
            mapping[entry] = _function(entry, saved.get(entry), log)
        yield log
    finally:
        mapping.clear()
        mapping.update(saved)


def export(module: torch.nn.Module, args: tuple, *, source: str, dynamic_shapes: dict,
           **kwargs: Any) -> tuple[Any, Log]:
    """``torch.onnx.export(dynamo=True)`` with attention captured (and the forms the exporter cannot take rewritten:
    ``kiln.compiler.exportable``): the ONNX program and what the capture saw.
    ``source`` names the checkpoint in errors. An export that stops on a Python decision about tensor data, or on a
    length the forward needs in whole blocks, is retried as ``kiln.compiler.decided`` says (the log records the
    decisions and blocks). Raises UnsupportedModelError when the graph fixes an axis that ``dynamic_shapes``
    declares dynamic: the exporter's fallbacks accept a forward whose Python depends on that length (a loop over
    tokens, as in state-space and recurrent layers), and such a graph serves one length only."""
    recorded: list[decided.Decision] = []
    blocks: dict[str, int] = {}
    probe = False
    while True:
        if probe:  # a retry with decisions: torch.export alone first, which names a length in blocks sooner
            probe = False
            dim, size = _block(_refusal(module, args, dynamic_shapes, recorded), dynamic_shapes, blocks)
        else:
            try:
                program, log = _export(module, args, dynamic_shapes, recorded, kwargs)
            except UnsupportedModelError:
                raise
            except Exception as e:
                if not recorded and decided.data_dependent(e):
                    recorded = decided.record(module, args)
                    probe = bool(recorded)
                    if probe:
                        continue
                dim, size = _block(e, dynamic_shapes, blocks)
                if dim is None:
                    raise
            else:
                fixed = fixed_axes(program.model.graph.inputs, dynamic_shapes)
                if not fixed:
                    break
                # the exporter fell back to a fixed length: torch.export's own refusal names the guards that fixed it
                dim, size = _block(_refusal(module, args, dynamic_shapes, recorded), dynamic_shapes, blocks,
                                   fixed[0][2])
                if dim is None:
                    name, axis, dim_name, length = fixed[0]
                    raise UnsupportedModelError(
                        f"{source}: the traced graph fixes {name} axis {axis} ({dim_name}) to {length}, so it would "
                        "serve that one length only: the model's forward computes with the length as a Python number "
                        "(a loop over tokens, as in state-space and recurrent layers, or a table built for it); kiln "
                        "compiles graphs for any batch and length, so this architecture cannot be compiled")
        if dim is not None:
            blocks[dim.__name__] = size
            dynamic_shapes, args = decided.in_blocks(dynamic_shapes, args, dim, size)
    log.blocks = blocks
    return program, log


def _block(e: BaseException | None, dynamic_shapes: Any, blocks: dict[str, int],
           name: str | None = None) -> tuple[Any, int]:
    """The first dynamic dimension (``name``'s, when given) not yet in blocks whose length ``e`` says must come in
    whole blocks, and the block; (None, 0) when none."""
    for d in _dims(dynamic_shapes):
        if e is not None and d.__name__ not in blocks and name in (None, d.__name__):
            size = decided.block(e, d)
            if size:
                return d, size
    return None, 0


def _refusal(module: torch.nn.Module, args: tuple, dynamic_shapes: Any,
             recorded: list[decided.Decision]) -> BaseException | None:
    """What ``torch.export`` itself says about these dynamic shapes (the ONNX exporter falls back without it)."""
    try:
        with _tracing(module, recorded):
            torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # the refusal is the answer
        return e
    return None


@contextlib.contextmanager
def _tracing(module: torch.nn.Module,
             recorded: list[decided.Decision]) -> Iterator[tuple[Log, list[decided.Decision]]]:
    """Inside: attention captured, the exporter's forms rewritten, loop experts dense and the recorded decisions
    replayed; yields the capture's log and the decisions the trace took."""
    replay = decided.replaying(module, recorded) if recorded else contextlib.nullcontext([])
    with capture() as log, exportable(), dense_loops(module), replay as taken:
        yield log, taken


def _export(module: torch.nn.Module, args: tuple, dynamic_shapes: Any, recorded: list[decided.Decision],
            kwargs: dict[str, Any]) -> tuple[Any, Log]:
    with _tracing(module, recorded) as (log, taken):
        program = torch.onnx.export(module, args, dynamo=True, custom_translation_table=TRANSLATIONS,
                                    dynamic_shapes=dynamic_shapes, **kwargs)
    if len(taken) > decided.MAX_DECISIONS:
        raise UnsupportedModelError(f"the forward takes {len(taken)} decisions on tensor data (first at "
                                    f"{taken[0].where}), more than the {decided.MAX_DECISIONS} kiln checks per graph")
    outputs = program.model.graph.outputs
    for i, d in enumerate(taken):  # the conditions come last, named by the exporter: give them kiln's names
        outputs[len(outputs) - len(taken) + i].name = decided.OUTPUT.format(i)
        log.assumptions.append({"output": decided.OUTPUT.format(i), "value": d.value, "where": d.where})
    return program, log


def _dims(spec: Any) -> list[Any]:
    """The dynamic dimensions named in a ``dynamic_shapes`` tree, each once, in order (not those derived from
    another, such as a length already in blocks)."""
    if isinstance(spec, torch.export.Dim):
        return [] if hasattr(spec, "root") else [spec]
    found: list[Any] = []
    for v in spec.values() if isinstance(spec, dict) else spec if isinstance(spec, (tuple, list)) else ():
        found += [d for d in _dims(v) if all(d is not f for f in found)]
    return found


def fixed_axes(inputs: Any, dynamic_shapes: dict) -> list[tuple[str, int, str, int]]:
    """(input, axis, dimension name, size) for each axis declared dynamic that the graph's inputs hold fixed;
    ``dynamic_shapes`` is read in the forward's argument order, nested tuples flattened."""
    declared: list[dict] = []

    def flatten(spec: Any) -> None:
        if isinstance(spec, dict) and not any(isinstance(v, (dict, tuple, list)) for v in spec.values()):
            declared.append(spec)
        elif isinstance(spec, dict):
            for v in spec.values():
                flatten(v)
        elif isinstance(spec, (tuple, list)):
            for v in spec:
                flatten(v)
        else:
            declared.append({})

    flatten(dynamic_shapes)
    inputs = list(inputs)
    if len(declared) != len(inputs):  # the exporter dropped an unused input: no reliable pairing
        declared = [{}] * len(inputs)
    out = []
    for value, axes in zip(inputs, declared):
        shape = value.shape
        for axis, dim in (axes or {}).items():
            if dim is None or dim is torch.export.Dim.STATIC:  # declared fixed
                continue
            if shape is not None and axis < len(shape) and isinstance(shape[axis], int):
                out.append((value.name, axis, getattr(dim, "__name__", str(dim)), int(shape[axis])))
    return out


def failure(e: BaseException) -> str:
    """One line saying why an export failed: the exporter's own summary names the root cause last in a chain of
    "<class ...>: message" lines (its first line only says which step failed); else the error's first line."""
    text = str(e).strip()
    if "Exception summary" in text:
        causes = re.findall(r"<class '([\w.]+)'>: (.+)", text.split("Exception summary", 1)[1])
        if causes:
            kind, message = causes[0]
            return f"{kind.rsplit('.', 1)[-1]}: {message.strip()[:300]}"
    return text.splitlines()[0][:300] if text else type(e).__name__
