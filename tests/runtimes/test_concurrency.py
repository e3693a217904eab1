"""One loaded Model under many threads: 8 threads x 50 mixed run/generate/stream calls give exactly the serial
results, RSS stays flat, KV buffers are sized to the request and pooled, and close() during use is kiln's own
error."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kiln.runtimes as kr
from kiln.errors import ClosedError
from kiln.runtimes.onnxruntime import BUCKET_MIN, bucket

THREADS, CALLS = 8, 50


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def calls(seed: int = 0) -> list[tuple[str, object]]:
    """A fixed mix: runs of several shapes, greedy and seeded-sampling generates of several lengths, streams."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(THREADS * CALLS):
        kind = ("run", "generate", "sample", "stream")[i % 4]
        n = int(rng.integers(1, 20))
        ids = rng.integers(1, 120, size=(int(rng.integers(1, 4)), n)).tolist()
        out.append((kind, (ids, int(rng.integers(1, 24)), i)))
    return out


def call(model: kr.Model, kind: str, args) -> object:
    ids, new, i = args
    if kind == "run":
        arr = np.asarray(ids, np.int64)
        return model.run({"input_ids": arr, "attention_mask": np.ones_like(arr)})["logits"]
    if kind == "generate":
        return model.generate(ids, max_new_tokens=new, stop_token_ids=[], pad_token_id=0)
    if kind == "sample":
        return model.generate(ids, max_new_tokens=new, do_sample=True, top_k=20, seed=i, stop_token_ids=[],
                              pad_token_id=0)
    return "".join(model.stream("the cat sat on the mat " * (1 + i % 3), max_new_tokens=new))


def same(a, b) -> bool:
    return a == b if isinstance(a, str) else np.array_equal(a, b)


def test_many_threads_give_the_serial_results_with_flat_memory(artifacts):
    work = calls()
    with kr.load(artifacts["llama"], threads=1) as model:
        serial = [call(model, k, a) for k, a in work]
        with ThreadPoolExecutor(THREADS) as pool:
            first = list(pool.map(lambda w: call(model, *w), work))
            before = rss_mb()
            second = list(pool.map(lambda w: call(model, *w), work))
            grown = rss_mb() - before
        idle = len(model.runtime.pool._idle)
    wrong = [i for i, (a, b, c) in enumerate(zip(serial, first, second)) if not (same(a, b) and same(a, c))]
    assert not wrong, f"{len(wrong)} of {len(work)} concurrent calls differ from serial, first {work[wrong[0]]}"
    assert grown < 25, f"RSS grew {grown:.1f} MB over {len(work)} repeated concurrent calls"
    assert idle <= model.runtime.pool.keep


def test_kv_buffers_are_sized_to_the_request_and_reused(artifacts):
    with kr.load(artifacts["llama"], threads=1) as model:
        kv = model.manifest.data["kv_cache"]
        cap = int(kv["capacity"])
        assert bucket(5, cap) == min(BUCKET_MIN, cap) and bucket(BUCKET_MIN + 1, 10 ** 6) == 2 * BUCKET_MIN
        assert bucket(10 ** 6, cap) == cap
        model.generate([[5, 6, 7]], max_new_tokens=4, stop_token_ids=[])
        (key, buffers), = model.runtime.pool._idle
        assert key == (1, min(BUCKET_MIN, cap)) and buffers["past_key_values.0.key"].shape[2] == min(BUCKET_MIN, cap)
        kept = buffers["past_key_values.0.key"]
        model.generate([[9, 8]], max_new_tokens=9, stop_token_ids=[])  # same bucket: the same memory again
        assert model.runtime.pool._idle[0][1]["past_key_values.0.key"] is kept


def test_close_during_use_raises_kilns_error(artifacts):
    model = kr.load(artifacts["llama"], threads=1)
    started, errors = threading.Event(), []

    def streaming():
        try:
            for _ in model.stream("the cat sat on the mat", max_new_tokens=60):
                started.set()
                threading.Event().wait(0.01)
        except Exception as e:  # noqa: BLE001 - what the caller sees is the point
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=streaming)
    t.start()
    started.wait(10)
    model.close()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ClosedError), errors
    assert "was closed" in str(errors[0]) and "load the artifact again" in str(errors[0])
    with pytest.raises(ClosedError):
        model.run({"input_ids": np.ones((1, 3), np.int64)})
    with pytest.raises(ClosedError):
        model.generate([[1, 2]], max_new_tokens=2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_request_sized_buffers_generate_what_hugging_face_does(artifacts, family):
    """A 64-position buffer (half the tiny models' 128 capacity) through the whole generation: token for token
    Hugging Face's greedy output, and the same as a whole-capacity buffer."""
    import torch
    from conftest import make_model

    rows = [[5, 9, 17, 33, 2, 60, 7, 8, 99], [12, 3, 44, 5]]
    width = max(map(len, rows))
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    with torch.inference_mode():
        ref = make_model(family, "causal-lm").generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                                                       max_new_tokens=40, do_sample=False, eos_token_id=None,
                                                       pad_token_id=0).numpy()
    with kr.load(artifacts[family], threads=1) as model:
        assert bucket(width + 40, int(model.manifest.data["kv_cache"]["capacity"])) == 64
        got = model.generate(rows, max_new_tokens=40, stop_token_ids=[], pad_token_id=0)
        assert model.runtime.pool._idle[0][1]["past_key_values.0.key"].shape[2] == 64
    np.testing.assert_array_equal(got, ref)
