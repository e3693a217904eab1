"""The eager reference for checkpoints too large to hold: the model runs one layer at a time from the
checkpoint (FP32 compute) over every verification input at once, as GPTQModel and llm-compressor run
calibration. Only one layer's weights, the embeddings / final norm / head, and each input's hidden states are
in memory at any point (``kiln.compiler.layerwise``).

The generation check is teacher-forced over the artifact's own greedy tokens: the artifact generates through
its KV cache, the reference scores the whole sequence in the same layer-by-layer pass, and each step's logits
and decisive tokens are compared (``generation.compare_steps``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from kiln.compiler import lazy, trace
from kiln.compiler.layerwise import LayerStream, Transform
from kiln.compiler.load import Checkpoint
from kiln.compiler.verify.generation import compare_steps
from kiln.compiler.verify.parity import TOLERANCES
from kiln.errors import GraphRunError
from kiln.runtimes.canary import forced_steps
from kiln.runtimes.generation import pad_rows

log = logging.getLogger(__name__)


def reference_outputs(ckpt: Checkpoint, feeds: list[Mapping[str, np.ndarray]], say: Callable[[str], None],
                      transform: Transform | None = None) -> list[dict[str, np.ndarray]]:
    """Every feed's outputs (the traced wrapper's), computed one layer at a time from the checkpoint (FP32)."""
    stream = LayerStream(ckpt, say, transform)
    module = trace.graph_module(ckpt)
    input_names = [s.name for s in trace.io_specs(ckpt)[0]]
    output_names = [s.name for s in trace.io_specs(ckpt)[1]]
    calls = [lambda f=f: module(*[torch.from_numpy(f[n]) for n in input_names if n in f]) for f in feeds]
    with stream.session():
        states = stream.capture(calls)
        for _, layer in stream.layers_filled("reference", len(states)):
            stream.apply(layer, states)
        outs = stream.finish(calls, states)
    return [{n: o.float().numpy() for n, o in zip(output_names, out)} for out in outs]


class Precomputed:
    """A ``Runner`` answering each feeds dict with outputs computed beforehand (by identity of the dict)."""

    def __init__(self, feeds: list[Mapping[str, np.ndarray]], outputs: list[dict[str, np.ndarray]]) -> None:
        self._by_id = {id(f): o for f, o in zip(feeds, outputs)}
        self._keep = feeds

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._by_id[id(feeds)]


def generation_feeds(artifact: Any, rows: list[list[int]], steps: int, pad_id: int) -> tuple[Any, np.ndarray, dict]:
    """The artifact's greedy tokens through its cache, and the whole sequence for the reference to score."""
    prompt = pad_rows(rows, pad_id, "left")
    out = artifact.generate(prompt.ids, prompt.mask, max_new_tokens=steps, stop_token_ids=[], pad_token_id=pad_id)
    tokens = out[:, prompt.ids.shape[1]:]
    ids = np.concatenate([prompt.ids, tokens[:, :-1]], 1)
    mask = np.concatenate([prompt.mask, np.ones_like(tokens[:, :-1])], 1)
    return prompt, tokens, {"input_ids": ids, "attention_mask": mask}


def compare_generation(artifact: Any, prompt: Any, tokens: np.ndarray, ref_logits: np.ndarray, steps: int,
                       precision: str) -> dict[str, Any]:
    """Step logits of the artifact's cache (fed its own tokens) against the reference's over the same sequence;
    the artifact's tokens must be the reference's greedy choices wherever the reference is decisive."""
    tol = TOLERANCES[precision]
    p = prompt.ids.shape[1]
    ref_steps = np.ascontiguousarray(ref_logits[:, p - 1:].transpose(1, 0, 2))  # (steps, batch, vocab)
    ref_next = ref_steps.argmax(-1).T  # (batch, steps): the reference's choice after the artifact's prefix
    batch = tokens.shape[0]

    def teacher_forced() -> Iterator[np.ndarray]:
        return forced_steps(artifact, prompt.ids, prompt.mask, tokens[:, :steps - 1])

    base = {"steps": steps, "batch": batch, "prompt_lengths": prompt.mask.sum(1).tolist(),
            "reference": "teacher-forced over the artifact's greedy tokens, layer by layer from the checkpoint"}
    return {**base, **compare_steps(teacher_forced, ref_steps, ref_next, lambda: tokens, tol)}


def verify_streamed(ckpt: Checkpoint, open_artifact: Callable[[], Any], cases: list[Any],
                    prompts: list[list[int]] | None, steps: int, precision: str, pad_id: int,
                    say: Callable[[str], None], transform: Transform | None = None,
                    canary_inputs: Callable[[list[list[int]]], list[tuple[str, list[list[int]], int]]] | None = None,
                    canary_batch: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Parity over ``cases`` and (``prompts``) the generation check, with one layer-by-layer reference pass.

    ``open_artifact()``: a context manager yielding the loaded artifact. It is opened twice (to generate, then to
    verify) and closed while the reference runs, so its weights and the reference's are never in memory together."""
    from kiln.compiler.verify.parity import fails_on_case, verify

    feeds = [c.feeds for c in cases]
    gens: dict[str, Any] = {}
    canary_rows: dict[str, tuple[Any, np.ndarray, dict]] = {}
    if prompts:
        say(f"verify generation: {steps} greedy steps through the artifact's KV cache, a padded batch and batch 1, "
            "scored by the reference")
        with open_artifact() as artifact:
            gens = {"generation": generation_feeds(artifact, prompts, steps, pad_id),
                    "generation_1": generation_feeds(artifact, prompts[:1], steps, pad_id)}
            if canary_inputs:  # the canary's rows: the artifact's own greedy tokens, scored in the same pass
                canary_rows = {name: generation_feeds(artifact, rows, n + 1, pad_id)
                               for name, rows, n in canary_inputs(prompts)}
        feeds += [g[2] for g in gens.values()] + [g[2] for g in canary_rows.values()]
    if canary_batch is not None:
        feeds.append(canary_batch)
    say(f"reference: {len(feeds)} inputs through {len(lazy.layer_stack(ckpt.model)[0])} layers, one layer in memory "
        "at a time")
    outputs = reference_outputs(ckpt, feeds, say, transform)
    with open_artifact() as artifact:
        try:
            report = verify(Precomputed(feeds, outputs), artifact, cases, precision, say)
        except GraphRunError as e:
            raise fails_on_case(ckpt.path, e) from e
        report["reference"] = "layer by layer from the checkpoint (streamed), FP32 compute"
        scored = dict(zip([*gens, *canary_rows], outputs[len(cases):]))
        for key, (prompt, tokens, _) in gens.items():
            if report["passed"]:
                report[key] = compare_generation(artifact, prompt, tokens, scored[key]["logits"], steps, precision)
                report["passed"] = report[key]["passed"]
    report["canary_entries"] = {name: decode_entry(prompt, tokens, scored[name]["logits"])
                                for name, (prompt, tokens, _) in canary_rows.items()}
    if canary_batch is not None:  # a graph run whole: the feeds and the reference's outputs
        report["canary_entries"]["batch"] = {**{f"in.{k}": v for k, v in canary_batch.items()},
                                             **{f"out.{k}": np.asarray(v, np.float32) for k, v in outputs[-1].items()}}
    return report


def decode_entry(prompt: Any, tokens: np.ndarray, logits: np.ndarray) -> dict[str, np.ndarray]:
    """A canary decode entry from the artifact's greedy tokens (prefill, then ``tokens[:, :-1]`` fed) and the
    reference's logits over the whole sequence: the prefill's last position and each fed token's."""
    p = prompt.ids.shape[1]
    fed = tokens[:, :-1]
    return {"ids": prompt.ids, "mask": prompt.mask, "tokens": np.ascontiguousarray(fed, np.int64),
            "logits": np.ascontiguousarray(logits[:, p - 1:p + fed.shape[1]].transpose(1, 0, 2), np.float32)}
