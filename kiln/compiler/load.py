"""Checkpoint directory -> eager torch model, with every way a checkpoint can be wrong caught up front."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.compiler import gguf
from kiln.compiler.experts import use_dense_experts
from kiln.compiler.lazy import safetensors_header, weight_map
from kiln.compiler.quantize import gptq_format
from kiln.compiler.scoped import quiet_transformers
from kiln.errors import CheckpointError, UnsupportedModelError
from kiln.runtimes.artifact import inside, sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """What the loader learned about an architecture from its config and modules (never from a list of names)."""

    kind: str  # encoder | decoder | seq2seq
    token_type_ids: bool = False
    position_offset: int = 0  # positions the embedding table reserves (roberta-style: padding_idx + 1)
    attention: str = "sdpa"  # attn_implementation it was loaded with


# Load-time quirks of otherwise supported architectures (not an allow-list: every model_type transformers
# can load is tried). T5's sdpa attention path does not export with torch.onnx's dynamo exporter.
ATTENTION_QUIRKS = {"t5": "eager", "mt5": "eager", "umt5": "eager"}
MAX_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")

TASKS_BY_KIND = {
    "encoder": ("feature-extraction", "sequence-classification", "token-classification"),
    "decoder": ("feature-extraction", "causal-lm"),
    "seq2seq": ("text2text-generation",),
}

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
    "merges.txt", "added_tokens.json", "sentence_bert_config.json",
)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class Checkpoint:
    path: Path
    config: Any  # transformers.PretrainedConfig
    family: Family
    model_type: str
    architecture: str
    task: str
    model: Any  # torch.nn.Module, eval mode
    max_length: int
    sha256: str
    pooling: dict[str, Any] | None = None
    labels: dict[int, str] | None = None
    tokenizer_files: list[str] = field(default_factory=list)
    tokenizer: Any | None = None
    """The fast tokenizer, or None (then verification uses random ids only)."""
    tokenizer_problem: str | None = None
    """Why a shipped tokenizer was not usable; warned about and recorded in the manifest."""
    source: dict[str, Any] | None = None
    """What the user passed when it was not the checkpoint directory itself (a GGUF file: its name and sha256)."""
    scratch: Any = None
    """Keeps a converted checkpoint's temporary directory alive as long as the checkpoint."""
    codebook: Any = None
    """An already-quantized checkpoint's codes (kiln.passes.codes.Codebook): compiled as they are."""
    imported: dict[str, Any] | None = None
    """What the quantized checkpoint declared (format, bits, group size, act-order, symmetry)."""
    pruning: dict[str, Any] | None = None
    """``--prune``: what was removed from ``model`` (kiln.compiler.prune), and its accuracy cost."""
    weights: Any = None
    """Streamed checkpoints (kiln.compiler.lazy.LazyWeights): ``model`` is then an empty shell on the meta device
    and every tensor is read from here when needed."""
    buffers: dict[str, Any] = field(default_factory=dict)
    """Streamed checkpoints: the shell's computed buffers (rotary frequencies), which no checkpoint stores."""

    @property
    def streamed(self) -> bool:
        return self.weights is not None

    @property
    def kind(self) -> str:
        return self.family.kind

    @property
    def padding_side(self) -> str:
        return "left" if self.kind == "decoder" else "right"

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads: the config's ``vocab_size``, else the rows of its token-embedding table."""
        value = getattr(self.config, "vocab_size", None)
        if isinstance(value, int) and value > 0:
            return value
        try:
            table = self.model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # a model that reads characters, not a vocabulary
            table = None
        rows = getattr(table, "num_embeddings", None)
        if isinstance(rows, int) and rows > 0:
            return rows
        raise UnsupportedModelError(
            f"checkpoint {self.path} ({self.model_type}) declares no vocab_size and has no token-embedding table kiln "
            "can read; kiln compiles models that read token ids from a vocabulary")

    @property
    def pad_token_id(self) -> int:
        for value in (getattr(self.tokenizer, "pad_token_id", None), getattr(self.config, "pad_token_id", None),
                      getattr(self.tokenizer, "eos_token_id", None), getattr(self.config, "eos_token_id", None)):
            if isinstance(value, int):
                return value
        return 0


def task_for_architecture(arch: str) -> str | None:
    """The task a head class serves: transformers' own auto mappings first (a head named outside the usual suffixes,
    such as ``BertGenerationDecoder``, is still the causal LM its model type registers), then the name."""
    from transformers.models.auto import modeling_auto as auto

    for mapping, task in (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
                          ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence-classification"),
                          ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
                          ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "text2text-generation")):
        names = getattr(auto, mapping, {}).values()
        if any(arch == n or (isinstance(n, (list, tuple)) and arch in n) for n in names):
            return task
    if arch.endswith("ForSequenceClassification"):
        return "sequence-classification"
    if arch.endswith("ForTokenClassification"):
        return "token-classification"
    if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
        return "causal-lm"
    if arch.endswith("ForConditionalGeneration") or arch.endswith("MTModel"):
        return "text2text-generation"
    if arch.endswith("Model"):
        return "feature-extraction"
    return None


def read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a Hugging Face checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory; pass the directory holding config.json and the weights")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no config.json; pass a Hugging Face checkpoint directory (save_pretrained output)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); restore the file from the original checkpoint") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise CheckpointError(f"{cfg_path} has no model_type; it is not a transformers config")
    return cfg


def model_kind(path: Path, cfg: dict[str, Any], arch: str) -> str:
    """encoder, decoder or seq2seq, from the config and the heads transformers registers for its model_type."""
    from transformers.models.auto import modeling_auto as auto

    model_type = cfg["model_type"]
    known = [auto.MODEL_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
             auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES]
    if not any(model_type in m for m in known):
        import transformers

        raise UnsupportedModelError(
            f"checkpoint {path} has model_type {model_type!r}, which transformers {transformers.__version__} cannot "
            "load; upgrade transformers or convert the checkpoint to an architecture it knows")
    if cfg.get("is_encoder_decoder") or model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and \
            model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
        return "decoder"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:  # bidirectional: bert, roberta, electra, ...
        return "encoder"
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "decoder"
    return "encoder"


def resolve(path: Path, cfg: dict[str, Any], task: str | None) -> tuple[str, str, str]:
    """Pick the model kind and task, or say exactly what is supported."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    kind = model_kind(path, cfg, arch)
    allowed = TASKS_BY_KIND[kind]
    if task is None:
        task = task_for_architecture(arch)
        if task is None or task not in allowed:
            raise UnsupportedModelError(
                f"checkpoint {path} has head {arch or '(none)'}, which kiln cannot compile; "
                f"pass --task with one of {', '.join(allowed)}"
            )
    elif task not in allowed:
        raise UnsupportedModelError(
            f"task {task!r} is not supported for {kind} {cfg['model_type']!r}; choose one of {', '.join(allowed)}"
        )
    return kind, task, arch


def check_weights(path: Path) -> list[Path]:
    """Find the weight files and check every safetensors header before torch touches them."""
    present = [path / n for n in _WEIGHT_FILES if (path / n).is_file()]
    if not present:
        raise CheckpointError(
            f"checkpoint {path} has no weights ({' or '.join(_WEIGHT_FILES[::2])}); "
            "save the model with save_pretrained into this directory"
        )
    files: list[Path] = []
    for p in present:
        if p.name.endswith(".index.json"):
            for shard in sorted(set(weight_map(p).values())):
                if not inside(path, shard, f"{p.name} shard", CheckpointError).is_file():
                    raise CheckpointError(f"checkpoint {path} lacks shard {shard} named in {p.name}; copy the missing file")
                files.append(path / shard)
        else:
            files.append(p)
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)
        elif f.suffix == ".bin":
            check_pickle(f)
    return files


def check_pickle(path: Path) -> None:
    """``.bin`` weights are pickles: load them only as plain tensors, never arbitrary objects."""
    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # UnpicklingError, RuntimeError (zip), EOFError...
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise CheckpointError(
            f"weights file {path} cannot be loaded as plain tensors (weights_only) ({detail}); "
            "convert the checkpoint to safetensors from a trusted copy"
        ) from e


def check_safetensors(path: Path) -> None:
    """Validate the header and that every tensor's bytes lie inside the file (catches truncation)."""
    try:
        safetensors_header(path)
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise CheckpointError(f"weights file {path} is corrupt ({e}); re-download or re-save the checkpoint") from e


def checkpoint_sha256(path: Path) -> str:
    """One digest over every file of the checkpoint (names and contents), stable across machines."""
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and ".git" not in p.parts):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return digest.hexdigest()


def read_pooling(path: Path) -> dict[str, Any] | None:
    """sentence-transformers layout: modules.json naming a Pooling (and optionally Normalize) module."""
    modules_path = path / "modules.json"
    if not modules_path.is_file():
        return None
    try:
        modules = json.loads(modules_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{modules_path} is not valid JSON ({e}); restore it from the original checkpoint") from e
    pooling = None
    normalize = False
    for m in modules:
        kind = m.get("type", "")
        if kind.endswith(".Pooling"):
            cfg_path = path / m.get("path", "") / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {"pooling_mode_mean_tokens": True}
            modes = [k for k in ("cls_token", "mean_tokens", "max_tokens") if cfg.get(f"pooling_mode_{k}")]
            if len(modes) != 1:
                raise UnsupportedModelError(
                    f"{cfg_path} asks for pooling {modes or 'none'}; kiln supports exactly one of cls, mean, max"
                )
            pooling = modes[0].split("_")[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    return {"mode": pooling, "normalize": normalize} if pooling else None


def max_length(cfg: Any, family: Family) -> int:
    # a non-positive value says the model has no limit (relative positions only): the default stands
    n = next((getattr(cfg, k) for k in MAX_LENGTH_KEYS if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) > 0),
             512)
    return int(n) - family.position_offset


def _from_pretrained(auto: Any, path: Path, attention: str) -> tuple[Any, dict[str, Any]]:
    import torch

    return auto.from_pretrained(str(path), local_files_only=True, trust_remote_code=False, dtype=torch.float32,
                                attn_implementation=attention, output_loading_info=True)


def load_model(path: Path, task: str, model_type: str) -> tuple[Any, dict[str, Any], str]:
    """The eager model, with sdpa attention where the architecture has it (eager otherwise)."""
    import transformers

    auto = {
        "feature-extraction": transformers.AutoModel,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
        "causal-lm": transformers.AutoModelForCausalLM,
        "text2text-generation": transformers.AutoModelForSeq2SeqLM,
    }[task]
    attention = ATTENTION_QUIRKS.get(model_type, "sdpa")
    try:
        try:
            model, info = _from_pretrained(auto, path, attention)
        except ValueError as e:  # "... does not support an attention implementation through ... sdpa"
            if attention != "sdpa" or "scaled_dot_product_attention" not in str(e):
                raise
            attention = "eager"
            model, info = _from_pretrained(auto, path, attention)
    except Exception as e:  # transformers raises many types for one bad checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} could not be loaded: {first}") from e
    return model, info, attention


def load_shell(path: Path, task: str, model_type: str, weights: Any = None) -> tuple[Any, dict[str, Any], str, Any]:
    """The empty shell of a streamed checkpoint: config, modules and computed buffers, no weights. ``weights``: how
    the checkpoint's tensors are read (default ``lazy.LazyWeights``; an imported one's dequantize on read)."""
    import transformers

    from kiln.compiler import lazy

    weights = weights if weights is not None else lazy.LazyWeights(path)
    lazy.return_freed_memory()
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for one bad config
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} could not be loaded: {first}") from e
    if getattr(config, "quantization_config", None) is not None:  # the shell is FP32: its weights are dequantized
        del config.quantization_config
    attention = ATTENTION_QUIRKS.get(model_type, "sdpa")
    try:
        shell, buffers = lazy.build_shell(config, task, attention)
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        attention = "eager"
        shell, buffers = lazy.build_shell(config, task, attention)
    lazy.parameter_keys(shell, weights)  # every parameter has a tensor, or one line saying which do not
    return shell, buffers, attention, weights


def load_checkpoint(path: str | Path, task: str | None = None, stream: bool = False) -> Checkpoint:
    """``stream``: build the model as an empty shell and read weights lazily (decoders from safetensors)."""
    path = Path(path)
    if gguf.is_gguf(path):
        scratch = tempfile.TemporaryDirectory(prefix="kiln-gguf-")
        ckpt = load_checkpoint(gguf.convert(path, Path(scratch.name) / "checkpoint"), task)
        ckpt.source, ckpt.sha256, ckpt.scratch = gguf.source(path), gguf.source(path)["sha256"], scratch
        return ckpt
    raw = read_config(path)
    qcfg = gptq_format.quantization_config(path, raw)
    if qcfg is not None and stream:  # shard by shard: codes to a scratch codebook, weights dequantized when read
        layout = gptq_format.Layout(path, qcfg)
        check_weights(path)
        weights = gptq_format.DequantizedWeights(path, layout)
        scratch = tempfile.TemporaryDirectory(prefix="kiln-quantized-")
        ckpt = _checkpoint(path, task, raw, stream=True, weights=weights)
        ckpt.codebook = weights.codebook(Path(scratch.name))
        ckpt.source = {"format": layout.info["format"], "path": str(path.absolute()), "sha256": ckpt.sha256}
        ckpt.scratch, ckpt.imported = scratch, dict(layout.info, layers=len(weights.packed))
        return ckpt
    if qcfg is not None:
        scratch = tempfile.TemporaryDirectory(prefix="kiln-quantized-")
        book, info = gptq_format.dequantize_checkpoint(path, raw, qcfg, Path(scratch.name) / "checkpoint")
        ckpt = load_checkpoint(Path(scratch.name) / "checkpoint", task)
        ckpt.sha256 = checkpoint_sha256(path)
        ckpt.source = {"format": info["format"], "path": str(path.absolute()), "sha256": ckpt.sha256}
        ckpt.scratch, ckpt.codebook, ckpt.imported = scratch, book, info
        return ckpt
    return _checkpoint(path, task, raw, stream)


def _checkpoint(path: Path, task: str | None, raw: dict[str, Any], stream: bool, weights: Any = None) -> Checkpoint:
    kind, task, arch = resolve(path, raw, task)
    check_weights(path)
    buffers: dict[str, Any] = {}
    with quiet_transformers():
        if stream:
            model, buffers, attention, weights = load_shell(path, task, raw["model_type"], weights)
            info: dict[str, Any] = {}
        else:
            model, info, attention = load_model(path, task, raw["model_type"])
        tokenizer, problem = load_tokenizer(path)
    use_dense_experts(model)  # routed experts as one MatMul pair per expert (kiln.compiler.experts)
    missing = [k for k in info.get("missing_keys", []) if k]
    mismatched = info.get("mismatched_keys", [])
    if missing or mismatched:
        names = ", ".join(list(missing)[:5] + [str(m[0]) if isinstance(m, tuple) else str(m) for m in mismatched][:5])
        raise CheckpointError(
            f"checkpoint {path} lacks or mismatches weights for the {task} head ({names}); "
            "it would run with random weights: pass the matching --task or a complete checkpoint"
        )
    model.eval()
    cfg = model.config
    embeddings = getattr(model.base_model, "embeddings", None)
    padding_idx = getattr(embeddings, "padding_idx", None)  # roberta-style positions start after padding_idx
    family = Family(kind, token_type_ids=kind == "encoder" and (getattr(cfg, "type_vocab_size", 0) or 0) > 1,
                    position_offset=padding_idx + 1 if isinstance(padding_idx, int) else 0, attention=attention)
    labels = None
    if task in ("sequence-classification", "token-classification"):
        labels = {int(k): str(v) for k, v in (cfg.id2label or {}).items()}
    pooling = read_pooling(path) if kind == "encoder" and task == "feature-extraction" else None
    return Checkpoint(
        path=path, config=cfg, family=family, model_type=raw["model_type"], architecture=arch or type(model).__name__,
        task=task, model=model, max_length=max_length(cfg, family), sha256=checkpoint_sha256(path),
        pooling=pooling, labels=labels, tokenizer_files=[n for n in TOKENIZER_FILES if (path / n).is_file()],
        tokenizer=tokenizer, tokenizer_problem=problem, weights=weights, buffers=buffers,
    )


PROBE_TEXT = "The quick brown fox jumps over the lazy dog."


def load_tokenizer(path: Path) -> tuple[Any | None, str | None]:
    """The checkpoint's fast tokenizer, or (None, why) when it ships none kiln can use.

    transformers builds an empty tokenizer for a directory without tokenizer files (GPT-2, Qwen2): one
    that gives no token for real text is no tokenizer at all."""
    if not any((path / n).is_file() for n in TOKENIZER_FILES if n != "sentence_bert_config.json"):
        return None, None  # none shipped: random-id verification, nothing to warn about
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # corrupt tokenizer.json, missing vocab, unknown class...
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return None, f"its tokenizer files could not be loaded ({first})"
    if not getattr(tok, "is_fast", False):
        return None, f"its tokenizer ({type(tok).__name__}) is not a fast tokenizer"
    special = set(tok.all_special_ids)
    if not [i for i in tok(PROBE_TEXT, add_special_tokens=False)["input_ids"] if i not in special]:
        return None, f"its tokenizer gives no tokens for text ({len(tok)} entries in the vocabulary)"
    return tok, None
