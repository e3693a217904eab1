"""A streamed checkpoint's model (a decoder or an encoder) run one layer at a time, as GPTQModel and llm-compressor
run calibration: only one layer's weights, the embeddings / final norm / head, and each input's hidden states are
in memory at any point. The streamed reference (``verify.streamed``) and streamed GPTQ (``quantize.gptq``) both
run on it.

How it stays generic: the model's own forward runs twice around the layer loop. First with its layer list
replaced by a catcher that records what layer 0 receives (hidden states, mask, rotary tables, positions) and
stops (``capture``); then each real layer is filled from the checkpoint, handed to the caller with every
recorded input, and emptied (``layers``); last, the forward runs again with a layer that hands back the final
hidden states, so the family's own norm, head and soft-capping run (``finish``). Every layer must take the same
arguments (one mask type): a model whose layers differ (sliding and global layers) is refused with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kiln.compiler import lazy
from kiln.compiler.load import Checkpoint
from kiln.errors import UnsupportedModelError

Transform = Callable[[str, torch.Tensor], torch.Tensor]
"""(the shell's parameter name, FP32 value) -> the value the model computes with (INT4: the dequantized
codes; a tied head and embedding table are quantized apart, so this goes by parameter, not checkpoint tensor)."""
State = tuple[torch.Tensor, tuple, dict]
"""What a layer receives for one input: hidden states, the other positional arguments, the keyword arguments."""


class _Caught(Exception):
    pass


class _Catcher(nn.Module):
    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        self.attention_type = getattr(like, "attention_type", None)
        self.seen: State | None = None

    def forward(self, hidden, *args, **kwargs):
        self.seen = (hidden, args, kwargs)
        raise _Caught


class _Replay(nn.Module):
    def __init__(self, like: nn.Module, as_tuple: bool) -> None:
        super().__init__()
        self.attention_type = getattr(like, "attention_type", None)
        self.value: torch.Tensor | None = None
        self.as_tuple = as_tuple  # what the real layers returned: the stack's loop indexes a tuple's first item

    def forward(self, hidden, *args, **kwargs):
        return (self.value,) if self.as_tuple else self.value


class LayerStream:
    """The model of a streamed checkpoint (``ckpt.model``, an empty shell), run layer by layer.

    ``dtype``: what the embeddings, final norm and head compute in (the layers are handed over in FP32; the
    caller may cast them)."""

    def __init__(self, ckpt: Checkpoint, say: Callable[[str], None], transform: Transform | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.ckpt, self.say, self.transform, self.dtype = ckpt, say, transform, dtype
        self.shell = ckpt.model
        self.weights: lazy.LazyWeights = ckpt.weights
        lazy.to_meta(self.shell)  # the trace left fake tensors; parameters are filled from the checkpoint here
        self.keys = lazy.parameter_keys(self.shell, self.weights)
        self.layers, self.stack = lazy.layer_stack(self.shell)
        self._tuples = False  # whether the layers return tuples (older families) rather than the hidden states
        types = {getattr(layer, "attention_type", None) for layer in self.layers}
        if len(types) > 1:
            raise UnsupportedModelError(
                f"{ckpt.path}: its layers take different attention masks ({', '.join(sorted(map(str, types)))}); the "
                "layer-by-layer run needs one kind: compile it without --stream on a machine that holds it in FP32")

    # --- weights in and out -----------------------------------------------------------------------
    def read(self, name: str) -> torch.Tensor:
        """One parameter of the shell (by its name) from the checkpoint, FP32, through ``transform``."""
        value = self.weights.torch(self.keys[name])
        return self.transform(name, value) if self.transform else value

    def _fill(self, root: nn.Module, prefix: str, names: list[str], dtype: torch.dtype = torch.float32) -> None:
        """``root``'s parameters (by name relative to it; ``prefix`` makes them the shell's names) from the
        checkpoint, tied ones sharing one tensor."""
        done: dict[str, nn.Parameter] = {}  # one Parameter per tensor: tied parameters stay one object
        for name in names:
            key = self.keys[prefix + name]
            share = key if self.transform is None else prefix + name
            if share not in done:
                done[share] = nn.Parameter(self.read(prefix + name).to(dtype), requires_grad=False)
            owner, _, leaf = name.rpartition(".")
            module = root.get_submodule(owner) if owner else root
            module._parameters[leaf] = done[share]

    def _outer(self, part: str) -> list[str]:
        """Parameters outside the layer stack. ``"in"``: all the forward may reach before the first layer (token
        table, an encoder's position and type tables and embedding norm), so everything but an untied output head,
        the one large tensor there; ``"out"``: what the final pass reads (norms, pooler, head), so everything but the
        untied token table, which it never looks at (``_placeholder_embeddings``). A tied head is both."""
        prefix = self.stack + "."
        table = {id(p) for p in self.shell.get_input_embeddings().parameters()}
        head = self.head()
        last = {id(p) for p in head.parameters()} if head is not None else set()
        outer = [(n, p) for n, p in self.shell.named_parameters(remove_duplicate=False) if not n.startswith(prefix)]
        if part == "in":
            return [n for n, p in outer if id(p) in table or id(p) not in last]
        return [n for n, p in outer if id(p) not in table or id(p) in last]

    def head(self) -> nn.Module | None:
        return self.shell.get_output_embeddings() if hasattr(self.shell, "get_output_embeddings") else None

    def _placeholder_embeddings(self) -> None:
        """The final pass replays each input's last hidden states, so the input embeddings it still looks up are
        never used: an untied table becomes a zero row broadcast to its shape (no memory) instead of being read."""
        for name, p in self.shell.get_input_embeddings().named_parameters():
            if p.is_meta:
                owner, _, leaf = name.rpartition(".")
                module = self.shell.get_input_embeddings()
                module = module.get_submodule(owner) if owner else module
                module._parameters[leaf] = nn.Parameter(torch.zeros(1, *p.shape[1:], dtype=self.dtype).expand(p.shape),
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
    @contextmanager
    def session(self) -> Iterator[LayerStream]:
        """Around ``capture`` .. ``finish``: the shell gets its layers back and holds no weights afterwards."""
        self._restore_buffers()
        try:
            with torch.inference_mode():
                yield self
        finally:
            self._swap_stack(self.layers)
            lazy.to_meta(self.shell)

    def capture(self, calls: list[Callable[[], Any]]) -> list[State]:
        """What layer 0 receives in each call of the model's forward (the input embeddings only in memory)."""
        self._fill(self.shell, "", self._outer("in"), self.dtype)
        catcher = _Catcher(self.layers[0])
        self._swap_stack(nn.ModuleList([catcher]))
        states: list[State] = []
        for call in calls:
            try:
                call()
            except _Caught:
                pass
            if catcher.seen is None:
                raise UnsupportedModelError(f"{self.ckpt.path}: the model's forward never reached its first layer")
            states.append(catcher.seen)
            catcher.seen = None
        lazy.to_meta(self.shell)
        return states

    def layers_filled(self, what: str, inputs: int) -> Iterator[tuple[int, nn.Module]]:
        """Each layer in turn, filled from the checkpoint (FP32) while the caller holds it, emptied after; progress
        with elapsed time and an estimate of what is left."""
        start, n = time.perf_counter(), len(self.layers)
        for i, layer in enumerate(self.layers):
            self._fill(layer, f"{self.stack}.{i}.", [p for p, _ in layer.named_parameters()])
            yield i, layer
            lazy.to_meta(layer)
            elapsed = time.perf_counter() - start
            self.say(f"{what} layer {i + 1}/{n}: {inputs} inputs, {elapsed:.0f} s elapsed, "
                     f"~{elapsed / (i + 1) * (n - i - 1):.0f} s left")

    def empty(self) -> None:
        """Drop every weight the shell holds (each parameter back to a meta tensor)."""
        lazy.to_meta(self.shell)

    def apply(self, layer: nn.Module, states: list[State], before: Callable[[int], None] | None = None) -> None:
        """``layer`` on every state, in place (the next layer's inputs); ``before(j)`` runs ahead of state j."""
        for j, (hidden, args, kwargs) in enumerate(states):
            if before is not None:
                before(j)
            out = layer(hidden, *args, **kwargs)
            self._tuples = isinstance(out, tuple)
            states[j] = (out[0] if self._tuples else out, args, kwargs)

    def finish(self, calls: list[Callable[[], Any]], states: list[State]) -> list[Any]:
        """Each call of the model's forward again, its layers replaced by each state's final hidden states (the
        final norm and head in memory): what each call returns."""
        replay = _Replay(self.layers[0], self._tuples)
        self._swap_stack(nn.ModuleList([replay]))
        self._fill(self.shell, "", self._outer("out"), self.dtype)
        self._placeholder_embeddings()
        results = []
        for call, (hidden, _, _) in zip(calls, states):
            replay.value = hidden
            results.append(call())
        return results
