"""Checkpoint directory -> eager torch model, with every way a checkpoint can be wrong caught up front."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import CheckpointError, UnsupportedModelError
from kiln.runtimes.artifact import sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    kind: str  # encoder | decoder
    token_type_ids: bool = False
    position_offset: int = 0  # positions the embedding table reserves (roberta: padding_idx + 1)
    max_length_key: str = "max_position_embeddings"
    attention: str = "sdpa"  # attn_implementation to load with (T5's sdpa path does not export)


FAMILIES: dict[str, Family] = {
    "bert": Family("encoder", token_type_ids=True),
    "roberta": Family("encoder", position_offset=2),
    "distilbert": Family("encoder"),
    "gpt2": Family("decoder", max_length_key="n_positions"),
    "llama": Family("decoder"),
    "qwen2": Family("decoder"),
    "mistral": Family("decoder"),
    "t5": Family("seq2seq", max_length_key="n_positions", attention="eager"),
    "bart": Family("seq2seq"),
    "marian": Family("seq2seq"),
}

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

    @property
    def kind(self) -> str:
        return self.family.kind


def task_for_architecture(arch: str) -> str | None:
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


def resolve(path: Path, cfg: dict[str, Any], task: str | None) -> tuple[Family, str, str]:
    """Pick the family and task, or say exactly what is supported."""
    model_type = cfg["model_type"]
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"checkpoint {path} has model_type {model_type!r}, which kiln does not support; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    allowed = TASKS_BY_KIND[family.kind]
    if task is None:
        task = task_for_architecture(arch)
        if task is None or task not in allowed:
            raise UnsupportedModelError(
                f"checkpoint {path} has head {arch or '(none)'}, which kiln cannot compile; "
                f"pass --task with one of {', '.join(allowed)}"
            )
    elif task not in allowed:
        raise UnsupportedModelError(
            f"task {task!r} is not supported for {family.kind} {model_type!r}; choose one of {', '.join(allowed)}"
        )
    return family, task, arch


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
            try:
                index = json.loads(p.read_text())
                shards = sorted(set(index["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise CheckpointError(f"{p} is not a valid shard index ({e}); restore it from the original checkpoint") from e
            for shard in shards:
                if not (path / shard).is_file():
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
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 << 20:
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(fh.read(n))
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            if not 0 <= start <= stop:
                raise ValueError(f"tensor {name} has bad offsets {start}..{stop}")
            end = max(end, stop)
        if 8 + n + end > size:
            raise ValueError(f"tensors need {8 + n + end} bytes but the file has {size} (truncated)")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, struct.error) as e:
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
    n = getattr(cfg, family.max_length_key, None) or 512
    return int(n) - family.position_offset


def load_checkpoint(path: str | Path, task: str | None = None) -> Checkpoint:
    path = Path(path)
    raw = read_config(path)
    family, task, arch = resolve(path, raw, task)
    check_weights(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    auto = {
        "feature-extraction": transformers.AutoModel,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
        "causal-lm": transformers.AutoModelForCausalLM,
        "text2text-generation": transformers.AutoModelForSeq2SeqLM,
    }[task]
    try:
        model, info = auto.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False, dtype=torch.float32,
            attn_implementation=family.attention, output_loading_info=True,
        )
    except Exception as e:  # transformers raises many types for one bad checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} could not be loaded: {first}") from e
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
    labels = None
    if task in ("sequence-classification", "token-classification"):
        labels = {int(k): str(v) for k, v in (cfg.id2label or {}).items()}
    pooling = read_pooling(path) if family.kind == "encoder" and task == "feature-extraction" else None
    return Checkpoint(
        path=path, config=cfg, family=family, model_type=raw["model_type"], architecture=arch or type(model).__name__,
        task=task, model=model, max_length=max_length(cfg, family), sha256=checkpoint_sha256(path),
        pooling=pooling, labels=labels, tokenizer_files=[n for n in TOKENIZER_FILES if (path / n).is_file()],
    )
