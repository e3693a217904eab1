"""The one place compile defaults live: the CLI, the Python API and the manifest all read them here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

TASKS = ("feature-extraction", "sequence-classification", "token-classification", "causal-lm", "text2text-generation")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
REDUCED_FLOAT = {"fp16": "float16", "bf16": "bfloat16"}
"""TensorRT-only precisions: the graph stores weights and activations in this type (kiln/passes/reduce_precision.py)."""
"""int8: weights int8 per output channel; activations quantized at run time (dynamic, the cpu default) or
with calibrated ranges in QDQ form (``static``; always on the tensorrt target, symmetric there).
int4: weight-only 4-bit codes in groups along the input dimension (GPTQ or round-to-nearest), MatMulNBits on
the cpu target, blocked INT4 DequantizeLinear on tensorrt."""
QUANT_METHODS = ("gptq", "rtn", "awq", "awq+gptq")
SOLVED_METHODS = ("gptq", "awq+gptq")
"""INT4 methods whose codes come from GPTQ's solver (the others: the pass's round-to-nearest)."""
AWQ_METHODS = ("awq", "awq+gptq")
"""INT4 methods that scale the eager model with AWQ before it is traced (``Driver.awq``)."""
LM_HEADS = ("fp32", "int8", "int4")
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
TARGETS = ("cpu", "tensorrt")
STREAM_ABOVE = 1 << 30
"""``--stream`` auto: checkpoints whose FP32 weights exceed 1 GiB stream (the in-memory path peaks near 5x them)."""
"""cpu: ONNX Runtime's contrib-op graph; tensorrt: standard-op graph for TensorRT's parser (also runs on ONNX Runtime)."""


@dataclass
class CompileOptions:
    task: str | None = None
    """Override the head the checkpoint's ``architectures`` implies (one of TASKS)."""
    precision: str = "fp32"
    target: str = "cpu"
    opset: int = 23
    verify: bool = True
    """Run the parity check; ``False`` is recorded in the manifest."""
    force: bool = False
    """Replace an existing output directory."""
    threads: int | None = None
    """Intra-op threads for verification and latency, eager and artifact alike (None: all cores)."""
    verify_max_length: int = 512
    """Longest random sequence the parity check runs (capped at the model's maximum)."""
    latency_shape: tuple[int, int] = (1, 128)
    """(batch, sequence) at which eager and artifact latency are measured (sequence capped)."""
    latency_budget_s: float = 4.0
    """Seconds spent timing eager and artifact together (alternating rounds)."""
    seed: int = 0
    max_drop: str | None = None
    """INT8 accuracy budget, e.g. "cosine=0.995" (encoders): weights stay FP32 until it holds on held-out text."""
    calibration: str | None = None
    """Text file (one text per line) or JSONL ("text" field) for INT8 calibration and the budget; default: Python
    docs sentences. A quarter of the texts (by hash) is held out to measure the budget."""
    static: bool = False
    """INT8 in QDQ form with activation ranges calibrated on text, instead of ranges measured at run time."""
    calibration_method: str = "minmax"
    """How static INT8 turns activation statistics into a range: minmax, percentile (99.99) or entropy (KL)."""
    outlier_ratio: float = 6.0
    """When INT8 calibrates (static, SmoothQuant or a budget): activation channels above this many times the
    median channel's maximum are multiplied in FP32 beside the INT8 product (0 turns it off)."""
    smoothquant: float | None = None
    """SmoothQuant alpha in [0, 1] (0.5 typical): move activation outliers into the weights before INT8."""
    quant_method: str = "gptq"
    """int4: gptq (layer by layer on calibration text), rtn (round-to-nearest, no data), awq (activation-aware
    scales on calibration text, then round-to-nearest) or awq+gptq (AWQ's scales, then GPTQ)."""
    group_size: int = 32
    """int4: inputs per scale, a power of two >= 16; 0: one group per row. 32: SmolLM2-135M held-out perplexity
    +11.6% over FP32 (GPTQ, act-order) against +13.0% at 128, at 0.63 vs 0.53 bytes per weight."""
    act_order: bool = True
    """int4 GPTQ: solve columns by descending Hessian diagonal, groups static (parameters from the original weights in
    the input order: no activation Gather in the graph): SmolLM2-135M group 128, 32 windows, held-out perplexity
    +26.9% -> +12.4% over FP32."""
    prune: str | None = None
    """Structured pruning before export: ``heads=R,ffn=R`` (fractions of every layer's heads / FFN channels)."""
    prune_method: str = "flap"
    """How pruned heads and channels are chosen: flap, wanda or magnitude (kiln.compiler.prune)."""
    prune_layers: str = "uniform"
    """uniform (the same count from every layer) or adaptive (FLAP's across-layer ranking: per-layer counts)."""
    asym: bool | None = None
    """int4: asymmetric groups (a zero point each); cpu target only. None: the recipe's choice (``int4_defaults``)."""
    mixed_bits: bool | None = None
    """int4 with a solver (gptq, awq+gptq): the attention input projections and the FFN down projection of llama.cpp's
    "use_more_bits" layers (the first and last eighth, every third between) solved at 8 bits (``kiln.compiler.
    quantize.gptq.more_bits_layer``). None: the recipe's choice, on for decoders on the CPU (``int4_defaults``)."""
    lm_head: str | None = None
    """int4: the lm_head and the token-embedding table's precision (fp32, int8, int4); None: int8."""
    accuracy_level: int | None = None
    """MatMulNBits accuracy_level: 4 quantizes activations to int8 per block, 0 keeps them FP32. None: the
    recipe's choice (``int4_defaults``)."""
    gptq_windows: int = 128
    """int4 GPTQ: calibration windows (of ``gptq_window`` tokens) the Hessians are measured on."""
    gptq_window: int = 256
    max_length: int | None = None
    """Decoders: KV-cache capacity (prompt + new tokens) the runtime allocates; None: the model's maximum."""
    disabled_passes: tuple[str, ...] = ()
    allow_partial_fusion: bool = False
    """Ship a graph with fewer attention fusions than layers (recorded) instead of failing."""
    external_data_threshold: int = 1 << 26
    """Graphs whose weights exceed this many bytes (64 MiB) keep them in ``model.onnx.data``: ONNX Runtime maps that
    file instead of parsing the weights out of the protobuf and copying them (SmolLM2-135M FP32: peak RSS of a
    64 + 64 token generate 1103 MiB embedded, 686 MiB external, for 516 MiB of weights)."""

    stream: bool | None = None
    """Read the checkpoint one tensor at a time instead of loading the model (decoders from safetensors): the
    graph is traced from an empty shell, weights stream into external data, and verification runs the reference one
    layer at a time. None: stream when the FP32 weights exceed ``STREAM_ABOVE``."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency_shape"] = list(self.latency_shape)
        d["disabled_passes"] = list(self.disabled_passes)
        return d


def int4_defaults(kind: str, options: CompileOptions) -> CompileOptions:
    """``asym`` and ``accuracy_level`` left to the recipe, resolved once the model kind is known. Encoders' INT4 on
    the CPU: asymmetric groups, FP32 activations (all-MiniLM-L6-v2 group 32, 200 held-out sentences: min cosine
    0.9781 -> 0.9851, batch 1 / 8 latency 0.98x / 0.93x -> 1.03x / 1.00x ORT's RTN INT4 graph, one run each; at a
    sequence of 128 the kernel is a GEMM, where FP32 activations cost nothing). Decoders: symmetric, int8
    activations per block (decode is a GEMV: level 4 is the fast one), and with a solver on the CPU mixed widths
    (SmolLM2-135M GPTQ, llama-perplexity's protocol: +9.3% -> +5.8% over FP32 at 99.6 -> 100.4 MiB, decode
    1.04x -> 0.95x llama.cpp Q4_K_M's; README, INT4)."""
    from dataclasses import replace

    encoder_cpu = kind == "encoder" and options.target == "cpu" and options.precision == "int4"
    asym = options.asym if options.asym is not None else encoder_cpu
    level = options.accuracy_level if options.accuracy_level is not None else 0 if encoder_cpu else 4
    mixed = options.mixed_bits if options.mixed_bits is not None else \
        kind == "decoder" and options.target == "cpu" and options.quant_method in SOLVED_METHODS
    return replace(options, asym=asym, accuracy_level=level, mixed_bits=mixed)

