"""Random-init decoder checkpoints in real shapes, written tensor by tensor (FP16 safetensors shards with an
index), cached outside the repository. They prove memory and speed, not accuracy.

    python tools/scale_checkpoints.py 1.1b|8b|tiny|tiny-tied [--cache DIR]

Shapes: ``1.1b`` is TinyLlama-1.1B's (hidden 2048, 22 layers, 32 query / 4 KV heads, FFN 5632, vocabulary 49152,
2.3 GB); ``8b`` is Llama-3.1-8B's (hidden 4096, 32 layers, 32 / 8 heads, FFN 14336, vocabulary 128256, 16 GB).
Weights are random, norms 1, so logits are close to uniform: the numbers they give are sizes, memory and time,
not accuracy (that is measured on SmolLM2). Each weight is drawn on the 4-bit grid of groups of 32 along its input
dimension (codes uniform in 0..15, one code 0 per group, the group's scale a power of two in 2^-10..2^-8; values
(code - 8) * scale, std about 0.01, exact in FP16), so round-to-nearest INT4 reproduces them and an INT4 compile
verifies against FP32 within INT4's floor. With N(0, 0.02) weights the 1.1B INT4 artifact matches its codes to
5.6e-5 but misses the FP32 floor on random ids (top-1 25.5% over 94 decisive positions): an untrained network has no
logit margins for 4 bits to keep. Writing never holds more than a slice of one tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=160, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False),
    "tiny-tied": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=160, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
    "1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
               rope_theta=500000.0),
}
SHARD_BYTES = 2 << 30


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_BENCH_CACHE", Path.home() / ".cache" / "kiln-bench"))


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    out += [("model.norm.weight", (h,))]
    if not cfg.get("tie_word_embeddings"):
        out += [("lm_head.weight", (v, h))]
    return out


GROUP = 32


def grid_weights(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) FP16 weights on the 4-bit grid of ``GROUP`` inputs (see the module docstring)."""
    groups = cols // GROUP
    codes = rng.integers(0, 16, (rows, groups, GROUP), dtype=np.int8)
    np.put_along_axis(codes, rng.integers(0, GROUP, (rows, groups, 1)), 0, axis=-1)  # the group's extreme: code 0
    scale = np.ldexp(np.float32(1), -rng.integers(8, 11, (rows, groups, 1)))
    return ((codes.astype(np.float32) - 8) * scale).reshape(rows, cols).astype(np.float16)


def write_shard(path: Path, names: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator, grid: bool) -> None:
    """One safetensors file written tensor by tensor: header first, then each tensor's bytes as it is made."""
    header, offset = {}, 0
    for name, shape in names:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape in names:
            if name.endswith("norm.weight"):
                fh.write(np.ones(shape, np.float16).tobytes())
            else:
                rows, cols = shape
                step = max(1, (1 << 22) // cols)
                for lo in range(0, rows, step):
                    n = min(step, rows - lo)
                    part = grid_weights(rng, n, cols) if grid else \
                        (rng.standard_normal((n, cols), np.float32) * 0.02).astype(np.float16)
                    fh.write(part.tobytes())
    tmp.replace(path)


def make(name: str, root: Path | None = None, tokenizer: Path | None = None, grid: bool = True) -> Path:
    """The checkpoint directory (made once; a complete one is reused). ``grid=False``: N(0, 0.02) weights instead
    (tests: round-to-nearest then changes every weight, so a wrong codes reference shows)."""
    cfg = dict(SHAPES[name], model_type="llama", architectures=["LlamaForCausalLM"], torch_dtype="float16",
               rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=None)
    out = (root or cache_dir()) / f"llama-{name}"
    if (out / ".complete").exists():
        if tokenizer is not None and not (out / "tokenizer.json").exists():
            copy_tokenizer(tokenizer, out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for t in tensors(cfg):
        n = int(np.prod(t[1])) * 2
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        print(f"{out.name}: shard {i + 1}/{len(shards)} ({len(names)} tensors)", file=sys.stderr)
        write_shard(out / file, names, rng, grid)
        weight_map.update({n: file for n, _ in names})
    total = sum(int(np.prod(s)) * 2 for _, s in tensors(cfg))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer is not None:
        copy_tokenizer(tokenizer, out)
    (out / ".complete").touch()
    return out


def copy_tokenizer(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--cache", type=Path, default=None)
    args = ap.parse_args()
    print(make(args.shape, args.cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
