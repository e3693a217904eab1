"""The pass pipeline as data: which passes run for a target, model kind and precision, in order,
and the fusion coverage check that refuses to pass a half-fused graph off as optimised."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError, UsageError
from kiln.passes import Pass
from kiln.passes.cleanup import (
    DeduplicateInitializers,
    EliminateDeadNodes,
    EliminateIdentity,
    EliminateUnusedIO,
    FoldConstants,
    GemmToMatMul,
)
from kiln.passes.canonicalize_attention import CanonicalizeAttention
from kiln.passes.check_tensorrt import CheckTensorRTOps
from kiln.passes.decompose_norm import DecomposeNorm
from kiln.passes.fuse_attention import FuseAttention
from kiln.passes.fuse_gqa import FuseGroupQueryAttention
from kiln.passes.fuse_norm_gelu import FuseBiasGelu, FuseSkipLayerNorm
from kiln.passes.fuse_mha import FuseMultiHeadAttention
from kiln.passes.kv_cache import AddKVCache
from kiln.passes.quantize_int8 import QuantizeDynamicInt8
from kiln.passes.quantize_qdq import QuantizeStaticQDQ
from kiln.passes.pin_norms import PinNormsFP32


@dataclass(frozen=True)
class ModelFacts:
    """What passes may know about the model, handed to them (passes never read checkpoints)."""

    kind: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_length: int
    sliding_windows: tuple[int | None, ...] = ()
    """Per layer, in graph order: the attention window, or None for full attention."""


class FusionCoverageError(KilnError):
    """Fewer fusions than the model has layers: the graph would ship half-optimised."""


PassFactory = Callable[[ModelFacts], Pass]

# ONNX Runtime CPU. LayerNorms are decomposed rather than fused into SkipLayerNormalization: ORT's CPU
# LayerNorm kernel is 3-5x slower than the elementwise form (see kiln/passes/decompose_norm.py).
CLEANUP: list[PassFactory] = [lambda f: EliminateIdentity(), lambda f: FoldConstants(), lambda f: DeduplicateInitializers(),
                              lambda f: EliminateUnusedIO()]
# TensorRT: standard-domain ops only (checked last by a gate), attention in the canonical form its
# fused MHA kernel takes, norms kept whole (TensorRT fuses them) and pinned to FP32 when the graph is
# reduced precision. Verified on ONNX Runtime CPU like every artifact.
TENSORRT: list[PassFactory] = [
    *CLEANUP,
    lambda f: CanonicalizeAttention(f.head_size),
    lambda f: PinNormsFP32(),
    lambda f: EliminateDeadNodes(),
    lambda f: CheckTensorRTOps(),
]
PIPELINES: dict[tuple[str, str, str], list[PassFactory]] = {
    ("tensorrt", "encoder", "fp32"): TENSORRT,
    ("tensorrt", "decoder", "fp32"): TENSORRT,
    ("cpu", "encoder", "fp32"): [
        *CLEANUP,
        lambda f: FuseAttention(num_heads=f.num_heads),
        lambda f: FuseBiasGelu(),
        lambda f: DecomposeNorm(),
        lambda f: EliminateDeadNodes(),
    ],
    # RMSNorm: ORT's CPU kernel is fast, so residual RMSNorms become SkipSimplifiedLayerNormalization
    # and the rest stay whole (prefill 36.1 vs 37.4 ms decomposed, 32M Llama, batch 1 x 128).
    ("cpu", "decoder", "fp32"): [
        *CLEANUP,
        lambda f: FuseGroupQueryAttention(f.num_heads, f.num_kv_heads, f.max_length, f.sliding_windows),
        lambda f: AddKVCache(f.num_kv_heads, f.head_size),
        lambda f: FuseBiasGelu(),
        lambda f: FuseSkipLayerNorm(norms=("RMSNormalization",)),
        lambda f: DecomposeNorm(ops=("LayerNormalization",)),
        lambda f: EliminateDeadNodes(),
    ],
}

# INT8 (dynamic): the FP32 fusions first, then every weight quantized: MatMuls -> DynamicQuantizeMatMul,
# the encoders' packed Attention -> QAttention (its QKV GEMM in INT8, as ONNX Runtime's own quantizer does).
PIPELINES[("cpu", "encoder", "int8")] = [
    *CLEANUP,
    lambda f: FuseAttention(num_heads=f.num_heads),
    lambda f: FuseBiasGelu(),
    lambda f: DecomposeNorm(),
    lambda f: GemmToMatMul(),
    lambda f: QuantizeDynamicInt8(),
    lambda f: EliminateDeadNodes(),
]
PIPELINES[("cpu", "decoder", "int8")] = [
    *PIPELINES[("cpu", "decoder", "fp32")][:-1], lambda f: GemmToMatMul(), lambda f: QuantizeDynamicInt8(),
    lambda f: EliminateDeadNodes()]
# Static INT8 (QDQ): calibrated Quantize/DequantizeLinear pairs on weight MatMul inputs, asymmetric uint8
# activations on ONNX Runtime CPU, symmetric int8 for TensorRT (its only kind; the gate checks it).
# Encoders use fuse-mha so that Q/K/V stay plain MatMuls the QDQ pairs can wrap.
PIPELINES[("cpu", "encoder", "int8-static")] = [
    *CLEANUP,
    lambda f: FuseMultiHeadAttention(f.num_heads, f.head_size),
    lambda f: FuseBiasGelu(),
    lambda f: DecomposeNorm(),
    lambda f: GemmToMatMul(),
    lambda f: QuantizeStaticQDQ(),
    lambda f: EliminateDeadNodes(),
]
PIPELINES[("cpu", "decoder", "int8-static")] = [
    *PIPELINES[("cpu", "decoder", "int8")][:-2], lambda f: QuantizeStaticQDQ(), lambda f: EliminateDeadNodes()]
for _kind in ("encoder", "decoder"):
    PIPELINES[("tensorrt", _kind, "int8-static")] = [
        *TENSORRT[:-2], lambda f: GemmToMatMul(), lambda f: QuantizeStaticQDQ(symmetric=True), *TENSORRT[-2:]]

# pass name -> (stat that counts fusions, expected count per layer); checked after the pipeline
COVERAGE: dict[str, tuple[str, int]] = {
    "fuse-attention": ("fused", 1),
    "fuse-gqa": ("fused", 1),
    "canonicalize-attention": ("canonical", 1),
    "kv-cache": ("layers", 1),
    "fuse-mha": ("fused", 1),
}


def select_passes(facts: ModelFacts, precision: str, target: str = "cpu", static: bool = False) -> list[Pass]:
    """The pipeline for a target, model kind and precision; TensorRT's INT8 is always static (QDQ)."""
    key = f"{precision}-static" if precision == "int8" and (static or target == "tensorrt") else precision
    pipeline = PIPELINES.get((target, facts.kind, key))
    if pipeline is None:
        raise UsageError(f"precision {key} is not available for {facts.kind} models on target {target}; "
                        f"compile with --precision fp32 or --target cpu")
    return [make(facts) for make in pipeline]


def check_coverage(record: list[dict[str, Any]], facts: ModelFacts, allow_partial: bool) -> list[str]:
    """Compare fusion counts with what the config implies; raise (or, if allowed, return) shortfalls."""
    problems = []
    for entry in record:
        rule = COVERAGE.get(entry["name"])
        if rule is None or entry.get("disabled"):
            continue
        stat, per_layer = rule
        expected = facts.num_layers * per_layer
        got = entry["stats"].get(stat, 0)
        entry["coverage"] = {"expected": expected, "fused": got}
        if got < expected:
            reasons = "; ".join(f"{r['where']}: {r['why']}" for r in entry.get("skipped", [])[:3]) or "no candidates found"
            problems.append(f"{entry['name']} fused {got} of {expected} expected ({reasons})")
    if problems and not allow_partial:
        raise FusionCoverageError(
            f"incomplete fusion: {' | '.join(problems)}; pass --allow-partial-fusion to ship it anyway, "
            "or --disable-pass the rule"
        )
    return problems
