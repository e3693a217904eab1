"""Compile-time check of an artifact's KV-cache path against Hugging Face ``generate``.

Greedy decoding on a padded batch: the artifact's cache runner is fed the reference's own tokens
step by step (so one near-tie cannot derail the rest) and every step's logits are compared with the
reference's; then the artifact's own ``generate`` must reproduce the reference tokens. Decoders
(left-padded prompts) and encoder-decoders (right-padded sources, the encoder run once) share the
step comparison.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from kiln.compiler.verify import metrics
from kiln.compiler.verify.parity import TOLERANCES, Tolerance
from kiln.errors import KilnError
from kiln.runtimes.canary import error, forced_seq2seq, forced_steps
from kiln.runtimes.generation import pad_rows


GENERATION_STEPS = 16
"""Greedy steps the compile-time generation check runs through the KV cache."""


@contextlib.contextmanager
def greedy_config(model: Any, steps: int, pad_id: int) -> Iterator[Any]:
    """Inside: ``model`` decodes plain greedy (no end-of-sequence stop) for ``steps`` tokens with the generation
    config yielded, which is what the artifact's own ``generate`` does. The checkpoint's generation config is set
    aside for the call, not merged: ``generate`` fills every unset field from it, and its logits processors
    (suppressed or forced tokens, repetition penalties, banned n-grams, an end-of-sequence token that a minimum
    length suppresses) change which token is picked, while the check compares the model's own argmax. Only the ids
    that say where decoding starts are kept."""
    from transformers import GenerationConfig

    own = getattr(model, "generation_config", None)
    start = {k: getattr(own, k) for k in ("bos_token_id", "decoder_start_token_id") if getattr(own, k, None) is not None}
    config = GenerationConfig(**start, pad_token_id=pad_id, max_new_tokens=steps, do_sample=False, num_beams=1,
                              output_logits=True, return_dict_in_generate=True)
    model.generation_config = GenerationConfig(**start, pad_token_id=pad_id)
    try:
        yield config
    finally:
        model.generation_config = own


def places_padded_rows(model: Any) -> bool:
    """Whether Hugging Face ``generate`` gives a left-padded row the positions it has alone: it derives position ids
    from the attention mask only for a forward that takes ``position_ids``; any other forward numbers a padded row
    from its first pad, which is not the model's answer for that row (the artifact's positions come from the mask)."""
    import inspect

    return "position_ids" in inspect.signature(model.forward).parameters


PLAIN_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "past_key_values", "cache_position",
                          "use_cache", "logits_to_keep", "inputs_embeds", "token_type_ids", "return_dict"})
"""What ``prepare_inputs_for_generation`` may hand the forward besides tokens the compiled graph also sees."""


def generation_inputs(model: Any, row: list[int]) -> list[str]:
    """The tensors a model's ``generate`` feeds its forward that the artifact's traced forward does not take
    (``prepare_inputs_for_generation`` building e.g. a permutation mask and target mapping around a dummy token):
    such a model's next token is not the plain forward's last logits, and kiln cannot reproduce it."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return []
    try:
        ids = torch.tensor([row])
        fed = prepare(ids, attention_mask=torch.ones_like(ids))
    except Exception:  # a signature kiln does not know: no claim either way
        return []
    return sorted(k for k, v in fed.items() if isinstance(v, torch.Tensor) and k not in PLAIN_INPUTS)


def verify_generation(model: Any, artifact: Any, rows: list[list[int]], steps: int, precision: str,
                      pad_id: int) -> dict[str, Any]:
    tol = TOLERANCES[precision]
    prompt = pad_rows(rows, pad_id, "left")
    batched = places_padded_rows(model)
    with torch.inference_mode(), greedy_config(model, steps, pad_id) as config:
        if batched:
            ref = model.generate(input_ids=torch.from_numpy(prompt.ids), attention_mask=torch.from_numpy(prompt.mask),
                                 generation_config=config)
            ref_tokens = ref.sequences[:, prompt.ids.shape[1]:].numpy()
            ref_logits = np.stack([s.float().numpy() for s in ref.logits])  # (steps, batch, vocab)
        else:  # each row alone: the artifact's padded batch must still give every row its own answer
            alone = [model.generate(input_ids=torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.long),
                                    generation_config=config) for r in rows]
            ref_tokens = np.concatenate([a.sequences[:, len(r):].numpy() for a, r in zip(alone, rows)])
            ref_logits = np.stack([np.concatenate([a.logits[t].float().numpy() for a in alone]) for t in range(steps)])

    base = {"steps": steps, "batch": len(rows), "prompt_lengths": [len(r) for r in rows],
            "reference": "batch" if batched else "rows alone"}
    kv = artifact.manifest.data.get("kv_cache")
    base["through"] = "kv cache" if kv else "recompute (no KV cache)"

    def teacher_forced() -> Iterator[np.ndarray]:
        return forced_steps(artifact, prompt.ids, prompt.mask, ref_tokens[:, :steps - 1])

    def generated() -> np.ndarray:
        out = artifact.generate(prompt.ids, prompt.mask, max_new_tokens=steps, stop_token_ids=[], pad_token_id=pad_id)
        return out[:, prompt.ids.shape[1]:]

    result = {**base, **compare_steps(teacher_forced, ref_logits, ref_tokens, generated, tol)}
    if not result["passed"]:  # why, where the model's generate is not the plain forward
        result["generate_inputs"] = generation_inputs(model, rows[0])
    return result


def verify_seq2seq(model: Any, artifact: Any, ids: np.ndarray, mask: np.ndarray, steps: int,
                   precision: str) -> dict[str, Any]:
    """Encoder + cached decoder against ``generate``; the tokens start after the decoder start token."""
    tol = TOLERANCES[precision]
    pad = int(artifact.manifest.data["generation"]["pad_token_id"])
    with torch.inference_mode(), greedy_config(model, steps, pad) as config:
        ref = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             generation_config=config)
    ref_tokens = ref.sequences.numpy()  # (batch, 1 + steps): starts with decoder_start_token_id
    ref_logits = np.stack([x.float().numpy() for x in ref.logits])
    base = {"steps": steps, "batch": int(ids.shape[0]), "source_lengths": mask.sum(1).tolist()}

    def teacher_forced() -> Iterator[np.ndarray]:
        return forced_seq2seq(artifact, ids, mask, ref_tokens[:, :steps])

    def generated() -> np.ndarray:
        return artifact.generate(ids, mask, max_new_tokens=steps, stop_token_ids=[], pad_token_id=pad)[:, 1:]

    # encoder-decoders must reproduce the reference exactly: a tie does not excuse different tokens
    return {**base, **compare_steps(teacher_forced, ref_logits, ref_tokens[:, 1:], generated, tol, allow_ties=False)}


def compare_steps(teacher_forced: Callable[[], Iterator[np.ndarray]], ref_logits: np.ndarray, ref_next: np.ndarray,
                  generated: Callable[[], np.ndarray], tol: Tolerance, allow_ties: bool = True) -> dict[str, Any]:
    """Compare the artifact's step logits (fed the reference's tokens) with the reference's, then the
    artifact's own greedy tokens with the reference's. ``ref_logits`` (steps, batch, vocab), ``ref_next``
    (batch, steps): the token the reference chose at each step."""
    worst, atol, ties, wrong, cos_min, decisive_n = 0.0, 0.0, 0, [], 1.0, 0
    try:
        for t, logits in enumerate(teacher_forced()):
            r = ref_logits[t].astype(np.float64)
            a = tol.abs_factor * max(1.0, float(np.abs(r).max()))
            worst, atol = max(worst, float(np.abs(logits - r).max() / a)), a
            top = np.sort(r, -1)
            decisive = (top[:, -1] - top[:, -2]) > a
            decisive_n += int(decisive.sum())
            pair = (metrics.centered(r), metrics.centered(logits)) if tol.centered_logits else (r, logits)
            cos_min = min(cos_min, float(metrics.row_cosines(*pair).min()))
            differs = logits.argmax(-1) != ref_next[:, t]
            ties += int((differs & ~decisive).sum())
            wrong += [(t, int(b)) for b in np.flatnonzero(differs & decisive)]
        identical = bool(np.array_equal(generated(), ref_next))
    except KilnError as e:  # the cached graph failed to run at all
        return {"passed": False, "error": str(e), "tokens_identical": False, "max_abs_over_atol": float("inf"),
                "ties": 0, "wrong_tokens": [], "cosine_min": None}
    # None when every step was a near-tie: nothing decisive to agree on (not a perfect score)
    agreement = 1.0 - len(wrong) / decisive_n if decisive_n else None
    if tol.min_cosine is None:  # exact precisions: every step within the abs bound, every decisive token right
        passed = worst <= 1.0 and not wrong and (identical or (allow_ties and ties > 0))
    else:  # quantized: step logits close in direction, decisive tokens mostly right
        passed = cos_min >= tol.min_cosine and (agreement is None or agreement >= tol.min_top1)
    return {"tokens_identical": identical, "max_abs_over_atol": worst, "atol": atol, "ties": ties,
            "wrong_tokens": wrong[:10], "cosine_min": cos_min, "decisive_agreement": agreement, "passed": passed}


ROW_COUNTS = (1, 2, 4, 8)
"""Rows the scheduler's decode steps run at once that the compile checks, each row against itself alone."""
ROW_STEPS = 3


def row_prompts(prompts: list[list[int]], count: int) -> list[list[int]]:
    """``count`` prompts of different lengths (3, 5, 7, ... tokens) cut from the generation prompts' tokens."""
    tokens = [t for p in prompts for t in p] or [0]
    while len(tokens) < 2 * count + 1 + count:
        tokens = tokens + tokens
    return [tokens[i:i + 3 + 2 * i] for i in range(count)]


def verify_rows(artifact: Any, prompts: list[list[int]], precision: str) -> dict[str, Any] | None:
    """Continuous batching's decode (``SlotCache``: one row per request, each at its own length) with 1, 2, 4 and 8
    rows of different lengths, every row's step logits against the same row decoded alone (M = 1, the path a lone
    request takes): a row's answer must not depend on what runs beside it. None where the graph gives every row the
    same past length (no continuous batching)."""
    kv = artifact.manifest.data.get("kv_cache") or {}
    if not artifact.runtime.keeps_rows(kv):
        return None
    rows = row_prompts(prompts, max(ROW_COUNTS))
    # FP32: float rounding. A quantized graph re-rounds its activations to int8 in every layer, so one kernel's
    # rounding (M = 1 sums in another order than M > 1 for some formats, docs/verification.md) can move a code, and
    # the move grows layer by layer: a 2-layer StableLM INT8 moved 1.5e-3 of its largest logit. Its bound is the
    # precision's own, which a kernel that computes one row wrongly misses by the size of the logits.
    tol = TOLERANCES[precision if precision in TOLERANCES else "fp32"]
    positions = max(len(r) for r in rows) + ROW_STEPS + 1
    if positions > int(kv["capacity"]):
        return None
    cache = artifact.runtime.slot_cache(kv, max(ROW_COUNTS), positions)
    try:
        alone = []  # per row: the greedy tokens it decodes alone and each step's logits
        for r in rows:
            tokens, logits = [int(cache.prefill(0, [np.asarray(r, np.int64)])[0].argmax())], []
            for s in range(ROW_STEPS):
                step = cache.decode(np.array(tokens[-1:]), np.array([len(r) + s]))[0]
                logits.append(step)
                tokens.append(int(step.argmax()))
            alone.append((tokens, logits))
        worst: dict[int, float] = {}
        same_tokens = True
        for n in ROW_COUNTS[1:]:
            for i in range(n):
                cache.prefill(i, [np.asarray(rows[i], np.int64)])
            err = 0.0
            for s in range(ROW_STEPS):
                step = cache.decode(np.array([alone[i][0][s] for i in range(n)]),
                                    np.array([len(rows[i]) + s for i in range(n)]))
                for i in range(n):
                    ref = alone[i][1][s]
                    err = max(err, error(step[i], ref))
                    same_tokens &= int(step[i].argmax()) == alone[i][0][s + 1]
            worst[n] = err
    finally:
        cache.close()
    return {"rows": list(ROW_COUNTS), "steps": ROW_STEPS, "prompt_lengths": [len(r) for r in rows],
            "max_abs_over_bound": {str(n): e / tol.abs_factor for n, e in worst.items()}, "bound": tol.abs_factor,
            "tokens_identical": bool(same_tokens), "passed": all(e <= tol.abs_factor for e in worst.values())}
