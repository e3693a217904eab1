"""The pass pipeline as data: named stages, and one recipe row per (target, model kind, precision)
listing them in order. Adding a precision or a pass is a row or a name in a row; every row is spelt
out in full, so a pass added to one recipe never shifts another.

A stage is calibrated when it is built from statistics of the graph it receives (SmoothQuant, outlier
splitting, the quantizers): the compiler's INT8 driver (``kiln.compiler.quantize.driver``) runs the
graph on calibration text and hands the numbers in.

Attention arrives as one captured node per call (``kiln.passes.attention_node``). Each recipe lowers it by what
the target runs best, fused kernels first, and ends with ``lower-attention``, which turns whatever no kernel took
into standard ops; a decoder gets its cache from ``kv-cache`` (fused layers) or ``kv-cache-concat`` (the rest).
After the pipeline, ``attention_summary`` records which layers run fused and why the others do not; it fails the
compile only under ``--require-fusion``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.compiler.options import REDUCED_FLOAT, CompileOptions
from kiln.errors import KilnError, UsageError
from kiln.passes import Pass
from kiln.passes.broadcast_rotary import BroadcastRotary
from kiln.passes.canonicalize_attention import CanonicalizeAttention
from kiln.passes.check_tensorrt import CheckTensorRTOps
from kiln.passes.cleanup import (
    DeduplicateInitializers,
    EliminateDeadNodes,
    EliminateIdentity,
    EliminateUnusedIO,
    FoldConstants,
    GemmToMatMul,
)
from kiln.passes.decompose_norm import DecomposeNorm
from kiln.passes.fuse_attention import FuseAttention
from kiln.passes.fuse_gqa import FuseGroupQueryAttention
from kiln.passes.fuse_mha import FuseMultiHeadAttention
from kiln.passes.fuse_moe import FuseMixtureOfExperts
from kiln.passes.fuse_norm_gelu import FuseBiasGelu, FuseSkipLayerNorm
from kiln.passes.kiln_kernels import UseKilnKernels
from kiln.passes.kv_cache import AddKVCache
from kiln.passes.kv_cache_concat import AddKVCacheConcat
from kiln.passes.pin_norms import PinNormsFP32
from kiln.passes.reduce_precision import ReducePrecision
from kiln.passes.quantize_int8 import QuantizeDynamicInt8
from kiln.passes.codes import Codebook
from kiln.passes.quantize_nbits import QuantizeBlockwise
from kiln.passes.quantize_qdq import QuantizeStaticQDQ
from kiln.passes.logits_to_keep import LogitsToKeep
from kiln.passes.lower_attention import LowerAttention
from kiln.passes.smoothquant import SmoothQuant
from kiln.passes.split_outliers import SplitOutlierChannels


@dataclass(frozen=True)
class ModelFacts:
    """What passes may know about the model (one graph of it), handed to them: passes never read checkpoints."""

    kind: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_length: int
    attentions_per_layer: int = 1
    """Attention blocks per layer in this graph (an encoder-decoder's decoder: self + cross)."""
    experts_layers: int = 0
    """Mixture-of-experts layers (routed experts modules) in the model: ``fuse-moe`` must fold every one."""
    captured: int = 0
    """Attention calls the trace captured as nodes (0: not known, or none): where set, the attention blocks counted
    (a layer may attend twice, a config may not name its heads)."""


@dataclass
class StageData:
    """What the INT8 driver measured for a calibrated stage (absent for the others)."""

    channel_absmax: dict[str, Any] = field(default_factory=dict)
    ranges: dict[str, tuple[float, float]] | None = None
    keep_fp32: tuple[str, ...] = ()
    given: Codebook | None = None
    """INT4 GPTQ: the solver's codes, found by the FP32 weights they replace."""
    promote_int8: tuple[str, ...] = ()
    """INT4 under a budget: weights lowered at 8 bits instead of 4."""


Make = Callable[[ModelFacts, CompileOptions, StageData], Pass]


@dataclass(frozen=True)
class Stage:
    make: Make
    calibrated: bool = False
    """Built from calibration statistics of the graph it receives."""
    quantizer: bool = False
    """Turns weights INT8: the accuracy budget chooses its ``keep_fp32``."""
    when: Callable[[CompileOptions], bool] = lambda o: True
    """Runs only when the options ask for it (SmoothQuant's alpha, a non-zero outlier ratio)."""
    coverage: str | None = None
    """The stat that counts what the stage fused: compared with one per attention block (``attention_summary``)."""
    expected: Callable[[ModelFacts], int] = lambda f: max(f.num_layers * f.attentions_per_layer, f.captured)
    """How many ``coverage`` counts when every block is fused (default: the attention blocks)."""
    covers: str = "attention"
    """What the coverage is of: "attention" (the fused kernels), "cache" (a decoder's KV cache) or "experts"."""


STAGES: dict[str, Stage] = {
    "eliminate-identity": Stage(lambda f, o, d: EliminateIdentity()),
    "fold-constants": Stage(lambda f, o, d: FoldConstants()),
    "dedup-initializers": Stage(lambda f, o, d: DeduplicateInitializers()),
    "eliminate-unused-io": Stage(lambda f, o, d: EliminateUnusedIO()),
    "broadcast-rotary": Stage(lambda f, o, d: BroadcastRotary()),
    "fuse-attention": Stage(lambda f, o, d: FuseAttention(), coverage="fused"),
    "fuse-gqa": Stage(lambda f, o, d: FuseGroupQueryAttention(f.max_length), coverage="fused"),
    "kv-cache": Stage(lambda f, o, d: AddKVCache(f.num_kv_heads, f.head_size), coverage="layers", covers="cache"),
    "kv-cache-concat": Stage(lambda f, o, d: AddKVCacheConcat(f.num_kv_heads, f.head_size), coverage="layers",
                             covers="cache"),
    # whatever attention no fused kernel took -> standard ONNX ops (the fallback every model compiles with)
    "lower-attention": Stage(lambda f, o, d: LowerAttention(), coverage="lowered", covers="lowered"),
    "logits-to-keep": Stage(lambda f, o, d: LogitsToKeep()),
    # every routed-experts layer: the dense export runs E / k times the routed work (kiln/passes/fuse_moe.py)
    "fuse-moe": Stage(lambda f, o, d: FuseMixtureOfExperts(), coverage="fused", expected=lambda f: f.experts_layers,
                      covers="experts"),
    "fuse-mha": Stage(lambda f, o, d: FuseMultiHeadAttention(), coverage="fused"),
    "fuse-bias-gelu": Stage(lambda f, o, d: FuseBiasGelu()),
    # RMSNorm: ORT's CPU kernel is fast, so residual RMSNorms become SkipSimplifiedLayerNormalization and the
    # rest stay whole (prefill 36.1 vs 37.4 ms decomposed, 32M Llama, batch 1 x 128).
    "fuse-skip-layernorm": Stage(lambda f, o, d: FuseSkipLayerNorm(norms=("RMSNormalization",))),
    # LayerNorms are decomposed rather than fused into SkipLayerNormalization: ORT's CPU LayerNorm kernel is
    # 3-5x slower than the elementwise form (see kiln/passes/decompose_norm.py).
    "decompose-norm": Stage(lambda f, o, d: DecomposeNorm()),
    "canonicalize-attention": Stage(lambda f, o, d: CanonicalizeAttention(f.head_size)),
    # FP16 graphs keep a decoder's KV cache in FP16 at the boundary too; BF16 ones in FP32 (numpy has no bfloat16)
    "reduce-precision": Stage(lambda f, o, d: ReducePrecision(REDUCED_FLOAT.get(o.precision, "float16"),
                                                              retyped_io=KV_IO if o.precision == "fp16" else ())),
    "pin-norms-fp32": Stage(lambda f, o, d: PinNormsFP32()),
    "check-tensorrt-ops": Stage(lambda f, o, d: CheckTensorRTOps()),
    "gemm-to-matmul": Stage(lambda f, o, d: GemmToMatMul()),
    "smoothquant": Stage(lambda f, o, d: SmoothQuant(d.channel_absmax, o.smoothquant), calibrated=True,
                         when=lambda o: o.smoothquant is not None),
    "split-outliers": Stage(lambda f, o, d: SplitOutlierChannels(d.channel_absmax, o.outlier_ratio), calibrated=True,
                            when=lambda o: bool(o.outlier_ratio)),
    "quantize-int8": Stage(lambda f, o, d: QuantizeDynamicInt8(keep_fp32=d.keep_fp32), calibrated=True, quantizer=True),
    # decoders' INT8: 8-bit weights in blocks of INT8_BLOCK, activations quantized per row and block by the kernel
    # (accuracy level 4): small LLMs' few huge activation channels ruin one per-tensor activation scale. INT4: nbits()
    "quantize-nbits": Stage(lambda f, o, d: nbits(f, o, d), calibrated=True, quantizer=True),
    # ONNX Runtime CPU takes asymmetric uint8 activations; TensorRT only symmetric int8 (the gate checks it)
    "quantize-qdq": Stage(lambda f, o, d: QuantizeStaticQDQ(d.ranges, symmetric=o.target == "tensorrt",
                                                            keep_fp32=d.keep_fp32), calibrated=True, quantizer=True),
    # kiln's own low-bit kernel (the library built with the package) where the options and this machine allow it
    "kiln-kernels": Stage(lambda f, o, d: UseKilnKernels(), when=lambda o: kiln_kernels(o)),
    "eliminate-dead-nodes": Stage(lambda f, o, d: EliminateDeadNodes()),
}


def kiln_kernels(o: CompileOptions) -> bool:
    """Whether the CPU artifact computes its MatMulNBits with kiln's library (``--kernels``)."""
    from kiln.runtimes import kernels

    if o.kernels == "kiln" and not kernels.available():
        raise UsageError(f"--kernels kiln: {kernels.status()['reason']}; reinstall kiln where a C++17 compiler is "
                         "found (pip install -e . builds it), or compile with --kernels onnxruntime")
    return o.target == "cpu" and (o.kernels == "kiln" or o.kernels == "auto" and kernels.available())

HEAD_BITS = {"fp32": 0, "int8": 8, "int4": 4}
KV_IO = ("past_key_values.", "present.")
DEFAULT_LM_HEAD = "int8"
"""INT4's lm_head and embedding table: SmolLM2-135M held-out perplexity (docs/int4.md) int8 costs next to
nothing over FP32 and keeps the artifact under 0.3x; int4 there costs several points."""
HEAD_BLOCK = 64
"""Block of an 8-bit lm_head and embedding table under INT4: 64 (FP16 scales: 8.25 bits per weight) rather than 32
(8.5): SmolLM2-135M's tied 49152 x 576 table is 0.8 MiB smaller, its RTN error stays far under the 4-bit body's."""


INT8_BLOCK = 128
"""Decoders' INT8 (8-bit MatMulNBits, outlier channels split off): SmolLM2-135M blocks of 16 / 64 / 128 measured
held-out perplexity +0.1% / +0.58% / +0.92% over FP32, worst logit-row cosine 0.9953 / 0.9860 / 0.9849 (parity
bound 0.98) and decode 110 / 137 / 146 tok/s against FP32's 70 in one run (docs/int8.md): the only block size that
decodes at 2x FP32 inside +1% perplexity. Without the outlier split 128 decodes at 170 but fails parity (0.93)."""


def nbits(f: ModelFacts, o: CompileOptions, d: StageData) -> Pass:
    if o.precision != "int4":
        return QuantizeBlockwise(bits=8, block_size=INT8_BLOCK, keep_fp32=d.keep_fp32, accuracy_level=o.accuracy_level)
    trt = o.target == "tensorrt"
    head = HEAD_BITS[o.lm_head or DEFAULT_LM_HEAD]
    return QuantizeBlockwise(
        bits=4, block_size=o.group_size, accuracy_level=o.accuracy_level, keep_fp32=d.keep_fp32,
        grid="asym" if o.asym else "positive" if trt else "signed", given=d.given, head_bits=head,
        head_block_size=(32 if trt else HEAD_BLOCK) if head == 8 else o.group_size, promote_int8=d.promote_int8,
        embedding_bits=head if f.kind == "decoder" and not trt else 0, form="dequantize" if trt else "matmulnbits")


CLEANUP = ("eliminate-identity", "fold-constants", "dedup-initializers", "eliminate-unused-io", "broadcast-rotary")
INT8 = ("gemm-to-matmul", "smoothquant", "split-outliers")
"""Before a quantizer: one weight-MatMul form (GPT-2's Conv1D exports as Gemm), then the calibrated rewrites."""
DECODER_ATTENTION = ("fuse-gqa", "kv-cache", "kv-cache-concat", "lower-attention")
"""A decoder's attention: GroupQueryAttention with the in-place cache where every layer fits it, else a Concat cache
on the captured nodes and standard ops."""

# (target, kind, precision) -> stage names in order. Precision "int8-static" is INT8 in QDQ form
# (``--static``; TensorRT's only INT8). TensorRT: standard-domain ops only (checked last by a gate), attention
# in the canonical form its fused MHA kernel takes, norms kept whole (TensorRT fuses them) and pinned to
# FP32 when the graph is reduced precision. Every recipe is verified on ONNX Runtime CPU.
RECIPES: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("cpu", "encoder", "fp32"): (*CLEANUP, "fuse-attention", "lower-attention", "fuse-bias-gelu", "decompose-norm",
                                 "eliminate-dead-nodes"),
    # the fused Attention becomes QAttention (its packed QKV GEMM in INT8, as ONNX Runtime's quantizer does)
    ("cpu", "encoder", "int8"): (*CLEANUP, "fuse-attention", "lower-attention", "fuse-bias-gelu", "decompose-norm",
                                 *INT8, "quantize-int8", "eliminate-dead-nodes"),
    # fuse-mha keeps Q/K/V plain MatMuls the QDQ pairs can wrap
    ("cpu", "encoder", "int8-static"): (*CLEANUP, "fuse-mha", "lower-attention", "fuse-bias-gelu", "decompose-norm",
                                        *INT8, "quantize-qdq", "eliminate-dead-nodes"),
    ("cpu", "decoder", "fp32"): (*CLEANUP, *DECODER_ATTENTION, "fuse-moe", "fuse-bias-gelu", "fuse-skip-layernorm",
                                 "decompose-norm", "logits-to-keep", "eliminate-dead-nodes"),
    # blocked 8-bit kernel (MatMulNBits), tied lm_head included; outliers split: at block 128 SmolLM2's worst row
    # cosine is 0.9849 with, 0.93 without (parity fails), for 146 vs 170 tok/s (docs/int8.md)
    ("cpu", "decoder", "int8"): (*CLEANUP, *DECODER_ATTENTION, "fuse-moe", "fuse-bias-gelu", "fuse-skip-layernorm",
                                 "decompose-norm", *INT8, "quantize-nbits", "kiln-kernels", "logits-to-keep",
                                 "eliminate-dead-nodes"),
    ("cpu", "decoder", "int8-static"): (*CLEANUP, *DECODER_ATTENTION, "fuse-bias-gelu", "fuse-skip-layernorm",
                                        "decompose-norm", *INT8, "quantize-qdq", "logits-to-keep", "eliminate-dead-nodes"),
    # weight-only 4-bit (GPTQ codes or round-to-nearest): no SmoothQuant or outlier split, they would change the
    # weights the solver's codes replace; encoders keep Q/K/V as plain MatMuls (fuse-mha) so they are quantized too
    ("cpu", "encoder", "int4"): (*CLEANUP, "fuse-mha", "lower-attention", "fuse-bias-gelu", "decompose-norm",
                                 "gemm-to-matmul", "quantize-nbits", "kiln-kernels", "eliminate-dead-nodes"),
    ("cpu", "decoder", "int4"): (*CLEANUP, *DECODER_ATTENTION, "fuse-moe", "fuse-bias-gelu", "fuse-skip-layernorm",
                                 "decompose-norm", "gemm-to-matmul", "quantize-nbits", "kiln-kernels",
                                 "logits-to-keep", "eliminate-dead-nodes"),
    ("cpu", "seq2seq", "fp32"): (*CLEANUP, "fuse-mha", "lower-attention", "decompose-norm", "eliminate-dead-nodes"),
    ("tensorrt", "encoder", "fp32"): (*CLEANUP, "lower-attention", "canonicalize-attention", "pin-norms-fp32",
                                      "eliminate-dead-nodes", "check-tensorrt-ops"),
    # decoders: the KV cache as standard-op Concats (kv-cache-concat), Attention itself without cache IO
    ("tensorrt", "decoder", "fp32"): (*CLEANUP, "kv-cache-concat", "lower-attention", "canonicalize-attention",
                                      "pin-norms-fp32", "eliminate-dead-nodes", "check-tensorrt-ops"),
    # FP16 / BF16: weights and activations reduced, index-derived values and IO kept, then norms, softmax and
    # reductions pinned back to FP32 (TensorRT's networks are strongly typed: the graph's types are the precision)
    **{("tensorrt", kind, p): (*CLEANUP, *(("kv-cache-concat",) if kind == "decoder" else ()), "lower-attention",
                               "canonicalize-attention", "reduce-precision", "pin-norms-fp32", "eliminate-dead-nodes",
                               "check-tensorrt-ops")
       for kind in ("encoder", "decoder") for p in ("fp16", "bf16")},
    ("tensorrt", "encoder", "int8-static"): (*CLEANUP, "lower-attention", "canonicalize-attention", "pin-norms-fp32",
                                             *INT8, "quantize-qdq", "eliminate-dead-nodes", "check-tensorrt-ops"),
    ("tensorrt", "decoder", "int8-static"): (*CLEANUP, "kv-cache-concat", "lower-attention", "canonicalize-attention",
                                             "pin-norms-fp32", *INT8, "quantize-qdq", "eliminate-dead-nodes",
                                             "check-tensorrt-ops"),
    # blocked INT4 DequantizeLinear (opset 21) + MatMul, symmetric with positive scales
    ("tensorrt", "encoder", "int4"): (*CLEANUP, "lower-attention", "canonicalize-attention", "pin-norms-fp32",
                                      "gemm-to-matmul", "quantize-nbits", "eliminate-dead-nodes", "check-tensorrt-ops"),
    ("tensorrt", "decoder", "int4"): (*CLEANUP, "kv-cache-concat", "lower-attention", "canonicalize-attention",
                                      "pin-norms-fp32", "gemm-to-matmul", "quantize-nbits", "eliminate-dead-nodes",
                                      "check-tensorrt-ops"),
}


class FusionCoverageError(KilnError):
    """``--require-fusion``: some attention (or routed-experts) blocks run on the unfused path."""


def precision_mode(options: CompileOptions) -> str:
    """The recipe column: fp32, int8 (dynamic) or int8-static (QDQ; TensorRT's only INT8 is always static)."""
    if options.precision == "int8" and (options.static or options.target == "tensorrt"):
        return "int8-static"
    return options.precision


def recipe(kind: str, options: CompileOptions) -> list[str]:
    """Stage names for this model kind and these options, in order (stages whose option is off left out);
    ``--disable-pass`` names are checked against the whole row."""
    mode = precision_mode(options)
    row = RECIPES.get((options.target, kind, mode))
    if row is None:
        raise UsageError(f"precision {mode} is not available for {kind} models on target {options.target}; "
                         "compile with --precision fp32 or --target cpu")
    unknown = sorted(set(options.disabled_passes) - set(row))
    if unknown:
        raise UsageError(f"--disable-pass {', '.join(unknown)}: no such pass in this pipeline; "
                         f"passes: {', '.join(sorted(set(row)))}")
    quantizers = [n for n in row if STAGES[n].quantizer and n in options.disabled_passes]
    if quantizers:
        raise UsageError(f"--disable-pass {quantizers[0]} leaves a --precision {options.precision} graph unquantized; "
                         "compile with --precision fp32 instead")
    if "lower-attention" in options.disabled_passes:
        raise UsageError("--disable-pass lower-attention would leave kiln's captured attention nodes in the artifact, "
                         "which no runtime runs; disable the fusion passes instead")
    return [n for n in row if STAGES[n].when(options)]


def build_pass(name: str, facts: ModelFacts, options: CompileOptions, data: StageData | None = None) -> Pass:
    p = STAGES[name].make(facts, options, data or StageData())
    assert p.name == name, f"stage {name} builds pass {p.name}"
    return p


def attention_summary(record: list[dict[str, Any]], facts: ModelFacts, require_fusion: bool, graph: str = "",
                      delegated: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Which attention blocks run fused, and why the others do not, from the passes' record (each fusion stage's
    count against one per block, their reasons, the capture's calls left to the model's own code). Returns the
    summary (the manifest's ``attention``) and one line per shortfall; raises under ``--require-fusion``."""
    fused, lowered, reasons, cache, experts = 0, {}, [], None, None
    for entry in record:
        stage = STAGES.get(entry["name"])
        if stage is None or stage.coverage is None or entry.get("disabled"):
            continue
        expected, got = stage.expected(facts), int(entry["stats"].get(stage.coverage, 0))
        entry["coverage"] = {"expected": expected, "fused": got}
        skipped = entry.get("skipped", [])
        if stage.covers == "attention":
            fused += got
            if got:
                lowered[entry["name"]] = got
            if got < expected:
                reasons += [f"{entry['name']}: {r['where']}: {r['why']}" for r in skipped]
        elif stage.covers == "lowered" and got:
            lowered[entry["name"]] = got
        elif stage.covers == "cache" and got:
            cache = entry["name"]
        elif stage.covers == "experts" and expected:
            experts = {"layers": expected, "fused": got,
                       "unfused_why": [f"{r['where']}: {r['why']}" for r in skipped][:3] if got < expected else []}
    if experts is None and facts.experts_layers:  # a recipe without fuse-moe (encoder-decoders)
        experts = {"layers": facts.experts_layers, "fused": 0,
                   "unfused_why": ["this recipe has no MoE kernel: each expert runs on every token, masked"]}
    layers = max(facts.num_layers * facts.attentions_per_layer, facts.captured + len(delegated or []))
    unfused = max(layers - fused, 0)
    why = sorted(set(reasons))
    for d in delegated or []:
        why.append(f"layer {d['layer']} ({d['module']}): {d['why']}")
    if unfused and not why:
        why.append("the family computes attention itself (it does not call transformers' attention interface): "
                   "its attention runs as traced")
    summary: dict[str, Any] = {"layers": layers, "fused": fused, "lowered": lowered, "unfused": unfused,
                               "why": why[:8]}
    if facts.kind == "decoder" and graph == "":
        summary["cache"] = cache
    if experts is not None:
        summary["experts"] = experts
    problems = []
    where = f" in {graph}" if graph else ""
    if unfused:
        problems.append(f"{unfused} of {layers} attention blocks{where} run unfused ({'; '.join(why[:3])})")
    if experts is not None and experts["fused"] < experts["layers"]:
        problems.append(f"{experts['layers'] - experts['fused']} of {experts['layers']} routed-experts layers{where} "
                        f"run dense ({'; '.join(experts['unfused_why'][:2])})")
    if problems and require_fusion:
        raise FusionCoverageError(f"incomplete fusion: {' | '.join(problems)}; drop --require-fusion to ship the "
                                  "verified fallback (recorded in the manifest), or --disable-pass the rule")
    return summary, problems
