"""The one place compile options live: their defaults, their choices and their checks, for the CLI (argparse takes
its choices here), the Python API and the manifest alike.

Two checks: every value on its own when a ``CompileOptions`` is made (``CompileOptions(accuracy_level=9)`` raises),
and the options together (``check``: e.g. ``--asym`` without ``--precision int4``) once, when a compile starts.
Checks that need the model (a group size larger than a layer, a ``--max-length`` over the model's maximum, a
``--max-drop`` metric for the other model kind) run where the model is known, against the values parsed here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kiln.errors import UsageError
from kiln.passes.codes import GROUP_SIZE

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
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
"""MatMulNBits accuracy_level: 0 keeps activations FP32, 1-4 compute in fp32/fp16/bf16/int8 (ONNX Runtime's spec)."""
PRUNE_METHODS = ("flap", "wanda", "magnitude")
"""How --prune chooses heads and channels: FLAP's fluctuation metric with bias compensation (An et al. 2024),
Wanda's |W|·||X|| (Sun et al. 2023), or weight magnitude (no data)."""
PRUNE_COMPONENTS = ("heads", "ffn")
PRUNE_LAYERS = ("uniform", "adaptive")
KERNELS = ("auto", "kiln", "onnxruntime")
MAX_DROP_METRICS = {"cosine": ("encoder", "minimum pooled-output cosine vs FP32, e.g. cosine=0.995"),
                    "ppl": ("decoder", "perplexity increase in percent, e.g. ppl=2"),
                    "top1": ("decoder", "next-token top-1 agreement with FP32, e.g. top1=0.98"),
                    "kl": ("decoder", "mean next-token KL divergence from FP32, e.g. kl=0.01")}
"""--max-drop metric -> (the model kind it is measured on, what it means)."""
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
    group_size: int = GROUP_SIZE
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
    kernels: str = "auto"
    """Who computes the low-bit MatMuls on the CPU target: kiln (kiln's own kernel library, ``kiln.runtimes.kernels``;
    the artifact also ships ONNX Runtime's form for machines without it), onnxruntime (MatMulNBits only), or auto
    (kiln where the library is built on the compiling machine)."""
    gptq_windows: int = 128
    """int4 GPTQ: calibration windows (of ``gptq_window`` tokens) the Hessians are measured on."""
    gptq_window: int = 256
    max_length: int | None = None
    """Decoders: KV-cache capacity (prompt + new tokens) the runtime allocates; None: the model's maximum."""
    disabled_passes: tuple[str, ...] = ()
    require_fusion: bool = False
    """Fail the compile when any attention (or routed-experts) block runs on the verified fallback instead of a fused
    kernel. Off: the fallback ships and the manifest's ``attention`` section says which blocks and why."""
    external_data_threshold: int = 1 << 26
    """Graphs whose weights exceed this many bytes (64 MiB) keep them in ``model.onnx.data``: ONNX Runtime maps that
    file instead of parsing the weights out of the protobuf and copying them (SmolLM2-135M FP32: peak RSS of a
    64 + 64 token generate 1103 MiB embedded, 686 MiB external, for 516 MiB of weights)."""

    stream: bool | None = None
    """Read the checkpoint one tensor at a time instead of loading the model (decoders from safetensors): the
    graph is traced from an empty shell, weights stream into external data, and verification runs the reference one
    layer at a time. None: stream when the FP32 weights exceed ``STREAM_ABOVE``."""

    def __post_init__(self) -> None:
        check_values(self)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency_shape"] = list(self.latency_shape)
        d["disabled_passes"] = list(self.disabled_passes)
        return d


@dataclass(frozen=True)
class PruneSpec:
    """``--prune`` parsed: the fractions of every layer's heads and FFN channels to remove."""
    heads: float = 0.0
    ffn: float = 0.0
    method: str = "flap"
    auto: bool = False
    """``--prune auto``: the largest equal heads/FFN ratio that meets ``--max-drop`` (``prune_driver.prune_checkpoint``)."""
    adaptive: bool = False
    """``--prune-layers adaptive``: per-layer counts from one across-layer ranking of standardised scores (FLAP's
    structure search) instead of the same count in every layer."""


def parse_prune(text: str, method: str = "flap", per_layer: str = "uniform") -> PruneSpec:
    """``heads=0.25,ffn=0.25`` -> PruneSpec; every ratio in [0, 1). ``auto``: chosen under the budget."""
    _choice("--prune-method", method, PRUNE_METHODS)
    _choice("--prune-layers", per_layer, PRUNE_LAYERS)
    adaptive = per_layer == "adaptive"
    if text.strip() == "auto":
        return PruneSpec(method=method, auto=True, adaptive=adaptive)
    ratios: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in PRUNE_COMPONENTS or not value:
            raise UsageError(f"--prune {text!r}: give COMPONENT=RATIO pairs, components {', '.join(PRUNE_COMPONENTS)} "
                             "(e.g. heads=0.25,ffn=0.25), or auto with --max-drop")
        try:
            r = float(value)
        except ValueError as e:
            raise UsageError(f"--prune {text!r}: {value!r} is not a number") from e
        if not 0 <= r < 1:
            raise UsageError(f"--prune {text!r}: a ratio is in [0, 1) (got {name}={value})")
        ratios[name] = r
    return PruneSpec(ratios.get("heads", 0.0), ratios.get("ffn", 0.0), method, adaptive=adaptive)


def parse_max_drop(text: str, kind: str | None = None) -> tuple[str, float]:
    """``ppl=2`` -> ("ppl", 2.0); with the model ``kind`` known, a metric measured on the other kind is refused."""
    metric, _, value = text.partition("=")
    if metric not in MAX_DROP_METRICS or not value:
        choices = "; ".join(f"{m}=VALUE ({kind_}: {what})" for m, (kind_, what) in MAX_DROP_METRICS.items())
        raise UsageError(f"--max-drop {text!r}: give one of {choices}")
    try:
        v = float(value)
    except ValueError as e:
        raise UsageError(f"--max-drop {text!r}: {value!r} is not a number") from e
    if metric in ("cosine", "top1") and not 0 < v <= 1:
        raise UsageError(f"--max-drop {text!r}: a {metric} must be in (0, 1]")
    if metric in ("ppl", "kl") and not v >= 0:
        raise UsageError(f"--max-drop {text!r}: a {metric} increase cannot be negative")
    if kind is not None and MAX_DROP_METRICS[metric][0] != kind:
        fits = ", ".join(m for m, (k, _) in MAX_DROP_METRICS.items() if k == kind) or "none"
        raise UsageError(f"--max-drop {metric} is measured on {MAX_DROP_METRICS[metric][0]}s; for this {kind} use {fits}")
    return metric, v


def _choice(flag: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value!r} is unknown; choose one of {', '.join(map(str, choices))}")


def _at_least(flag: str, value: Any, low: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{flag} {value!r}: give a whole number >= {low} ({hint})")


def check_values(o: CompileOptions) -> None:
    """Every option on its own (``CompileOptions`` runs it when made): choices, ranges, and the syntax of the
    option strings (--prune, --max-drop)."""
    if o.precision not in PRECISIONS:
        raise UsageError(f"precision {o.precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if o.target not in TARGETS:
        raise UsageError(f"target {o.target!r} is not supported; choose one of {', '.join(TARGETS)}")
    if o.task is not None and o.task not in TASKS:
        raise UsageError(f"task {o.task!r} is unknown; choose one of {', '.join(TASKS)}")
    _choice("--quant-method", o.quant_method, QUANT_METHODS)
    _choice("--calibration-method", o.calibration_method, CALIBRATION_METHODS)
    _choice("--prune-method", o.prune_method, PRUNE_METHODS)
    _choice("--prune-layers", o.prune_layers, PRUNE_LAYERS)
    _choice("--kernels", o.kernels, KERNELS)
    if o.lm_head is not None:
        _choice("--lm-head", o.lm_head, LM_HEADS)
    if o.accuracy_level is not None:
        _choice("--accuracy-level", o.accuracy_level, ACCURACY_LEVELS)
    _at_least("--opset", o.opset, 17, "kiln traces at opset 17 or newer; 23 is the default")
    if o.threads is not None:
        _at_least("--threads", o.threads, 1, "or leave it out for all cores")
    _at_least("--verify-max-length", o.verify_max_length, 1, "512 is the default")
    _at_least("--seed", o.seed, 0, "0 is the default")
    _at_least("--gptq-windows", o.gptq_windows, 1, "128 is typical")
    _at_least("--gptq-window", o.gptq_window, 2, "256 is the default")
    if o.max_length is not None and (not isinstance(o.max_length, int) or o.max_length < 2):
        raise UsageError(f"--max-length {o.max_length} is too small; give at least 2 (prompt + one new token)")
    g = o.group_size
    if isinstance(g, bool) or not isinstance(g, int) or (g != 0 and (g < 16 or g & (g - 1))):
        raise UsageError(f"--group-size {g}: give a power of two >= 16 (32, 64, 128) or 0 for one group per row")
    if len(o.latency_shape) != 2 or not all(isinstance(v, int) and v >= 1 for v in o.latency_shape):
        raise UsageError(f"latency_shape {o.latency_shape!r}: give (batch, sequence), both whole numbers >= 1")
    if not o.latency_budget_s > 0:
        raise UsageError(f"latency_budget_s {o.latency_budget_s!r}: give a number of seconds above 0")
    if o.outlier_ratio and not o.outlier_ratio > 1.0:
        raise UsageError(f"--outlier-ratio {o.outlier_ratio}: give a ratio above 1 (6 is typical) or 0 to turn it off")
    if o.smoothquant is not None and not 0.0 <= o.smoothquant <= 1.0:
        raise UsageError(f"--smoothquant {o.smoothquant}: alpha must be in [0, 1] (0.5 is typical)")
    if o.external_data_threshold < 0:
        raise UsageError(f"external_data_threshold {o.external_data_threshold}: give a byte count >= 0")
    if o.prune:
        parse_prune(o.prune, o.prune_method, o.prune_layers)
    if o.max_drop:
        parse_max_drop(o.max_drop)


def check(o: CompileOptions) -> None:
    """The options together, once per compile: each flag that configures another mode names the flag it needs."""
    if o.precision in REDUCED_FLOAT and o.target != "tensorrt":
        raise UsageError(f"--precision {o.precision} builds a graph for TensorRT's FP16/BF16 kernels (ONNX Runtime "
                         f"CPU has no fast ones); add --target tensorrt, or use --precision int8 for the CPU")
    if o.prune:
        if parse_prune(o.prune, o.prune_method, o.prune_layers).auto and (not o.max_drop or o.precision != "fp32"):
            raise UsageError("--prune auto chooses the ratio under --max-drop at FP32: add --max-drop METRIC=VALUE "
                             "(with --precision int8/int4, give --prune ratios instead)")
    elif o.prune_method != CompileOptions.prune_method or o.prune_layers != CompileOptions.prune_layers:
        raise UsageError("--prune-method and --prune-layers choose what --prune removes; add --prune heads=R,ffn=R")
    if (o.static or o.smoothquant is not None) and o.precision != "int8":
        raise UsageError("--static and --smoothquant configure INT8; add --precision int8")
    if (o.max_drop or o.calibration) and not o.prune and o.precision == "fp32":
        raise UsageError("--max-drop and --calibration configure quantization (--calibration also --prune); "
                         "add --precision int8 or int4")
    int4_flags = [f for f, on in (("--asym", o.asym is not None),
                                  ("--mixed-bits", o.mixed_bits is not None),
                                  ("--lm-head", o.lm_head is not None),
                                  ("--quant-method", o.quant_method != CompileOptions.quant_method),
                                  ("--group-size", o.group_size != CompileOptions.group_size)) if on]
    if int4_flags and o.precision != "int4":
        raise UsageError(f"{', '.join(int4_flags)} configure INT4; add --precision int4")
    if o.mixed_bits and (o.target == "tensorrt" or o.quant_method not in SOLVED_METHODS):
        raise UsageError(f"--mixed-bits needs a solver on the cpu target (--quant-method gptq or awq+gptq, not "
                         f"{o.quant_method} on {o.target}); drop --mixed-bits")
    if o.asym and o.target == "tensorrt":
        raise UsageError("--asym --target tensorrt: TensorRT takes symmetric INT4 only; drop --asym")


def for_imported(o: CompileOptions, path: str | Path, info: dict[str, Any]) -> CompileOptions:
    """An already-quantized checkpoint (``info``: its format, bits and group size) compiles to INT4 with its own
    codes: GPTQ does not run again."""
    if o.precision not in ("fp32", "int4"):
        raise UsageError(f"{path} is already quantized ({info.get('format')}, {info.get('bits')}-bit); "
                         "compile it without --precision (or with --precision int4)")
    if o.asym or o.mixed_bits or o.quant_method != CompileOptions.quant_method or o.calibration:
        raise UsageError(f"{path} is already quantized: --asym, --mixed-bits, --quant-method and "
                         "--calibration do not apply (its codes are compiled as they are)")
    group = int(info.get("group_size", 128))
    return replace(o, precision="int4", group_size=group if group > 0 else 0, quant_method="rtn", asym=False,
                   mixed_bits=False)


def int4_defaults(kind: str, options: CompileOptions) -> CompileOptions:
    """``asym`` and ``accuracy_level`` left to the recipe, resolved once the model kind is known. Encoders' INT4 on
    the CPU: asymmetric groups, FP32 activations (all-MiniLM-L6-v2 group 32, 200 held-out sentences: min cosine
    0.9781 -> 0.9851, batch 1 / 8 latency 0.98x / 0.93x -> 1.03x / 1.00x ORT's RTN INT4 graph, one run each; at a
    sequence of 128 the kernel is a GEMM, where FP32 activations cost nothing). Decoders: symmetric, int8
    activations per block (decode is a GEMV: level 4 is the fast one), and with a solver on the CPU mixed widths
    (SmolLM2-135M GPTQ, llama-perplexity's protocol: +9.3% -> +5.8% over FP32 at 99.6 -> 100.4 MiB, decode
    1.04x -> 0.95x llama.cpp Q4_K_M's; docs/int4.md)."""
    encoder_cpu = kind == "encoder" and options.target == "cpu" and options.precision == "int4"
    asym = options.asym if options.asym is not None else encoder_cpu
    level = options.accuracy_level if options.accuracy_level is not None else 0 if encoder_cpu else 4
    mixed = options.mixed_bits if options.mixed_bits is not None else \
        kind == "decoder" and options.target == "cpu" and options.quant_method in SOLVED_METHODS
    return replace(options, asym=asym, accuracy_level=level, mixed_bits=mixed)

