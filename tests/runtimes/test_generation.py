"""Generation: token-identical to Hugging Face generate, in-place cache, sampling, streaming, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln.runtimes as kr
from conftest import make_model
from kiln.cli import main
from kiln.errors import ArtifactError, InputError
from kiln.runtimes import sampling as S
from kiln.runtimes.base import CacheRunner

DECODERS = ["gpt2", "llama", "qwen2", "mistral"]
ROWS = [[5, 9, 17, 33, 2, 60, 7, 8, 99], [12, 3, 44, 5], [7, 7, 8, 120, 11, 31, 45, 6, 90, 101, 13, 14, 15, 16]]


def left_padded(rows, pad=0):
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_64_tokens_identical_to_hf_generate(artifacts, family):
    ids, mask = left_padded(ROWS)
    hf = make_model(family, "causal-lm")
    with torch.inference_mode():
        ref = hf.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=64,
                          do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    with kr.load(artifacts[family], threads=2) as model:
        got = model.generate(ROWS, max_new_tokens=64, stop_token_ids=[], pad_token_id=0)  # ragged lists
        again = model.generate(ids, mask, max_new_tokens=64, stop_token_ids=[], pad_token_id=0)  # padded arrays
    assert got.shape == (3, 14 + 64)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(again, ref)


def test_in_place_cache_is_bit_exact_with_a_growing_cache(artifacts):
    """The ORT runner binds one buffer as past and present; the plain runner copies a growing cache."""
    with kr.load(artifacts["llama"], threads=2) as model:
        kv = model.manifest.data["kv_cache"]
        ids, mask = left_padded(ROWS)
        shared, growing = model.runtime.cache_runner(kv, 3), CacheRunner(model.runtime, kv, 3)
        assert type(shared) is not CacheRunner
        a, b = shared.step(ids, mask), growing.step(ids, mask)
        for t in range(5):
            np.testing.assert_array_equal(a, b)
            nxt = a[:, -1].argmax(-1)[:, None]
            mask = np.concatenate([mask, np.ones((3, 1), np.int64)], 1)
            a, b = shared.step(nxt, mask), growing.step(nxt, mask)
        np.testing.assert_array_equal(a, b)
        assert growing.past["past_key_values.0.key"].shape[2] == 14 + 5
        assert np.asarray(shared.buffers["past_key_values.0.key"].numpy()).shape[2] == kv["capacity"]


@pytest.mark.parametrize("plant", [None, "one position for every row"])
def test_each_prompt_of_a_batch_decodes_as_it_does_alone(artifacts, monkeypatch, plant):
    """Each prompt runs in its own row of the cache (as continuous batching runs it), so its tokens are those it
    gets alone, whatever else is in the batch, in any order, padded any way (a pad-only column in front too). The
    planted bug, every row decoded at the longest row's position (a graph without per-row lengths), must fail here
    (loaded unchecked) and make the canary refuse the load."""
    if plant:
        from kiln.runtimes.onnxruntime import SlotCache

        decode = SlotCache.decode
        monkeypatch.setattr(SlotCache, "decode", lambda self, t, n: decode(self, t, np.full_like(n, n.max())))
        with pytest.raises(kr.CanaryError, match="decode_rows"):  # the canary runs these rows: load refuses
            kr.load(artifacts["llama"], threads=2)
    with kr.load(artifacts["llama"], threads=2, check=not plant) as model:
        alone = [model.generate([r], max_new_tokens=20, stop_token_ids=[])[0, len(r):].tolist() for r in ROWS]
        ids, mask = left_padded(ROWS[::-1] + [ROWS[1]])
        ids, mask = np.pad(ids, ((0, 0), (1, 0))), np.pad(mask, ((0, 0), (1, 0)))
        batch = model.generate(ids, mask, max_new_tokens=20, stop_token_ids=[])
    assert batch.shape == (4, 15 + 20) and (batch[:, :15] == ids).all()
    rows = batch[:, 15:].tolist()
    same = rows == alone[::-1] + [alone[1]]
    assert same != bool(plant)


def test_stop_token_pads_finished_rows(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        free = model.generate(ROWS, max_new_tokens=8, stop_token_ids=[], pad_token_id=0)
        stop = int(free[1, 14 + 2])  # the token row 1 produces third
        out = model.generate(ROWS, max_new_tokens=8, stop_token_ids=[stop], pad_token_id=0)
    row = out[1, 14:]
    first = int(np.flatnonzero(row == stop)[0])
    assert (row[first + 1:] == 0).all()
    np.testing.assert_array_equal(out[1, :14 + first + 1], free[1, :14 + first + 1])


def test_sampling_is_seeded(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        kw = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3, stop_token_ids=[])
        a, b = model.generate(ROWS, **kw), model.generate(ROWS, **kw)
        c = model.generate(ROWS, **{**kw, "seed": 4})
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_stream_yields_the_generated_text(artifacts):
    with kr.load(artifacts["llama"], threads=2) as model:
        chunks = list(model.stream("def fibonacci(n):", max_new_tokens=20, stop_token_ids=[]))
        feeds = model.encode(["def fibonacci(n):"])
        ids = model.generate(feeds["input_ids"], feeds["attention_mask"], max_new_tokens=20, stop_token_ids=[])
        expected = model.text_encoder.decode(ids[0, feeds["input_ids"].shape[1]:].tolist())
    assert len(chunks) > 1 and "".join(chunks) == expected


@pytest.mark.parametrize("call,message", [
    (lambda m: m.generate(ROWS, max_new_tokens=200), "exceeds the artifact's KV-cache capacity 128"),
    (lambda m: m.generate(np.array([[1, 2, 3]]), np.array([[1, 1, 0]])), "right-padded"),
    (lambda m: m.generate(np.array([[1, 2], [3, 4]]), np.array([[1, 1], [0, 0]])), "no real token"),
    (lambda m: m.generate([[1, 2], []]), "at least one token"),
    (lambda m: m.generate(ROWS, do_sample=True, temperature=0), "temperature 0 must be > 0"),
    (lambda m: m.generate(ROWS, do_sample=True, top_p=1.5), "top_p 1.5"),
    (lambda m: m.generate(ROWS, max_new_tokens=0), "at least 1"),
])
def test_generation_errors(artifacts, call, message):
    with kr.load(artifacts["llama"], threads=2) as model, pytest.raises(InputError, match=message):
        call(model)


def test_encoder_cannot_generate(artifacts):
    with kr.load(artifacts["bert"]) as model, pytest.raises(ArtifactError, match="cannot generate"):
        model.generate([[1, 2, 3]])


def test_cli_generate_streams_and_prints_ids(artifacts, capsys):
    assert main(["generate", str(artifacts["llama"]), "--prompt", "import os", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out  # the random model's tokens may decode to whitespace (a form feed): still text
    assert out.endswith("\n") and out.rstrip("\n")
    assert main(["generate", str(artifacts["llama"]), "--ids", "5,9,17", "--max-new-tokens", "4", "--stop-id", "-1"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 4
    assert main(["generate", str(artifacts["llama"]), "--ids", "5", "--max-new-tokens", "500"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln generate: error: prompt of 1 tokens") and "ask for at most 127 new tokens" in err


# --- sampling functions against direct computations ------------------------------------------
def test_repetition_penalty_matches_hf_rule():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]])
    out = S.repetition_penalty(logits, np.array([[0, 1, 1]]), 2.0)
    np.testing.assert_allclose(out, [[1.0, -2.0, 0.5, 3.0]])


def test_top_k_and_top_p():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert np.isfinite(S.top_k(logits, 2)).sum() == 2
    kept = np.isfinite(S.top_p(logits, 0.8))  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    np.testing.assert_array_equal(kept, [[True, True, True, False, False]])
    assert np.isfinite(S.top_p(logits, 0.1)).sum() == 1  # always at least the best token


def test_draws_follow_the_distribution():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.7, 0.2, 0.1]]))
    s = S.Sampling(do_sample=True)
    draws = np.array([S.choose(logits, np.zeros((1, 0), np.int64), s, rng)[0] for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, [0.7, 0.2, 0.1], atol=0.03)


class PositionalGraph:
    """A causal graph that numbers positions from the start of the sequence (as a forward that takes no
    position_ids does): logits[b, t, v] = sum over real s <= t of ids[b, s] * (s + 1) * (v + 1). A left-padded row
    gets other positions than it has alone; ``keep`` is the name of a logits_to_keep input (last k positions)."""

    def __init__(self, keep: str | None = None) -> None:
        self.keep = keep

    def run(self, feeds):
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        term = ids * (np.arange(ids.shape[1]) + 1) * mask
        logits = np.cumsum(term, 1)[:, :, None] * (np.arange(3) + 1)
        if self.keep:
            logits = logits[:, -int(feeds[self.keep]):]
        return {"logits": logits.astype(np.float32)}


@pytest.mark.parametrize("keep", [None, "logits_to_keep"])
def test_recompute_gives_a_left_padded_row_the_positions_it_has_alone(keep):
    from kiln.runtimes.base import RecomputeRunner

    rows = [[5, 6, 7, 8], [9, 10]]
    ids = np.array([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = (ids != 0).astype(np.int64)
    batch = RecomputeRunner(PositionalGraph(keep), 2, keep)
    got = [batch.step(ids, mask)[:, -1]]
    for token in (11, 12):  # two decode steps: the new tokens follow each row's own last token
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        got.append(batch.step(np.full((2, 1), token), mask)[:, -1])
    for i, row in enumerate(rows):
        alone = RecomputeRunner(PositionalGraph(keep), 1, keep)
        want = [alone.step(np.array([row]), np.ones((1, len(row)), np.int64))[0, -1]]
        for n, token in enumerate((11, 12), 1):
            want.append(alone.step(np.array([[token]]), np.ones((1, len(row) + n), np.int64))[0, -1])
        np.testing.assert_array_equal(np.stack([g[i] for g in got]), np.stack(want))
    if keep is None:  # every new position maps back to the caller's layout (pad columns are not compared)
        full = RecomputeRunner(PositionalGraph(), 2).step(ids, (ids != 0).astype(np.int64))
        np.testing.assert_array_equal(full[1, 2:], PositionalGraph().run(
            {"input_ids": np.array([[9, 10]]), "attention_mask": np.ones((1, 2), np.int64)})["logits"][0])
