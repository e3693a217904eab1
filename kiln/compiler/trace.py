"""Eager model -> ONNX with ``torch.onnx.export(dynamo=True)`` and dynamic batch/sequence axes.

The traced module is a thin wrapper that fixes the artifact's input/output contract
(names, position ids from the mask, sentence pooling). The verifier runs the same wrapper
eagerly, so "eager" and "artifact" mean the same computation.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from kiln.compiler import capture
from kiln.compiler.load import Checkpoint
from kiln.compiler.scoped import logger_level
from kiln.errors import ExportError, UnsupportedModelError
from kiln.runtimes.artifact import TensorSpec

log = logging.getLogger(__name__)


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """sentence-transformers pooling: hidden (B, T, H), mask (B, T) -> (B, H)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if mode == "mean":
        out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    elif mode == "max":
        out = hidden.masked_fill(m == 0, -1e9).max(1).values
    else:  # cls
        out = hidden[:, 0]
    if normalize:
        out = out / out.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return out


class EncoderGraph(nn.Module):
    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__()
        self.model = ckpt.model
        self.task = ckpt.task
        self.pooling = ckpt.pooling
        self.token_types = ckpt.family.token_type_ids

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {"token_type_ids": token_type_ids} if self.token_types else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if self.task != "feature-extraction":
            return (out.logits,)
        hidden = out.last_hidden_state
        if self.pooling:
            return hidden, pool(hidden, attention_mask, self.pooling["mode"], self.pooling["normalize"])
        return (hidden,)


class DecoderGraph(nn.Module):
    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__()
        self.model = ckpt.model
        self.task = ckpt.task

    def forward(self, input_ids, attention_mask):
        # Positions count real tokens only, so left-padded rows see the same positions as unpadded ones.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return (out.logits,) if self.task == "causal-lm" else (out.last_hidden_state,)


def graph_module(ckpt: Checkpoint) -> nn.Module:
    return (EncoderGraph if ckpt.kind == "encoder" else DecoderGraph)(ckpt).eval()


def io_specs(ckpt: Checkpoint) -> tuple[list[TensorSpec], list[TensorSpec]]:
    seq = ("batch", "sequence")
    inputs = [TensorSpec("input_ids", "int64", seq), TensorSpec("attention_mask", "int64", seq, True, "ones")]
    if ckpt.kind == "encoder" and ckpt.family.token_type_ids:
        inputs.append(TensorSpec("token_type_ids", "int64", seq, True, "zeros"))
    cfg = ckpt.config
    if ckpt.task == "causal-lm":
        outputs = [TensorSpec("logits", "float32", (*seq, ckpt.vocab_size))]
    elif ckpt.task == "token-classification":
        outputs = [TensorSpec("logits", "float32", (*seq, int(cfg.num_labels)))]
    elif ckpt.task == "sequence-classification":
        outputs = [TensorSpec("logits", "float32", ("batch", int(cfg.num_labels)))]
    else:
        hidden = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "dim", None) or cfg.n_embd)
        outputs = [TensorSpec("last_hidden_state", "float32", (*seq, hidden))]
        if ckpt.pooling:
            outputs.append(TensorSpec("sentence_embedding", "float32", ("batch", hidden)))
    return inputs, outputs


def export(ckpt: Checkpoint, path: Path, opset: int, external_data_threshold: int) -> capture.Log:
    """Trace to ``path`` (weights over ``external_data_threshold`` bytes beside it, in ``path.data``), attention
    captured (``kiln.compiler.capture``); returns what the capture saw."""
    module = graph_module(ckpt)
    inputs, outputs = io_specs(ckpt)
    example = tuple(torch.randint(0, 2, (2, 8), dtype=torch.long) for _ in inputs)
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("sequence", min=1, max=max(ckpt.max_length, 9))
    dynamic = {s.name: {0: batch, 1: seq} for s in inputs}
    try:
        # The exporter logs every op registration it skips (torchvision absent, ...): not the user's concern.
        with warnings.catch_warnings(), torch.no_grad(), logger_level("torch.onnx", logging.ERROR):
            warnings.simplefilter("ignore")
            program, log = capture.export(
                module, example, dynamic_shapes=dynamic, input_names=[s.name for s in inputs],
                output_names=[s.name for s in outputs], source=f"{ckpt.path} ({ckpt.architecture})",
                opset_version=opset, optimize=True, verbose=False,
            )
    except UnsupportedModelError:
        raise
    except Exception as e:  # the exporter raises many unrelated types; keep the first line for the user
        first = capture.failure(e)
        raise ExportError(
            f"torch.onnx.export failed for {ckpt.path} ({ckpt.architecture}): {first}; "
            "report it with the checkpoint's config.json"
        ) from e
    weight_bytes = sum(p.numel() * p.element_size() for p in ckpt.model.parameters())
    external = weight_bytes > external_data_threshold
    program.save(str(path), external_data=external)
    return log


class EagerRunner:
    """The reference side of verification: the same wrapper, run by PyTorch (threads: the caller's
    ``scoped.torch_threads``)."""

    def __init__(self, ckpt: Checkpoint, device: str = "cpu") -> None:
        """``device``: where PyTorch runs it ("cuda" for the GPU check); feeds go there and outputs come back."""
        self.module = graph_module(ckpt).to(device)
        self.device = device
        inputs, outputs = io_specs(ckpt)
        self.input_names = [s.name for s in inputs]
        self.output_names = [s.name for s in outputs]
        self.fp64 = False

    @classmethod
    def exact(cls, ckpt: Checkpoint) -> EagerRunner:
        """The same model in float64 (a copy): the exact answer FP32 rounding is measured against."""
        import copy
        import dataclasses

        runner = cls(dataclasses.replace(ckpt, model=copy.deepcopy(ckpt.model).double()))
        runner.fp64 = True
        return runner

    def run(self, feeds):
        args = [torch.from_numpy(feeds[n]).to(self.device) for n in self.input_names if n in feeds]
        with torch.inference_mode():
            outs = self.module(*args)
        return {n: (o.double() if self.fp64 else o.float()).cpu().numpy() for n, o in zip(self.output_names, outs)}
