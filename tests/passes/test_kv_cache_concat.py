"""kv-cache-concat: the cache as Concats on the captured attention nodes (the TensorRT graph's, and any decoder no
fused kernel took). After ``lower-attention``, a prefill plus decode steps through the cache give the full-sequence
graph's logits (Llama's rotary positions, GPT-2's learned ones, a sliding window, a left-padded row); a graph it must
refuse is left byte for byte as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import decoder_attention_graph

from kiln.compiler import trace
from kiln.compiler.load import load_checkpoint
from kiln.passes import run_passes
from kiln.passes.cleanup import EliminateIdentity, EliminateUnusedIO, FoldConstants
from kiln.passes.kv_cache_concat import AddKVCacheConcat
from kiln.passes.lower_attention import LowerAttention

SHAPES = {"llama": (2, 16), "gpt2": (4, 16)}  # (kv heads, head size) of the tiny test models


@pytest.fixture(scope="module")
def traced(checkpoints, tmp_path_factory):
    """The tiny decoders as kiln traces them, attention captured (what the pass gets in a recipe)."""
    root = tmp_path_factory.mktemp("traced")
    out = {}
    for family in SHAPES:
        path = root / f"{family}.onnx"
        trace.export(load_checkpoint(checkpoints[family]), path, 23, 1 << 30)
        out[family] = run_passes(onnx.load(str(path)), [EliminateIdentity(), FoldConstants(), EliminateUnusedIO()])[0]
    return out


def session(model: onnx.ModelProto, tmp_path, name: str) -> ort.InferenceSession:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def stepped(model, tmp_path, ids, mask, inputs, kv_heads, head_size, ends=(7, 8, 9, 12)):
    """Run ``model`` (cached) over ``ends`` chunks: a prefill, single steps, a chunk of several."""
    step = session(model, tmp_path, "cached")
    names = [o.name for o in step.get_outputs()]
    past = {i.name: np.zeros((ids.shape[0], kv_heads, 0, head_size), np.float32) for i in step.get_inputs()
            if i.name.startswith("past_key_values")}
    got, start = [], 0
    for end in ends:
        feeds = {"input_ids": ids[:, start:end], "attention_mask": mask[:, :end], **past, **inputs(start, end)}
        out = dict(zip(names, step.run(None, feeds)))
        got.append(out[names[0]])
        past = {n.replace("present", "past_key_values"): v for n, v in out.items() if n.startswith("present")}
        start = end
    return np.concatenate(got, 1), past


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_prefill_then_steps_through_the_cache_match_the_full_sequence(traced, family, tmp_path):
    kv_heads, head_size = SHAPES[family]
    cached, record = run_passes(traced[family], [AddKVCacheConcat(kv_heads, head_size), LowerAttention()])
    assert record[0]["stats"]["layers"] == 2 and record[0]["stats"]["sliced_positions"] == 1
    full = session(run_passes(traced[family], [LowerAttention()])[0], tmp_path, "full")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 100, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, :3] = 0  # a left-padded row
    want = full.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
    got, past = stepped(cached, tmp_path, ids, mask, lambda a, b: {}, kv_heads, head_size)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)
    assert past["past_key_values.0.key"].shape == (2, kv_heads, 12, head_size)


@pytest.mark.parametrize("window", [0, 3])
def test_the_cache_mask_keeps_the_window(window, tmp_path):
    """A sliding window (found by running the traced mask) is applied over past and new keys alike."""
    model = decoder_attention_graph(2, 1, window=window)
    cached, record = run_passes(model, [AddKVCacheConcat(1, 16), LowerAttention()])
    assert record[0]["modified"] is True
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    ids = np.zeros((2, 12), np.int64)
    mask = np.ones((2, 12), np.int64)
    mask[1, :3] = 0
    want = session(run_passes(model, [LowerAttention()])[0], tmp_path, "full").run(
        ["y"], {"x": x, "attention_mask": mask, "input_ids": ids})[0]
    got, _ = stepped(cached, tmp_path, ids, mask, lambda a, b: {"x": x[:, a:b]}, 1, 16)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)


@pytest.mark.parametrize("kwargs,why", [(dict(prefix=2), "custom mask"), (dict(causal=False), "a cache needs causal")])
def test_refused_graphs_are_left_exactly_as_they_were(kwargs, why):
    model = decoder_attention_graph(2, 1, **kwargs)
    out, record = run_passes(model, [AddKVCacheConcat(1, 16)])
    assert record[0]["modified"] is False and why in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()


def test_second_run_changes_nothing(traced):
    cached, _ = run_passes(traced["llama"], [AddKVCacheConcat(*SHAPES["llama"])])
    again, record = run_passes(cached, [AddKVCacheConcat(*SHAPES["llama"])])
    assert record[0]["modified"] is False and "already has a KV cache" in record[0]["skipped"][0]["why"]
    assert again.SerializeToString() == cached.SerializeToString()
