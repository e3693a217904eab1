"""A ``.gguf`` file -> an ordinary FP32 Hugging Face checkpoint directory (transformers dequantizes it).

transformers' GGUF loader gives a model whose config still carries the GGUF quantization settings and which
``save_pretrained`` refuses; the weights are rebuilt into a fresh model of the same config (ties restored),
saved with the tokenizer the file embeds. The compiler records the file's sha256 as the source.
"""

from __future__ import annotations

from pathlib import Path

from kiln.compiler.scoped import quiet_transformers
from kiln.errors import CheckpointError
from kiln.runtimes.artifact import sha256_file

SUFFIX = ".gguf"


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == SUFFIX


def source(path: Path) -> dict[str, str]:
    """What the manifest records about a GGUF input."""
    return {"format": "gguf", "path": str(path.absolute()), "sha256": sha256_file(path)}


def convert(path: Path, out: Path) -> Path:
    """Dequantize ``path`` into a checkpoint directory at ``out`` (created); returns ``out``."""
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist; pass a .gguf file or a checkpoint directory")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf model file")
    try:
        import gguf  # noqa: F401  transformers reads GGUF through it
    except ImportError as e:
        raise CheckpointError(f"reading {path} needs the gguf package; pip install 'kiln[compile]'") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # unsupported GGUF architecture, truncated tensor data...
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"GGUF file {path} could not be dequantized by transformers: {first}") from e
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with quiet_transformers():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"GGUF file {path} dequantized to weights that do not fit {type(model).__name__} "
                              f"({', '.join(sorted(set(missing) - tied | set(unexpected))[:5])})")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
