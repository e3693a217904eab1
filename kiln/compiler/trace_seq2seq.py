"""Encoder-decoder checkpoints (T5, BART) -> an encoder graph and a cached decoder graph.

- ``encoder.onnx``: (input_ids, attention_mask) -> every decoder layer's cross-attention keys and
  values, ``cross.{i}.key/value`` (batch, heads, source length, head size). They are obtained
  generically: one decoder step over the start token fills Hugging Face's cross-attention cache,
  whatever the family computes in between. A request runs this graph once.
- ``decoder.onnx``: (decoder_input_ids, encoder_attention_mask, past self-attention keys/values,
  cross keys/values) -> logits and the present self-attention keys/values. The wrapper rebuilds
  Hugging Face's ``EncoderDecoderCache`` from the inputs, so the decoder is the model's own code.
  A decoder whose cache takes one new token at a time (ProphetNet asserts it) is traced at one token
  per step (``step_width``): generation feeds one token per step anyway, and the graph's contract says so.

Verification (``kiln.compiler.verify.generation.verify_seq2seq``) is greedy decoding through both
graphs against Hugging Face ``generate``.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from kiln.compiler import capture
from kiln.compiler.load import Checkpoint
from kiln.compiler.manifest import kv_names
from kiln.compiler.scoped import logger_level
from kiln.errors import ExportError, UnsupportedModelError
from kiln.runtimes.artifact import TensorSpec

ENCODER, DECODER = "encoder.onnx", "decoder.onnx"


def shapes(ckpt: Checkpoint) -> dict[str, int]:
    """Layer, head and width counts of an encoder-decoder, from whichever of the usual config names it uses."""
    cfg = ckpt.config

    def first(*keys: str) -> int | None:
        return next((int(getattr(cfg, k)) for k in keys if isinstance(getattr(cfg, k, None), int)), None)

    general = ("num_layers", "num_hidden_layers")
    found = {"layers": first("num_decoder_layers", "decoder_layers", *general),
             "encoder_layers": first("encoder_layers", "num_encoder_layers", *general),
             "heads": first("decoder_attention_heads", "num_decoder_attention_heads", "num_heads", "num_attention_heads"),
             "hidden": first("d_model", "hidden_size")}
    missing = [k for k, v in found.items() if not v]
    if missing:
        raise UnsupportedModelError(f"checkpoint {ckpt.path} ({ckpt.model_type}) names its {', '.join(missing)} in a "
                                    "way kiln does not read (decoder_layers / num_layers, decoder_attention_heads / "
                                    "num_heads, d_model / hidden_size)")
    out: dict[str, int] = {k: int(v) for k, v in found.items() if v}
    out["head_size"] = first("d_kv", "head_dim") or out["hidden"] // out["heads"]
    return out


def _cache(layers: int, kv: tuple[torch.Tensor, ...] = ()):
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    self_c, cross_c = DynamicCache(), DynamicCache()
    for i in range(len(kv) // 4):
        self_c.update(kv[4 * i], kv[4 * i + 1], i)
        cross_c.update(kv[4 * i + 2], kv[4 * i + 3], i)
    cache = EncoderDecoderCache(self_c, cross_c)
    for i in range(len(kv) // 4):
        cache.is_updated[i] = True  # cross keys/values are given: never recompute them
    return cache


def _output_type(model: nn.Module) -> type:
    """The class the model's encoder returns (families read fields off it: ``last_hidden_state``, router logits)."""
    with torch.no_grad():
        ids = torch.ones((1, 2), dtype=torch.long)
        return type(model.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True))


class EncoderGraph(nn.Module):
    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__()
        self.model = ckpt.model
        self.layers = shapes(ckpt)["layers"]

    def forward(self, input_ids, attention_mask):
        encoded = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        start = torch.full((input_ids.shape[0], 1), self.model.config.decoder_start_token_id, dtype=torch.long)
        cache = _cache(self.layers)
        self.model(encoder_outputs=encoded, attention_mask=attention_mask, decoder_input_ids=start,
                   past_key_values=cache, use_cache=True)
        cross = cache.cross_attention_cache.layers
        return tuple(t for i in range(self.layers) for t in (cross[i].keys, cross[i].values))


class DecoderGraph(nn.Module):
    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__()
        self.model = ckpt.model
        self.layers = shapes(ckpt)["layers"]
        self.hidden = shapes(ckpt)["hidden"]
        self.encoded = _output_type(ckpt.model)

    def forward(self, decoder_input_ids, encoder_attention_mask, *kv):
        cache = _cache(self.layers, kv)
        # cross-attention reads the cached keys/values; the encoder states are only a shape placeholder
        dummy = torch.zeros(encoder_attention_mask.shape[0], encoder_attention_mask.shape[1], self.hidden)
        out = self.model(encoder_outputs=self.encoded(last_hidden_state=dummy), attention_mask=encoder_attention_mask,
                         decoder_input_ids=decoder_input_ids, past_key_values=cache, use_cache=True)
        own = cache.self_attention_cache.layers
        return (out.logits, *(t for i in range(self.layers) for t in (own[i].keys, own[i].values)))


names = kv_names


def io(ckpt: Checkpoint, width: int | None = None) -> dict[str, dict[str, list[TensorSpec]]]:
    """Both graphs' contracts; ``width``: the decoder's new tokens per step when the trace fixed them (1)."""
    s = shapes(ckpt)
    step: str | int = "sequence" if width is None else width
    n = names(s["layers"])
    cross = ("batch", s["heads"], "source", s["head_size"])
    past = ("batch", s["heads"], "past_sequence", s["head_size"])
    present = ("batch", s["heads"], "present_sequence", s["head_size"])
    vocab = ckpt.vocab_size
    return {
        "encoder": {"inputs": [TensorSpec("input_ids", "int64", ("batch", "source")),
                               TensorSpec("attention_mask", "int64", ("batch", "source"), True, "ones")],
                    "outputs": [TensorSpec(c, "float32", cross) for c in n["cross"]]},
        "decoder": {"inputs": [TensorSpec("decoder_input_ids", "int64", ("batch", step)),
                               TensorSpec("encoder_attention_mask", "int64", ("batch", "source"))]
                    + [t for i in range(s["layers"]) for t in (
                        TensorSpec(n["past"][2 * i], "float32", past, True, "empty"),
                        TensorSpec(n["past"][2 * i + 1], "float32", past, True, "empty"),
                        TensorSpec(n["cross"][2 * i], "float32", cross), TensorSpec(n["cross"][2 * i + 1], "float32", cross))],
                    "outputs": [TensorSpec("logits", "float32", ("batch", step, vocab))]
                    + [TensorSpec(p, "float32", present) for p in n["present"]]},
    }


def step_width(decoder: nn.Module, ids: torch.Tensor, mask: torch.Tensor, kv: list[torch.Tensor]) -> int | None:
    """None when the cached decoder takes several new tokens at once (the graph's ``sequence`` axis stays free);
    1 when it refuses two but runs one, as a decoder whose cache only steps token by token does; the error of two
    when it runs neither (the export would fail on it too)."""
    try:
        decoder(ids[:, :2], mask, *kv)
        return None
    except Exception as two:  # the family's own check, of any type
        try:
            decoder(ids[:, :1], mask, *kv)
        except Exception:
            raise two from None
        return 1


def export(ckpt: Checkpoint, root: Path, opset: int) -> tuple[dict[str, capture.Log], int | None]:
    """Trace both graphs, attention captured; returns what the capture saw in each and the decoder's fixed step
    width (``step_width``; None: any number of new tokens)."""
    s = shapes(ckpt)
    spec = io(ckpt)
    batch = torch.export.Dim("batch", min=1, max=1024)
    source = torch.export.Dim("source", min=1, max=max(ckpt.max_length, 9))
    seq = torch.export.Dim("sequence", min=1, max=max(ckpt.max_length, 9))
    past = torch.export.Dim("past_sequence", min=0, max=max(ckpt.max_length, 9))
    ids = torch.randint(3, 50, (2, 8))
    mask = torch.ones_like(ids)
    enc = EncoderGraph(ckpt).eval()
    try:
        with warnings.catch_warnings(), torch.no_grad(), logger_level("torch.onnx", logging.ERROR):
            warnings.simplefilter("ignore")
            cross = enc(ids, mask)
            program, log = capture.export(
                enc, (ids, mask), dynamic_shapes={"input_ids": {0: batch, 1: source}, "attention_mask": {0: batch, 1: source}},
                input_names=[t.name for t in spec["encoder"]["inputs"]], output_names=[t.name for t in spec["encoder"]["outputs"]],
                source=f"{ckpt.path} ({ckpt.architecture})", opset_version=opset, optimize=True, verbose=False)
            program.save(str(root / ENCODER))
            kv: list[torch.Tensor] = []
            for i in range(s["layers"]):
                own = torch.randn(2, s["heads"], 3, s["head_size"])
                kv += [own, own.clone(), cross[2 * i], cross[2 * i + 1]]
            kv_dims = tuple({0: batch, 2: past} if j % 4 < 2 else {0: batch, 2: source} for j in range(len(kv)))
            decoder = DecoderGraph(ckpt).eval()
            width = step_width(decoder, ids, mask, kv)
            spec = io(ckpt, width)
            program, decoder_log = capture.export(
                decoder, (ids[:, :width or 2], mask, *kv),
                dynamic_shapes={"decoder_input_ids": {0: batch, 1: seq if width is None else torch.export.Dim.STATIC},
                                "encoder_attention_mask": {0: batch, 1: source}, "kv": kv_dims},
                input_names=[t.name for t in spec["decoder"]["inputs"]], output_names=[t.name for t in spec["decoder"]["outputs"]],
                source=f"{ckpt.path} ({ckpt.architecture})", opset_version=opset, optimize=True, verbose=False)
            program.save(str(root / DECODER))
    except UnsupportedModelError:
        raise
    except Exception as e:  # the exporter raises many unrelated types; keep the first line for the user
        first = capture.failure(e)
        raise ExportError(f"torch.onnx.export failed for {ckpt.path} ({ckpt.architecture}): {first}; "
                          "report it with the checkpoint's config.json") from e
    return {ENCODER: log, DECODER: decoder_log}, width
