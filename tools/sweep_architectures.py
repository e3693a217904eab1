"""Every text architecture transformers registers, built tiny and compiled by kiln: the coverage table.

    python tools/sweep_architectures.py [--only llama bert ...] [--jobs 2] [--no-int4] [--timeout 600]
                                        [--work DIR] [--write-docs] [--slice]

Walks transformers' own auto mappings (causal-LM, masked-LM, sequence-classification, seq2seq LM), builds each
``model_type`` from its config class with one generic shrinker (hidden 64, 2 layers, 4 query / 2 KV heads of 16,
MLP 128, 4 experts top 2, vocab 512, 128 positions; every size key a config has is shrunk, the sizes derived from
others kept consistent, nothing is set per family), checks that the tiny model runs a forward in transformers itself
(else once more at hidden 96, which splits into six; a model that still does not run is left out with the error),
saves it with random weights and runs ``kiln compile DIR -o OUT --max-length 128`` on it in a child
process, then ``--precision int4 --quant-method rtn`` for the decoders that compiled at FP32.

Each architecture ends as one of:
- ``fused``: compiled, verified (parity; decoders and encoder-decoders also the 16-step generation check through
  the cache), every attention layer lowered to a fused kernel;
- ``fallback``: compiled and verified the same way, some or all attention layers on the unfused path (the manifest
  and this table say which pass left them and why);
- ``fails``: the compile failed; the one-line error is the reason;
- ``left out``: not a text Transformer kiln targets (state-space / recurrent / hybrid layers, multimodal or composed
  configs), or it cannot be built tiny without remote code or weights; the reason is printed, and these are not in
  the ratio.

The table goes to stdout and, with ``--write-docs``, between the markers in docs/models.md. ``--slice`` runs the
representative slice the test suite runs (tests/compiler/test_sweep.py), for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN_BY_SIX = 96
"""The hidden size of a second try, for the models whose tiny config does not run at ``HIDDEN``: one that splits
into six equal parts (layout models embed a box's four coordinates and two sizes in sixths of the hidden)."""
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 64, 2, 4, 2, 16, 128, 512, 128
TRIES = ((HIDDEN, False, False), (HIDDEN, True, False), (HIDDEN_BY_SIX, True, False), (HIDDEN, True, True))
"""(hidden size, latent head as the sum of its parts, every layer the base sizes) for each try at a tiny model that
runs: latent-attention configs name a whole head ``head_dim`` in some families and the rotary part in others; a
per-layer size tied to others by the config's validators (a sliding layer's head = its unrotated + rotated parts)
does not survive scaling each by its own ratio, so the last try builds every layer with the base sizes."""
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
             "decoder_attention_heads", "num_decoder_attention_heads")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim", "model_dim", "embed_dim", "word_embed_proj_dim")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")
SIZES = [  # (value, the keys that take it): a list, since values repeat
    (HIDDEN, HIDDEN_KEYS),
    (LAYERS, ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
             "num_decoder_layers", "num_encoder_layers")),
    (HEADS, HEAD_KEYS),
    (KV_HEADS, KV_HEAD_KEYS),
    (HEAD_DIM, ("head_dim", "d_kv", "kv_channels", "attention_head_dim", "v_head_dim", "qk_nope_head_dim",
               "qk_rope_head_dim", "rotary_dim")),
    (FFN, ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "hidden_dim",
          "ffn_hidden_size", "dense_intermediate_size")),
    (4, EXPERTS),
    (2, TOP_K),
    (32, ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size", "embedding_size",
         "moe_ffn_hidden_size", "kv_lora_rank", "q_lora_rank", "expert_hidden_size")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                "seq_length")),
    (16, ("sliding_window", "attention_window", "local_attention", "window_size")),
    (VOCAB, ("vocab_size", "vocab_size_per_layer_input")),
    (16, ("hidden_size_per_layer_input",)),
]
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "unk_token_id")
# what state-space / recurrent / hybrid configs carry and attention-only Transformers do not
NOT_ATTENTION = ("mamba", "ssm", "state_size", "d_state", "linear_attn", "linear_num", "lightning", "rwkv", "mlstm",
                 "slstm", "recurrent", "lru_width", "conv_l_cache", "time_step", "deltanet", "gated_delta")
COMPOSED = ("vision", "audio", "text", "encoder", "decoder", "speech", "vq", "projector", "tokenizer", "patcher",
            "depth", "word_timestamp")
"""Sub-configs that make a config a composition of models (a text part beside vision / audio / ...), not parts of
one text model (MPT's attn_config)."""
RECURRENT_MODULES = ("Mamba", "Rwkv", "Lstm", "LSTM", "Recurrent", "Ssm", "SSM", "GatedDelta", "LinearAttention",
                     "ShortConv", "Lru")
MAPPINGS = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
SLICE = ["falcon", "gemma2", "gpt_oss", "deepseek_v3", "bloom", "modernbert", "whisper"]
"""What tests/compiler/test_sweep.py runs (one per way a layer reaches its lowering: soft-cap and windows, sinks,
latent attention's fallback, a family's own attention, a rotary encoder, a decoder whose forward takes no position
ids); the classics have their own tests."""
DOCS_BEGIN, DOCS_END = "<!-- sweep:begin -->", "<!-- sweep:end -->"


def model_types() -> dict[str, str]:
    """model_type -> the task kiln compiles it for: seq2seq LM, else the base model of a masked-LM (bidirectional
    encoder), else causal LM, else sequence classification (first mapping that has it, in that order)."""
    from transformers.models.auto import modeling_auto as auto

    tasks = dict(zip(MAPPINGS, ("text2text-generation", "feature-extraction", "causal-lm", "sequence-classification")))
    out: dict[str, str] = {}
    for mapping in MAPPINGS:
        for model_type in getattr(auto, mapping):
            out.setdefault(model_type, tasks[mapping])
    return dict(sorted(out.items()))


def left_out(config) -> str | None:
    """Why a config is not a text attention Transformer (None when it is)."""
    subs = [k for k in (getattr(config, "sub_configs", None) or {}) if any(m in k for m in COMPOSED)]
    if subs:
        return f"composed or multimodal config ({', '.join(sorted(subs))})"
    keys = [k.lower() for k in config.to_dict()]
    hits = sorted({k for k in keys for marker in NOT_ATTENTION if marker in k})
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or []
    odd = sorted({str(t) for t in types if isinstance(t, str) and "attention" not in t and t not in ("full", "sliding")})
    if hits or odd:
        return f"state-space / recurrent / hybrid layers ({', '.join(hits + odd)[:80]})"
    return None


def shrink(config, hidden: int = HIDDEN, latent: bool = False, uniform: bool = False) -> dict:
    """The overrides that make ``config`` tiny: every size key it has (the hidden size ``hidden``), token ids inside
    the vocabulary, per-layer lists cut to the layer count keeping one layer of each distinct kind, and the sizes
    other sizes are derived from kept consistent (a latent-attention head, a layout box, an unset top-k or head
    size), and layers of a kind (routed experts every k-th layer, dense-MLP layers) kept in the tiny model.
    ``uniform``: no layer keeps sizes of its own (``per_layer_config`` emptied)."""
    present, out = config.to_dict(), {}
    heads = next((present[k] for k in HEAD_KEYS if isinstance(present.get(k), int)), None)
    for value, keys in SIZES:
        for key in keys:
            if isinstance(present.get(key), int) and not isinstance(present[key], bool):
                size = hidden if keys is HIDDEN_KEYS else value
                out[key] = HEADS if keys is KV_HEAD_KEYS and present[key] == heads else size  # no grouping stays none
    for key in ("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                "moe_layer_start_index"):
        if isinstance(present.get(key), int) and present[key] > 1:
            out[key] = 1
    for key in TOKEN_IDS:
        value = present.get(key)
        if isinstance(value, int) and value >= VOCAB:
            out[key] = TOKEN_IDS.index(key) % 3
        elif isinstance(value, list):
            out[key] = [v if isinstance(v, int) and v < VOCAB else 2 for v in value]
    for key in ("layer_types", "layers_block_type", "mlp_layer_types"):
        value = present.get(key)
        if isinstance(value, list) and len(value) != LAYERS:
            kinds = list(dict.fromkeys(value))
            out[key] = (kinds * LAYERS)[:LAYERS]
    for key, value in present.items():  # layers of a kind (routed experts every k-th layer): the kind stays
        if isinstance(value, int) and not isinstance(value, bool) and value > LAYERS and (
                key.endswith("_sparse_step") or (key.startswith("num_sparse_") and key.endswith("_layers"))):
            out[key] = LAYERS
    only = present.get("mlp_only_layers")  # layers that keep a dense MLP: never all of the tiny ones
    if isinstance(only, list) and all(isinstance(i, int) for i in only):
        out["mlp_only_layers"] = [i for i in only if i < LAYERS - 1]
    if "head_dim" in present and present["head_dim"] is None and heads:  # unset: what the model would derive
        out["head_dim"] = hidden // HEADS
    if latent and isinstance(present.get("qk_nope_head_dim"), int) and isinstance(present.get("qk_rope_head_dim"), int) \
            and "head_dim" in present:  # latent attention whose head_dim is a whole head: unrotated part + rotated one
        out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    experts = any(isinstance(present.get(k), int) for k in EXPERTS)
    for key in TOP_K:  # routed experts with the top-k left unset: the router cannot pick
        if experts and key in present and present[key] is None:
            out[key] = 2
    for key in ("coordinate_size", "shape_size"):  # a layout box: four coordinates and two sizes make the hidden
        if isinstance(present.get(key), int):
            out[key] = hidden // 6
    layers, types = present.get("per_layer_config"), present.get("layer_types")
    if isinstance(layers, dict) and layers and isinstance(types, list) and all(isinstance(v, dict) for v in layers.values()):
        # a layer's own sizes (a wider head in the global layers): scaled as the base sizes were, and given to the
        # kept layers of the same kind
        kinds = {types[int(i)]: {k: scaled(k, v, present, out) for k, v in sizes.items()} for i, sizes in layers.items()
                 if str(i).isdigit() and int(i) < len(types)}
        kept = out.get("layer_types", types)
        out["per_layer_config"] = {} if uniform else {str(j): kinds[t] for j, t in enumerate(kept) if t in kinds}
    languages = present.get("languages")
    if present.get("default_language", 0) is None and isinstance(languages, (list, tuple)) and languages:
        out["default_language"] = languages[0]  # a one-language deployment: the adapter is picked by the config
    rope = present.get("rope_parameters")
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope:
        out["rope_parameters"] = dict(rope, original_max_position_embeddings=POSITIONS // 2)
    return out


def scaled(key: str, value: Any, present: dict, out: dict) -> Any:
    """A per-layer override ``value`` of size ``key``, scaled by the ratio the base size was shrunk by."""
    base, small = present.get(key), out.get(key)
    if isinstance(value, int) and isinstance(base, int) and isinstance(small, int) and base > 0:
        return max(1, value * small // base)
    return value


def build(model_type: str, task: str, path: Path) -> tuple[str | None, str]:
    """Save a tiny random-init checkpoint of ``model_type`` at ``path``; returns (reason left out or None, kind)."""
    import torch
    from transformers.models.auto import configuration_auto

    config_cls = configuration_auto.CONFIG_MAPPING[model_type]
    why = left_out(config_cls())
    if why:
        return why, ""
    model, why, refused = None, "", None
    for hidden, latent, uniform in TRIES:
        try:
            model = tiny(config_cls, task, hidden, latent, uniform)
        except Exception as e:  # noqa: BLE001 - a config refusing this try's sizes (validators) may take the next
            refused = refused or e
            continue
        if getattr(model, "main_input_name", "input_ids") != "input_ids":
            return f"reads {model.main_input_name}, not token ids (not a text model)", ""
        why = runs(model)
        if why is None:
            break
    if model is None:
        raise refused  # every try refused: the first refusal is the reason
    if why is not None:
        return f"cannot be built tiny: the tiny model does not run in transformers ({why})", ""
    if task == "causal-lm" and config_cls().to_dict().get("is_decoder") is False and not causal(model):
        # a decoder checkpoint sets it: left False, the layers attend both ways and the model is no causal LM
        model = tiny(config_cls, task, hidden, latent, uniform, is_decoder=True)
    recurrent = sorted({type(m).__name__ for m in model.modules() if any(r in type(m).__name__ for r in RECURRENT_MODULES)})
    if recurrent:
        return f"state-space / recurrent / hybrid layers ({', '.join(recurrent)[:80]})", ""
    with torch.no_grad():  # random-init norms and heads are near-trivial: perturb so parity sees real values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    kind = {"text2text-generation": "seq2seq", "causal-lm": "decoder"}.get(task, "encoder")
    return None, kind


def tiny(config_cls: Any, task: str, hidden: int, latent: bool, uniform: bool = False, **fixed: Any) -> Any:
    """The random-init model of ``config_cls`` for ``task``, shrunk (``shrink``) to hidden size ``hidden`` (a latent
    head the sum of its parts when ``latent``, every layer the base sizes when ``uniform``), with the settings
    ``fixed``."""
    import torch

    overrides = shrink(config_cls(), hidden, latent, uniform) | fixed
    if task == "text2text-generation" and getattr(config_cls(), "decoder_start_token_id", None) is None:
        overrides["decoder_start_token_id"] = 0  # generation needs one; released checkpoints set it
    config = config_cls(**overrides)
    if task == "sequence-classification":
        config.num_labels = 3
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
    torch.manual_seed(0)
    return auto_class(task).from_config(config).eval()


def auto_class(task: str) -> Any:
    """transformers' auto class that builds or loads a model for one of the sweep's tasks."""
    import transformers as T

    return {"text2text-generation": T.AutoModelForSeq2SeqLM, "feature-extraction": T.AutoModel,
            "causal-lm": T.AutoModelForCausalLM, "sequence-classification": T.AutoModelForSequenceClassification}[task]


def causal(model: Any) -> bool:
    """Whether ``model``'s output at a position is blind to the tokens after it (a changed last token leaves every
    earlier position's output as it was)."""
    import torch

    ids = torch.randint(3, VOCAB // 2, (1, 9), generator=torch.Generator().manual_seed(2))
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % (VOCAB // 2) + 3
    with torch.no_grad():
        a, b = (model(input_ids=x).logits[:, :-1] for x in (ids, other))
    return bool(torch.allclose(a, b, atol=1e-5))


def runs(model: Any) -> str | None:
    """None when ``model`` runs a forward on a small batch of token ids in transformers, else the error's first line
    (a tiny config whose derived sizes disagree: the shrinker's failure, not the architecture's)."""
    import torch

    ids = torch.randint(3, VOCAB // 2, (2, 9), generator=torch.Generator().manual_seed(1))  # the weights' draws untouched
    extra = {"decoder_input_ids": ids[:, :3]} if getattr(model.config, "is_encoder_decoder", False) else {}
    try:
        with torch.no_grad():
            model(input_ids=ids, **extra)
    except Exception as e:  # noqa: BLE001 - any failure here is the tiny config's
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
    return None


def child(model_type: str, task: str, work: Path, threads: int, int4: bool) -> dict:
    """One architecture, in this (child) process: build, compile at FP32 (and INT4 for decoders), summarise."""
    import contextlib
    import io

    from kiln.cli import main

    ckpt, result = work / "ckpt", {"model_type": model_type, "task": task}
    try:
        why, kind = build(model_type, task, ckpt)
    except Exception as e:  # noqa: BLE001 - any failure to build tiny is a reason to leave it out
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return result | {"status": "left out", "reason": f"cannot be built tiny: {type(e).__name__}: {first}"}
    if why:
        return result | {"status": "left out", "reason": why}
    result["kind"] = kind
    precisions = ["fp32"] + (["int4"] if int4 and kind == "decoder" else [])
    for precision in precisions:
        out = work / f"art-{precision}"
        args = ["compile", str(ckpt), "-o", str(out), "--max-length", str(POSITIONS), "--threads", str(threads), "-q",
                "--verify-max-length", "64"]
        if precision == "int4":
            args += ["--precision", "int4", "--quant-method", "rtn"]
        err = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except BaseException as e:  # noqa: BLE001 - a traceback is a finding, recorded with its type
                rc, _ = 3, print(f"traceback: {type(e).__name__}: {e}", file=err)
        entry: dict = {"seconds": round(time.perf_counter() - start, 1)}
        if rc != 0 and precision == "int4" and "--group-size" in err.getvalue() and "--group-size" not in args:
            args += ["--group-size", "16"]  # a tiny layer narrower than the default group: the one retry
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    rc = main(args)
                except BaseException as e:  # noqa: BLE001
                    rc, _ = 3, print(f"traceback: {type(e).__name__}: {e}", file=err)
            entry["group_size"] = 16
        if rc == 0:
            entry |= summarise(out)
        else:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            line = next((x for x in lines if "error:" in x or x.startswith("traceback")), lines[-1] if lines else "")
            entry |= {"status": "fails", "reason": line.split("error: ", 1)[-1][:400]}
        result[precision] = entry
        if entry["status"] == "fails":
            break
    return result


def summarise(artifact: Path) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    verification = manifest.get("verification", {})
    if verification.get("status") != "passed":
        return {"status": "fails", "reason": f"verification {verification.get('status')}"}
    sections = manifest.get("attention") or {}
    if "layers" in sections:
        sections = {"model": sections}
    unfused = sum(s.get("unfused", 0) for s in sections.values())
    dense = sum(s.get("experts", {}).get("layers", 0) - s.get("experts", {}).get("fused", 0) for s in sections.values())
    why = [w for s in sections.values() for w in s.get("why", [])]
    no_cache = manifest["model"]["kind"] == "decoder" and not manifest.get("kv_cache")
    gen = verification.get("generation") or {}
    out = {"status": "fallback" if unfused or dense or no_cache else "fused",
           "layers": sum(s.get("layers", 0) for s in sections.values()), "unfused": unfused, "dense_experts": dense,
           "kv_cache": bool(manifest.get("kv_cache")), "generation_steps": gen.get("steps"),
           "lowered": {k: v for s in sections.values() for k, v in s.get("lowered", {}).items()}}
    notes = (["no KV cache"] if no_cache else []) + why + [w for s in sections.values()
                                                           for w in s.get("experts", {}).get("unfused_why", [])]
    out["traced"] = traced(manifest)
    notes = out["traced"] + notes
    if notes:
        out["reason"] = "; ".join(dict.fromkeys(notes))[:300]
    return out


def traced(manifest: dict) -> list[str]:
    """What the trace had to fix, as the manifest records it (docs/models.md#when-the-export-stops)."""
    out = [f"traced for the branch at {a['where']} ({a['value']}), checked at run time"
           for graph in (manifest.get("assumptions") or {}).values() for a in graph]
    blocks = manifest.get("length_multiple")
    if blocks:
        out.append(f"{blocks['axis']} lengths in blocks of {blocks['multiple']}, padded by the runtime")
    step = ((manifest.get("decoder") or {}).get("inputs") or [{}])[0].get("shape")
    if step and step[-1] == 1:
        out.append("the cached decoder steps one token at a time")
    return out


def run_one(model_type: str, task: str, work: Path, threads: int, int4: bool, timeout: int) -> dict:
    case = work / model_type
    case.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--child", model_type, "--task", task, "--work", str(case),
           "--threads", str(threads)] + ([] if int4 else ["--no-int4"])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "task": task, "status": "fails", "reason": f"timed out after {timeout} s"}
    finally:
        for art in case.glob("art-*"):
            subprocess.run(["rm", "-rf", str(art)])
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not last:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return {"model_type": model_type, "task": task, "status": "fails", "reason": f"child died ({proc.returncode}): {tail}"}
    return json.loads(last[-1])


def verdict(r: dict) -> tuple[str, str]:
    """(status, reason) of one row over its precisions."""
    if r.get("status") in ("left out", "fails"):
        return r["status"], r.get("reason", "")
    fp32, int4 = r.get("fp32", {}), r.get("int4")
    for e in (fp32, int4):
        if e is not None and e.get("status") == "fails":
            return "fails", (("int4: " if e is int4 else "") + e.get("reason", ""))
    status = "fallback" if "fallback" in (fp32.get("status"), (int4 or {}).get("status")) else "fused"
    return status, fp32.get("reason", "") or (int4 or {}).get("reason", "")


def table(results: list[dict]) -> str:
    rows, counts = [], {"fused": 0, "fallback": 0, "fails": 0, "left out": 0}
    for r in sorted(results, key=lambda r: r["model_type"]):
        status, reason = verdict(r)
        counts[status] += 1
        precisions = "fp32" + (" + int4" if "int4" in r else "")
        rows.append(f"| {r['model_type']} | {r.get('kind', '-')} | {r['task']} | {status} | "
                    f"{precisions if status != 'left out' else '-'} | {reason.replace('|', '/')} |")
    counted = counts["fused"] + counts["fallback"] + counts["fails"]
    ok = counts["fused"] + counts["fallback"]
    head = (f"{ok} of {counted} compile with parity ({100 * ok / max(counted, 1):.1f}%): {counts['fused']} fused, "
            f"{counts['fallback']} on the fallback, {counts['fails']} fail; {counts['left out']} left out\n\n"
            "| model_type | kind | task | result | precisions | reason |\n|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


def compile_seconds(results: list[dict]) -> float:
    return sum(r.get(p, {}).get("seconds", 0) for r in results for p in ("fp32", "int4"))


def machine() -> str:
    import onnxruntime
    import torch
    import transformers

    flags = ""
    try:
        cpu = open("/proc/cpuinfo").read()
        model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name")), "")
        have = set(next(line for line in cpu.splitlines() if line.startswith("flags")).split(":", 1)[1].split())
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in have)
    except (OSError, StopIteration):
        model = platform.processor()
    return (f"machine: {model}, {os.cpu_count()} cpus, flags {flags}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}, onnxruntime {onnxruntime.__version__}")


def write_docs(text: str) -> None:
    path = ROOT / "docs" / "models.md"
    doc = path.read_text()
    begin, end = doc.index(DOCS_BEGIN) + len(DOCS_BEGIN), doc.index(DOCS_END)
    path.write_text(doc[:begin] + "\n" + text + doc[end:])


def run_resumable(path: Path, types: list[str], jobs: int, run: Callable[[str], dict],
                  say: Callable[[dict], str]) -> dict[str, dict]:
    """Results by model type: those ``path`` (JSON lines) holds from an earlier run of the same work directory, then
    ``run`` of each of ``types`` it lacks, ``jobs`` at a time, each appended to ``path`` as it finishes (a rerun
    resumes) and told on stderr (``say``)."""
    done = {r["model_type"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}
    todo = [t for t in types if t not in done]
    print(f"{len(todo)} of {len(types)} to run", file=sys.stderr)

    def one(t: str) -> dict:
        r = run(t)
        with open(path, "a") as fh:
            fh.write(json.dumps(r) + "\n")
        print(f"{t}: {say(r)}", file=sys.stderr, flush=True)
        return r

    with ThreadPoolExecutor(jobs) as pool:
        for r in pool.map(one, todo):
            done[r["model_type"]] = r
    return done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="these model types only")
    p.add_argument("--slice", action="store_true", help="the representative slice the tests run")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per compile")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--no-int4", dest="int4", action="store_false")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--task", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.task, args.work, args.threads, args.int4)), flush=True)
        return
    types = model_types()
    wanted = SLICE if args.slice else args.only
    if wanted:
        types = {t: types[t] for t in wanted if t in types}
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-sweep-"))
    print(f"{len(types)} architectures, work {work}", file=sys.stderr)
    done = run_resumable(work / "results.jsonl", list(types), args.jobs,
                         lambda t: run_one(t, types[t], work, args.threads, args.int4, args.timeout),
                         lambda r: f"{verdict(r)[0]} {verdict(r)[1][:160]}")
    results = [done[t] for t in types if t in done]
    text = (f"```\n{machine()}\nsweep: {len(results)} model types, `kiln compile --max-length {POSITIONS}` (FP32"
            f"{', INT4 rtn for decoders' if args.int4 else ''}), {compile_seconds(results) / 60:.0f} min of compiles"
            f"\n```\n\n"
            + table(results))
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
