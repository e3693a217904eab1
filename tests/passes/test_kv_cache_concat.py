"""kv-cache-concat: the TensorRT decoder graph's KV cache in standard ops. A prefill plus decode steps through the
cache give the full-sequence graph's logits (Llama's rotary positions, GPT-2's learned ones, a left-padded row);
a graph it must refuse is left byte for byte as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import fast_options
from kiln.compiler import compile
from kiln.passes import run_passes
from kiln.passes.kv_cache_concat import AddKVCacheConcat

SHAPES = {"llama": (2, 16), "gpt2": (4, 16)}  # (kv heads, head size) of the tiny test models


@pytest.fixture(scope="module")
def uncached(checkpoints, tmp_path_factory):
    """The TensorRT graphs of the tiny decoders without the pass (the input it gets in the recipe, minus itself)."""
    root = tmp_path_factory.mktemp("uncached")
    return {f: onnx.load(str(compile(checkpoints[f], root / f, fast_options(
        target="tensorrt", disabled_passes=("kv-cache-concat",))) / "model.onnx")) for f in SHAPES}


def session(model: onnx.ModelProto, tmp_path, name: str) -> ort.InferenceSession:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_prefill_then_steps_through_the_cache_match_the_full_sequence(uncached, family, tmp_path):
    kv_heads, head_size = SHAPES[family]
    cached, record = run_passes(uncached[family], [AddKVCacheConcat(kv_heads, head_size)])
    assert record[0]["stats"] == {"layers": 2, "repointed_shapes": 2, "sliced_positions": 1}
    full = session(uncached[family], tmp_path, "full")
    step = session(cached, tmp_path, "cached")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 100, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, :3] = 0  # a left-padded row
    want = full.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
    names = [o.name for o in step.get_outputs()]
    past = {i.name: np.zeros((2, kv_heads, 0, head_size), np.float32) for i in step.get_inputs()
            if i.name.startswith("past_key_values")}
    got, start = [], 0
    for end in (7, 8, 9, 12):  # a prefill of 7, two single steps, one of 3
        out = dict(zip(names, step.run(None, {"input_ids": ids[:, start:end], "attention_mask": mask[:, :end], **past})))
        got.append(out["logits"])
        past = {n.replace("present", "past_key_values"): v for n, v in out.items() if n.startswith("present")}
        start = end
    real = mask.astype(bool)
    np.testing.assert_allclose(np.concatenate(got, 1)[real], want[real], atol=1e-5)
    assert past["past_key_values.0.key"].shape == (2, kv_heads, 12, head_size)


def test_refused_graphs_are_left_exactly_as_they_were(uncached):
    model = uncached["llama"]
    causal = onnx.ModelProto()
    causal.CopyFrom(model)
    node = next(n for n in causal.graph.node if n.op_type == "Attention")
    next(a for a in node.attribute if a.name == "is_causal").i = 1
    before = causal.SerializeToString()
    out, record = run_passes(causal, [AddKVCacheConcat(*SHAPES["llama"])])
    assert record[0]["modified"] is False and "is_causal" in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == before
    two_masks = onnx.ModelProto()
    two_masks.CopyFrom(model)
    attention = [n for n in two_masks.graph.node if n.op_type == "Attention"]
    attention[1].input[3] = "attention_mask"
    out, record = run_passes(two_masks, [AddKVCacheConcat(*SHAPES["llama"])])
    assert record[0]["modified"] is False and "do not share one attention mask" in record[0]["skipped"][0]["why"]
    cached, _ = run_passes(model, [AddKVCacheConcat(*SHAPES["llama"])])
    again, record = run_passes(cached, [AddKVCacheConcat(*SHAPES["llama"])])
    assert record[0]["modified"] is False and again.SerializeToString() == cached.SerializeToString()
