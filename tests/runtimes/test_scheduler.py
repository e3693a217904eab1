"""Continuous batching (kiln.runtimes.scheduler): every request's tokens equal the same request served alone, with
joins and leaves mid-stream, a cancelled request, slot reuse, the queue's bound, and planted bugs that must fail."""

from __future__ import annotations

import numpy as np
import pytest

import kiln.runtimes as kr
from kiln.errors import ArtifactError, InputError
from kiln.runtimes.onnxruntime import SlotCache
from kiln.runtimes.scheduler import QueueFull, Scheduler

PROMPTS = [[5, 9, 17, 33, 2, 60, 7, 8, 99], [12, 3, 44, 5], [7, 7, 8, 120, 11, 31, 45, 6, 90, 101, 13, 14, 15, 16],
           [1], [100, 90, 80, 70, 60, 50], [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
NEW = [40, 24, 100, 17, 48, 29]  # the cancelled request (2) long enough that the cancel lands before it ends
WAIT = 120  # seconds a test waits for a token before it fails (a hang is a failure, not a stuck suite)


def alone(model, prompt, n, **kw):
    return model.generate([prompt], max_new_tokens=n, stop_token_ids=[], **kw)[0, len(prompt):].tolist()


def mixed(model, slots=3, cancel=2, **kw):
    """Two requests start; after 5 tokens of the first, the other four are submitted (two wait for a slot and join
    when earlier ones leave); request ``cancel`` is cancelled after its 3rd token. Returns the streams."""
    with Scheduler(model, slots=slots, queue_limit=8) as s:
        first = [s.submit(p, max_new_tokens=n, stop_token_ids=[], **kw) for p, n in zip(PROMPTS[:2], NEW[:2])]
        for f in first:
            f.timeout = WAIT
        it = iter(first[0])
        for _ in range(5):
            next(it)
        rest = [s.submit(p, max_new_tokens=n, stop_token_ids=[], **kw) for p, n in zip(PROMPTS[2:], NEW[2:])]
        streams = first + rest
        for r in rest:
            r.timeout = WAIT
        for _ in range(3):
            next(iter(streams[cancel]))
        streams[cancel].cancel()
        for _ in it:
            pass
        for r in streams[1:]:
            r.result()
        return streams, s.stats


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_with_joins_leaves_and_a_cancel_equals_each_request_alone(artifacts, family):
    with kr.load(artifacts[family], threads=2) as model:
        want = [alone(model, p, n) for p, n in zip(PROMPTS, NEW)]
        streams, stats = mixed(model)
    for i, (s, w) in enumerate(zip(streams, want)):
        if i == 2:
            assert s.finish_reason == "cancelled" and 3 <= len(s.tokens) < NEW[2] and s.tokens == w[:len(s.tokens)]
        else:
            assert s.finish_reason == "length" and s.tokens == w, f"request {i} differs from the request alone"
    assert max(stats.batch_sizes) == 3 and stats.tokens >= sum(NEW) - NEW[2]  # really batched, every slot busy
    assert {s.slot for s in streams} == {0, 1, 2}  # six requests through three slots: slots were reused


def test_seeded_sampling_is_reproducible_and_equals_the_request_alone(artifacts):
    kw = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1)
    with kr.load(artifacts["llama"], threads=2) as model:
        want = [alone(model, p, n, seed=7 + i, **kw) for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
        with Scheduler(model, slots=4) as s:
            got = [s.submit(p, max_new_tokens=n, stop_token_ids=[], seed=7 + i, **kw)
                   for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
            got = [g.result() for g in got]
    assert got == want


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_rows_batch_like_alone(tmp_path, checkpoints, precision):
    """MatMulNBits (8- and 4-bit) at batch > 1 (the decode step) against batch 1 (the request alone)."""
    from conftest import fast_options
    from kiln.compiler import compile

    art = compile(checkpoints["llama"], tmp_path / precision, fast_options(precision=precision))
    with kr.load(art, threads=2) as model:
        # a lone request decodes at one row where the canary showed one row computes as it does beside others here
        assert model.canary.rows_agree is not None
        assert Scheduler(model, slots=4).min_rows == (1 if model.canary.rows_agree else 2)
        want = [alone(model, p, n) for p, n in zip(PROMPTS, NEW)]
        streams, _ = mixed(model, slots=4, cancel=5)
        batch = model.generate(PROMPTS, max_new_tokens=max(NEW), stop_token_ids=[])  # Model.generate: a row each
    assert [s.tokens for s in streams[:5]] == want[:5]
    assert [batch[i, -max(NEW):][:n].tolist() for i, n in enumerate(NEW)] == want
    with kr.load(art, threads=2, check=False) as model:  # unchecked: a quantized artifact keeps two rows
        assert model.canary is None and Scheduler(model, slots=4).min_rows == 2
        assert [alone(model, p, n) for p, n in zip(PROMPTS[:2], NEW[:2])] == want[:2]


def test_stop_tokens_end_a_request_and_free_its_slot(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        free = alone(model, PROMPTS[0], 30)
        stop = free[6]
        want = free[:free.index(stop) + 1]
        with Scheduler(model, slots=1) as s:
            a = s.submit(PROMPTS[0], max_new_tokens=30, stop_token_ids=[stop])
            b = s.submit(PROMPTS[1], max_new_tokens=8, stop_token_ids=[])
            assert a.result() == want and a.finish_reason == "stop"
            assert b.result() == alone(model, PROMPTS[1], 8) and b.slot == 0  # the same slot, reused after a stop


def test_cancel_frees_the_slot_for_the_next_request(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        with Scheduler(model, slots=1, queue_limit=1) as s:
            a = s.submit(PROMPTS[0], max_new_tokens=100, stop_token_ids=[])
            a.timeout = WAIT
            next(iter(a))
            b = s.submit(PROMPTS[1], max_new_tokens=6, stop_token_ids=[])
            a.cancel()
            assert b.result() == alone(model, PROMPTS[1], 6) and b.slot == 0
            a.result()
            assert a.finish_reason == "cancelled" and len(a.tokens) < 100


def test_queue_bound_refuses_with_retry_after(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        with Scheduler(model, slots=1, queue_limit=1) as s:
            running = [s.submit(PROMPTS[0], max_new_tokens=60, stop_token_ids=[]) for _ in range(2)]
            with pytest.raises(QueueFull, match="queue's bound") as e:
                s.submit(PROMPTS[1], max_new_tokens=4)
            assert e.value.retry_after >= 1
            for r in running:
                r.cancel()
            assert [r.result() is not None for r in running] == [True, True]
            assert s.submit(PROMPTS[1], max_new_tokens=4, stop_token_ids=[]).result() == alone(model, PROMPTS[1], 4)


def test_requests_that_cannot_run_fail_before_queueing(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        with Scheduler(model, slots=2, positions=32) as s:
            with pytest.raises(InputError, match="more KV positions than a slot holds"):
                s.submit(PROMPTS[2], max_new_tokens=20)
            with pytest.raises(InputError, match="outside the vocabulary"):
                s.submit([5, 100000], max_new_tokens=2)
            with pytest.raises(InputError, match="max_new_tokens 0"):
                s.submit([5], max_new_tokens=0)
    with kr.load(artifacts["gpt2"], threads=2) as model:  # learned positions: each row cannot have its own
        with pytest.raises(ArtifactError, match="learned position embeddings"):
            Scheduler(model)
    with kr.load(artifacts["bert"], threads=2) as model:
        with pytest.raises(ArtifactError, match="decoder-only causal-lm"):
            Scheduler(model)


@pytest.mark.parametrize("plant", ["shared slot", "one position for every row"])
def test_a_planted_bug_fails_the_identical_to_alone_check(artifacts, monkeypatch, plant):
    """The checks above bite: a prefill written into another row's slot, or every row decoded at the longest row's
    position (what a graph without per-row lengths does), changes the tokens."""
    if plant == "shared slot":
        prefill = SlotCache.prefill
        monkeypatch.setattr(SlotCache, "prefill", lambda self, slot, ids: prefill(self, 0, ids))
    else:
        decode = SlotCache.decode
        monkeypatch.setattr(SlotCache, "decode", lambda self, t, n: decode(self, t, np.full_like(n, n.max())))
    with kr.load(artifacts["llama"], threads=2, check=False) as model:  # the canary would refuse it (decode_rows)
        want = [alone(model, p, n) for p, n in zip(PROMPTS, NEW)]
        streams, _ = mixed(model)
    assert [s.tokens for i, s in enumerate(streams) if i != 2] != [w for i, w in enumerate(want) if i != 2]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_requests_joining_together_share_one_prefill_and_equal_each_alone(tmp_path, checkpoints, artifacts, precision):
    """Six requests queued at once join in one step: prompts of 9, 4 and 14 tokens prefill together (right-padded,
    each row's first token read at its own last position), the one-token prompt alone (its M = 1 prefill), the last
    two together; every request's tokens equal the request alone. INT4 joins only prompts of one length by default
    (cheaper there); mixed lengths are switched on to check MatMulNBits rows too."""
    if precision == "fp32":
        art = artifacts["llama"]
    else:
        from conftest import fast_options
        from kiln.compiler import compile

        art = compile(checkpoints["llama"], tmp_path / precision, fast_options(precision=precision))
    with kr.load(art, threads=2) as model:
        want = [alone(model, p, n) for p, n in zip(PROMPTS, NEW)]
        with Scheduler(model, slots=6) as s:
            assert s.join_mixed == (precision == "fp32")
            s.join_mixed = True
            with s._lock:  # the loop waits for the lock: all six are queued when it looks
                streams = [s.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in zip(PROMPTS, NEW)]
            got = [st.result() for st in streams]
            rows = list(s.stats.prefill_rows)
    assert rows == [3, 1, 2] and [st.slot for st in streams] == [0, 1, 2, 3, 4, 5]
    assert got == want


def test_a_joined_prefill_that_attends_to_its_padding_fails(artifacts, monkeypatch):
    """The planted bug: shorter prompts padded to the longest with the padding masked in (a mask of ones), so their
    rows attend to it and their first token is read at the padded end."""
    prefill = SlotCache.prefill

    def padded_end(self, lo, prompts):
        width = max(len(p) for p in prompts)
        return prefill(self, lo, [np.concatenate([p, np.zeros(width - len(p), np.int64)]) for p in prompts])

    monkeypatch.setattr(SlotCache, "prefill", padded_end)
    with kr.load(artifacts["llama"], threads=2, check=False) as model:  # the canary would refuse it (decode_rows)
        want = [alone(model, p, n) for p, n in zip(PROMPTS[:3], NEW[:3])]
        with Scheduler(model, slots=3) as s:
            with s._lock:
                streams = [s.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in zip(PROMPTS[:3], NEW[:3])]
            got = [st.result() for st in streams]
    assert got[2] == want[2] and got[:2] != want[:2]  # the longest row is unaffected, the padded ones differ
