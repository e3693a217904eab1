"""Record the artifact's canary (``kiln.runtimes.canary``) at compile time: a few inputs per entry point, the
reference model's outputs for them, and the bound each entry's error must keep wherever the artifact is loaded.

The reference is the eager model (INT4: the eager model holding the quantized weights' values, what the kernels must
compute, so the bound is the activation rounding's and not the 4-bit grid's). Each entry's bound is four times the
error the verified artifact has on this machine, and never under the precision's float-rounding floor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.compiler.verify.parity import TOLERANCES
from kiln.runtimes import canary as lib
from kiln.runtimes.generation import pad_rows

STEPS_1, STEPS_ROWS = 1, 1
"""Decode steps after the prefill: batch 1, and the rows beside each other. Every graph run streams all the weights
(SmolLM2-135M INT4: about 11 ms on a 2-core machine, whatever the rows), so the canary runs four: a prefill and a
one-row step, a three-row prefill and a three-row step."""
LENGTHS = (4, 3, 2)
"""Prompt tokens of the canary's rows (the shared row first)."""
MARGIN = 4.0
"""An entry's bound: this times the error measured where the artifact was verified (or the floor). A quantized
graph's error moves between machines by its own activation rounding: SmolLM2-135M INT4 compiled on AVX-512 VNNI and
checked on AVX2 (emulated) went from 0.033 / 0.043 to 0.042 / 0.071 (batch 1 / three rows), 1.3-1.7x; a wrong
kernel moves it by the size of the logits."""


def floor(precision: str, codes: bool) -> float:
    """The error a correct kernel may always have: the precision's own float-rounding bound (INT4 against its codes)."""
    return TOLERANCES["int4-codes" if codes else "fp32" if precision == "int8" else precision].abs_factor


def _greedy(model: Any, row: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """A decoder alone on one prompt, no cache: the ``steps`` greedy tokens after it and the last position's logits
    (steps + 1, vocab) of the prompt and of each token fed."""
    ids = torch.tensor([row])
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            last = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, -1].float()
            logits.append(last.numpy())
            tokens.append(int(last.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return tokens[:steps], np.stack(logits)


def _decode_entry(model: Any, rows: list[list[int]], steps: int, pad_id: int) -> dict[str, np.ndarray]:
    alone = [_greedy(model, r, steps) for r in rows]
    prompt = pad_rows(rows, pad_id, "left")
    return {"ids": prompt.ids, "mask": prompt.mask, "tokens": np.array([t for t, _ in alone], np.int64).reshape(len(rows), steps),
            "logits": np.stack([lg for _, lg in alone], 1).astype(np.float32)}


def _seq2seq_entry(model: Any, ids: np.ndarray, mask: np.ndarray, steps: int, start: int) -> dict[str, np.ndarray]:
    src, m = torch.from_numpy(ids), torch.from_numpy(mask)
    tokens = torch.full((ids.shape[0], 1), start, dtype=torch.long)
    logits = []
    with torch.inference_mode():
        for _ in range(steps):
            last = model(input_ids=src, attention_mask=m, decoder_input_ids=tokens, use_cache=False).logits[:, -1].float()
            logits.append(last.numpy())
            tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], 1)
    return {"ids": ids, "mask": mask, "tokens": tokens[:, :steps].numpy().astype(np.int64),
            "logits": np.stack(logits).astype(np.float32)}


def _batch_entry(reference: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    outs = reference.run(feeds)
    return {**{f"in.{k}": v for k, v in feeds.items()}, **{f"out.{k}": np.asarray(v, np.float32) for k, v in outs.items()}}


def batch_feeds(ckpt: Any, input_names: list[str], seed: int) -> dict[str, np.ndarray]:
    """Two rows without padding (the sample texts cut to a common length, or random ids): every position is real,
    so every output element is compared."""
    from kiln.compiler.verify.cases import SAMPLE_TEXTS, make_feeds

    tok = ckpt.tokenizer
    rows = [tok(t, add_special_tokens=True)["input_ids"] for t in SAMPLE_TEXTS[:2]] if tok is not None else []
    width = min([len(r) for r in rows] + [ckpt.max_length, 16])
    if not rows or width < 2:
        ids = np.random.default_rng(seed).integers(3, ckpt.vocab_size, (2, 8), dtype=np.int64)
    else:
        ids = np.array([r[:width] for r in rows], np.int64)
    return make_feeds(ids, np.ones_like(ids), input_names)


def record(ckpt: Any, artifact: Any, root: Path, precision: str, reference_model: Any, codes: bool,
           prompts: list[list[int]] | None = None, seed: int = 0) -> dict[str, Any]:
    """Write ``canary.npz`` into the staged artifact ``root`` and return the manifest's ``canary`` section.
    ``artifact``: the staged artifact as the runtime opens it (the error it has here sets each bound);
    ``reference_model``: the eager model the entries' outputs come from (``codes``: INT4's fake-quantized one)."""
    from kiln.compiler import trace

    data = artifact.manifest.data
    gen = data.get("generation") or {}
    entries: dict[str, dict[str, np.ndarray]] = {}
    kinds: dict[str, str] = {}
    if ckpt.kind == "seq2seq":
        from kiln.compiler.verify.cases import seq2seq_sources

        ids, mask = seq2seq_sources(ckpt, seed)
        start = int(gen["decoder_start_token_id"])
        one = int(mask[0].sum())
        entries["decode_1"] = _seq2seq_entry(reference_model, ids[:1, :one], mask[:1, :one], STEPS_1 + 1, start)
        entries["decode_rows"] = _seq2seq_entry(reference_model, ids, mask, STEPS_ROWS + 1, start)
        kinds = {"decode_1": "seq2seq", "decode_rows": "seq2seq"}
    elif ckpt.task == "causal-lm" and prompts:
        pad = int(gen.get("pad_token_id", 0))
        for name, rows, steps in decode_inputs(prompts):
            entries[name] = _decode_entry(reference_model, rows, steps, pad)
            kinds[name] = "decode"
    else:
        import dataclasses

        inputs = [s.name for s in trace.io_specs(ckpt)[0]]
        runner = trace.EagerRunner(dataclasses.replace(ckpt, model=reference_model))
        entries["batch"] = _batch_entry(runner, batch_feeds(ckpt, inputs, seed))
        kinds = {"batch": "batch"}
    return finish(entries, kinds, artifact, root, precision, codes)


def decode_inputs(prompts: list[list[int]]) -> list[tuple[str, list[list[int]], int]]:
    """A decoder's canary rows: (entry, prompts, steps). The longest prompt's first tokens are the shared row: unpadded
    beside the others, it differs from itself alone only by the row count (M), which ``rows`` then isolates (a
    left-padded row also moves by the attention's rounding)."""
    tokens = [t for p in sorted(prompts, key=len, reverse=True) for t in p]
    order = [tokens[:n] for n in LENGTHS if n <= len(tokens)] or [tokens]
    return [("decode_1", order[:1], STEPS_1), ("decode_rows", order, STEPS_ROWS)]


def finish(entries: dict[str, dict[str, np.ndarray]], kinds: dict[str, str], artifact: Any, root: Path,
           precision: str, codes: bool) -> dict[str, Any]:
    """Each entry's bound from the error ``artifact`` (the shipped graph, opened) has against its reference here;
    ``canary.npz`` written into ``root``; the manifest's section returned."""
    least = floor(precision, codes)
    floor_cos = TOLERANCES[precision].min_cosine if precision in TOLERANCES else None
    section: list[dict[str, Any]] = []
    got: dict[str, Any] = {}
    for name, arrays in entries.items():
        got[name] = lib.outputs(artifact, kinds[name], arrays)
        measured, cos = lib.entry_error(kinds[name], got[name], arrays)
        rows = int(arrays["ids"].shape[0]) if "ids" in arrays else None
        entry = {"name": name, "kind": kinds[name], "bound": max(least, MARGIN * measured), "measured": measured}
        if floor_cos is not None:  # quantized: the row cosine's deficit may grow as the error may, never past the
            entry.update(cosine=cos, min_cosine=max(floor_cos, 1.0 - max(MARGIN * (1.0 - cos), 1e-4)))  # compile's
        if rows is not None:
            entry.update(rows=rows, steps=int(arrays["tokens"].shape[1]))
        section.append(entry)
    if "decode_rows" in got:  # the shared prompt beside other rows against alone, to the exact floor wherever it
        # runs, without the margin: a machine whose one-row kernel rounds otherwise (the compile's own included) fails
        # it and decodes a lone row beside an idle one (``generation.row_policy``), so that rows never disagree
        measured = lib.rows_error(got["decode_1"], got["decode_rows"])
        exact = TOLERANCES["int4-codes"].abs_factor if precision != "fp32" else TOLERANCES["fp32"].abs_factor
        section.append({"name": "rows", "kind": "rows", "of": ["decode_1", "decode_rows"], "bound": exact,
                        "measured": measured})
    np.savez(root / lib.CANARY, **{f"{e}/{k}": v for e, arrays in entries.items() for k, v in arrays.items()})
    return {"file": lib.CANARY, "reference": "codes" if codes else "eager", "entries": section}
