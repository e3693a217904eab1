"""The eager reference for checkpoints too large to hold: the decoder runs one layer at a time from the
checkpoint (FP32 compute) over every verification input at once, as GPTQModel and llm-compressor run
calibration. Only one layer's weights, the embeddings / final norm / head, and each input's hidden states are
in memory at any point.

How it stays generic: the model's own forward runs twice around the layer loop. First with its layer list
replaced by a catcher that records what layer 0 receives (hidden states, mask, rotary tables, positions) and
stops; then each real layer is filled from the checkpoint, applied to every recorded input, and emptied; last,
the forward runs again with a layer that hands back the final hidden states, so the family's own norm, head
and soft-capping produce the outputs. Every layer must take the same arguments (one mask type): a model
whose layers differ (sliding and global layers) is refused with the reason.

The generation check is teacher-forced over the artifact's own greedy tokens: the artifact generates through
its KV cache, the reference scores the whole sequence in the same layer-by-layer pass, and each step's logits
and decisive tokens are compared (``generation.compare_steps``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.compiler import lazy, trace
from kiln.compiler.load import Checkpoint
from kiln.compiler.verify.generation import compare_steps
from kiln.compiler.verify.parity import TOLERANCES
from kiln.errors import UnsupportedModelError
from kiln.runtimes.generation import pad_rows

log = logging.getLogger(__name__)

Transform = Callable[[str, torch.Tensor], torch.Tensor]
"""(the shell's parameter name, FP32 value) -> the value the reference computes with (INT4: the dequantized
codes; a tied head and embedding table are quantized apart, so this goes by parameter, not checkpoint tensor)."""


class _Caught(Exception):
    pass


class _Catcher(nn.Module):
    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        self.attention_type = getattr(like, "attention_type", None)
        self.seen: tuple[torch.Tensor, tuple, dict] | None = None

    def forward(self, hidden, *args, **kwargs):
        self.seen = (hidden, args, kwargs)
        raise _Caught


class _Replay(nn.Module):
    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        self.attention_type = getattr(like, "attention_type", None)
        self.value: torch.Tensor | None = None

    def forward(self, hidden, *args, **kwargs):
        return self.value


class LayerStream:
    """The reference model of a streamed checkpoint, run layer by layer over a list of feeds."""

    def __init__(self, ckpt: Checkpoint, say: Callable[[str], None], transform: Transform | None = None) -> None:
        self.ckpt = ckpt
        self.say = say
        self.transform = transform
        self.shell = ckpt.model
        self.weights: lazy.LazyWeights = ckpt.weights
        lazy.to_meta(self.shell)  # the trace left fake tensors; parameters are filled from the checkpoint here
        self.keys = lazy.parameter_keys(self.shell, self.weights)
        self.layers, self.stack = lazy.layer_stack(self.shell)
        types = {getattr(layer, "attention_type", None) for layer in self.layers}
        if len(types) > 1:
            raise UnsupportedModelError(
                f"{ckpt.path}: its layers take different attention masks ({', '.join(sorted(map(str, types)))}); the "
                "layer-by-layer reference needs one kind: compile it without --stream on a machine that holds it in FP32")
        self.input_names = [s.name for s in trace.io_specs(ckpt)[0]]
        self.output_names = [s.name for s in trace.io_specs(ckpt)[1]]

    # --- weights in and out -----------------------------------------------------------------------
    def _fill(self, root: nn.Module, prefix: str, names: list[str]) -> None:
        """``root``'s parameters (by name relative to it; ``prefix`` makes them the shell's names) from the
        checkpoint, tied ones sharing one tensor."""
        done: dict[str, nn.Parameter] = {}  # one Parameter per tensor: tied parameters stay one object
        for name in names:
            key = self.keys[prefix + name]
            share = key if self.transform is None else prefix + name
            if share not in done:
                value = self.weights.torch(key)
                value = self.transform(prefix + name, value) if self.transform else value
                done[share] = nn.Parameter(value, requires_grad=False)
            owner, _, leaf = name.rpartition(".")
            module = root.get_submodule(owner) if owner else root
            module._parameters[leaf] = done[share]

    def _outer(self, part: str) -> list[str]:
        """Parameters outside the layer stack: ``"in"`` those the forward reaches before the first layer (the input
        embeddings), ``"out"`` the rest (final norm, head). A tied head is both."""
        prefix = self.stack + "."
        first = {id(p) for p in self.shell.get_input_embeddings().parameters()}
        head = self.shell.get_output_embeddings() if hasattr(self.shell, "get_output_embeddings") else None
        last = {id(p) for p in head.parameters()} if head is not None else set()
        return [n for n, p in self.shell.named_parameters(remove_duplicate=False) if not n.startswith(prefix) and
                (id(p) in first if part == "in" else id(p) not in first or id(p) in last)]

    def _placeholder_embeddings(self) -> None:
        """The final pass replays each input's last hidden states, so the input embeddings it still looks up are
        never used: an untied table becomes a zero row broadcast to its shape (no memory) instead of being read."""
        for name, p in self.shell.get_input_embeddings().named_parameters():
            if p.is_meta:
                owner, _, leaf = name.rpartition(".")
                module = self.shell.get_input_embeddings()
                module = module.get_submodule(owner) if owner else module
                module._parameters[leaf] = nn.Parameter(torch.zeros(1, *p.shape[1:]).expand(p.shape),
                                                        requires_grad=False)

    def _restore_buffers(self) -> None:
        for name, value in self.ckpt.buffers.items():
            owner, _, leaf = name.rpartition(".")
            module = self.shell.get_submodule(owner) if owner else self.shell
            module._buffers[leaf] = value.clone()

    def _swap_stack(self, replacement: nn.ModuleList) -> None:
        owner, _, leaf = self.stack.rpartition(".")
        setattr(self.shell.get_submodule(owner) if owner else self.shell, leaf, replacement)

    # --- the run ------------------------------------------------------------------------------------
    def run_all(self, feeds: list[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Every feed's outputs (the traced wrapper's), computed one layer at a time."""
        module = trace.graph_module(self.ckpt)
        self._restore_buffers()
        # the input embeddings for the capture, one layer at a time, the rest of the model for the end: never more
        # than one layer's weights or the non-layer weights in memory at once
        self._fill(self.shell, "", self._outer("in"))
        catcher, replay = _Catcher(self.layers[0]), _Replay(self.layers[0])
        states: list[tuple[torch.Tensor, tuple, dict]] = []
        try:
            with torch.inference_mode():
                self._swap_stack(nn.ModuleList([catcher]))
                for f in feeds:
                    try:
                        module(*[torch.from_numpy(f[n]) for n in self.input_names if n in f])
                    except _Caught:
                        pass
                    if catcher.seen is None:
                        raise UnsupportedModelError(f"{self.ckpt.path}: the model's forward never reached its first layer")
                    states.append(catcher.seen)
                    catcher.seen = None
                lazy.to_meta(self.shell)
                start, n = time.perf_counter(), len(self.layers)
                for i, layer in enumerate(self.layers):
                    self._fill(layer, f"{self.stack}.{i}.", [p for p, _ in layer.named_parameters()])
                    for j, (hidden, args, kwargs) in enumerate(states):
                        out = layer(hidden, *args, **kwargs)
                        states[j] = (out[0] if isinstance(out, tuple) else out, args, kwargs)
                    lazy.to_meta(layer)
                    elapsed = time.perf_counter() - start
                    self.say(f"reference layer {i + 1}/{n}: {len(states)} inputs, {elapsed:.0f} s elapsed, "
                             f"~{elapsed / (i + 1) * (n - i - 1):.0f} s left")
                self._swap_stack(nn.ModuleList([replay]))
                self._fill(self.shell, "", self._outer("out"))
                self._placeholder_embeddings()
                results = []
                for f, (hidden, _, _) in zip(feeds, states):
                    replay.value = hidden
                    outs = module(*[torch.from_numpy(f[n]) for n in self.input_names if n in f])
                    results.append({n: o.float().numpy() for n, o in zip(self.output_names, outs)})
                return results
        finally:
            self._swap_stack(self.layers)
            lazy.to_meta(self.shell)


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
    kv = artifact.manifest.data["kv_cache"]
    batch = tokens.shape[0]

    def teacher_forced() -> Iterator[np.ndarray]:
        runner = artifact.runtime.cache_runner(kv, batch)
        mask = prompt.mask
        try:
            yield runner.step(prompt.ids, mask)[:, -1]
            for t in range(steps - 1):
                mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
                yield runner.step(tokens[:, t:t + 1], mask)[:, -1]
        finally:
            runner.close()

    base = {"steps": steps, "batch": batch, "prompt_lengths": prompt.mask.sum(1).tolist(),
            "reference": "teacher-forced over the artifact's greedy tokens, layer by layer from the checkpoint"}
    return {**base, **compare_steps(teacher_forced, ref_steps, ref_next, lambda: tokens, tol)}


def verify_streamed(ckpt: Checkpoint, open_artifact: Callable[[], Any], cases: list[Any],
                    prompts: list[list[int]] | None, steps: int, precision: str, pad_id: int,
                    say: Callable[[str], None], transform: Transform | None = None) -> dict[str, Any]:
    """Parity over ``cases`` and (``prompts``) the generation check, with one layer-by-layer reference pass.

    ``open_artifact()``: a context manager yielding the loaded artifact. It is opened twice (to generate, then to
    verify) and closed while the reference runs, so its weights and the reference's are never in memory together."""
    from kiln.compiler.verify.parity import verify

    feeds = [c.feeds for c in cases]
    gen = None
    if prompts:
        say(f"verify generation: {steps} greedy steps through the artifact's KV cache, scored by the reference")
        with open_artifact() as artifact:
            gen = generation_feeds(artifact, prompts, steps, pad_id)
        feeds.append(gen[2])
    say(f"reference: {len(feeds)} inputs through {len(lazy.layer_stack(ckpt.model)[0])} layers, one layer in memory "
        "at a time")
    outputs = LayerStream(ckpt, say, transform).run_all(feeds)
    with open_artifact() as artifact:
        report = verify(Precomputed(feeds, outputs), artifact, cases, precision, say)
        report["reference"] = "layer by layer from the checkpoint (streamed), FP32 compute"
        if gen is not None and report["passed"]:
            prompt, tokens, _ = gen
            report["generation"] = compare_generation(artifact, prompt, tokens, outputs[-1]["logits"], steps,
                                                      precision)
            report["passed"] = report["generation"]["passed"]
    return report
