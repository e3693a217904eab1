"""Property-based fuzzing (hypothesis) of what users hand kiln: manifests, feeds, generate arguments, gate configs.
The only outcomes allowed are a result or kiln's own one-line error (a KilnError), never another exception.
Each property runs twice: 60 pinned examples (the same every run, ``derandomize``) and 30 drawn from a fresh seed
each run (``<name>_fresh_seed``), printed in pytest's header; ``KILN_FUZZ_SEED=N make test`` replays a run.
Bounded: a fixed example count per property, no deadline (the suite stays under a minute here)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from conftest import FUZZ_SEED  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kiln.runtimes as kr  # noqa: E402
from kiln.errors import KilnError  # noqa: E402

_QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
PINNED = settings(max_examples=60, deadline=None, suppress_health_check=_QUIET, derandomize=True, database=None)
FRESH = settings(max_examples=30, deadline=None, suppress_health_check=_QUIET, database=None)


def fuzz(**strategies):
    """The property over the pinned examples, plus a twin ``<name>_fresh_seed`` over ``FUZZ_SEED``'s examples."""
    def register(fn):
        fresh = seed(FUZZ_SEED)(FRESH(given(**strategies)(fn)))
        fresh.__name__ = fresh.__qualname__ = fn.__name__ + "_fresh_seed"
        setattr(sys.modules[fn.__module__], fresh.__name__, fresh)
        return PINNED(given(**strategies)(fn))
    return register

json_values = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 12, 10 ** 12) | st.floats(allow_nan=True)
                           | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)


def only_kiln_errors(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except KilnError as e:
        assert "\n" not in str(e).strip(), f"multi-line error: {e}"
        return e


@pytest.fixture(scope="module")
def llama(artifacts):
    return kr.load(artifacts["llama"], threads=1)


def mutate(data, path: list, value):
    """``data`` with the element at ``path`` (keys/indices, taken modulo what exists) replaced or deleted."""
    node = data
    for step in path[:-1]:
        if isinstance(node, dict) and node:
            node = node[sorted(node)[step % len(node)]]
        elif isinstance(node, list) and node:
            node = node[step % len(node)]
        else:
            return
    if isinstance(node, dict) and node:
        key = sorted(node)[path[-1] % len(node)]
        if value is _DELETE:
            del node[key]
        else:
            node[key] = value
    elif isinstance(node, list) and node:
        node[path[-1] % len(node)] = None if value is _DELETE else value


_DELETE = object()


@fuzz(edits=st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=4),
                                st.one_of(st.just(_DELETE), json_values)), min_size=1, max_size=3))
def test_mutated_manifests_load_or_fail_cleanly(artifacts, tmp_path_factory, edits):
    art = tmp_path_factory.mktemp("m") / "a"
    shutil.copytree(artifacts["llama"], art)
    data = json.loads((art / "manifest.json").read_text())
    for path, value in edits:
        mutate(data, path, value)
    (art / "manifest.json").write_text(json.dumps(data))
    model = only_kiln_errors(kr.load, art, threads=1)
    if isinstance(model, kr.Model):
        only_kiln_errors(model.run, {"input_ids": np.array([[1, 2, 3]], np.int64)})
        only_kiln_errors(model.generate, [[1, 2, 3]], max_new_tokens=2)
        model.close()


dtypes = st.sampled_from([np.int64, np.int32, np.uint8, np.float32, np.float64, np.bool_])
arrays = st.builds(lambda dt, shape, seed: np.random.default_rng(seed).integers(-3, 200, size=shape).astype(dt),
                   dtypes, st.lists(st.integers(0, 5), max_size=4).map(tuple), st.integers(0, 100))


@fuzz(feeds=st.dictionaries(st.sampled_from(["input_ids", "attention_mask", "past_key_values.0.key", "logits_to_keep",
                                              "token_type_ids", "bogus"]), arrays, max_size=4))
def test_random_feeds_run_or_fail_cleanly(llama, feeds):
    only_kiln_errors(llama.run, feeds)


floats = st.floats(0.1, 2.0) | st.floats(allow_nan=True, allow_infinity=True, width=32) | st.integers(-5, 5)


@fuzz(prompt=st.lists(st.lists(st.integers(1, 127), min_size=1, max_size=6), min_size=1, max_size=3)
       | st.lists(st.lists(st.integers(-3, 140), max_size=6), max_size=3) | st.text(max_size=20),
       max_new_tokens=st.integers(1, 12) | st.integers(-2, 140), temperature=floats, top_k=st.integers(-3, 300), top_p=floats,
       repetition_penalty=floats, do_sample=st.booleans(), seed=st.none() | st.integers(0, 2 ** 32))
def test_generate_arguments_give_tokens_or_clean_errors(llama, prompt, max_new_tokens, temperature, top_k, top_p,
                                                        repetition_penalty, do_sample, seed):
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  repetition_penalty=repetition_penalty, do_sample=do_sample, seed=seed, stop_token_ids=[])
    if isinstance(prompt, str):
        out = only_kiln_errors(lambda: "".join(llama.stream(prompt, **{k: v for k, v in kwargs.items()
                                                                         if k != "stop_token_ids"})))
    else:
        out = only_kiln_errors(llama.generate, prompt, **kwargs)
        if isinstance(out, np.ndarray):
            assert out.shape[1] == max(map(len, prompt)) + max_new_tokens and (out >= 0).all() and (out < 128).all()


threshold_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.text(max_size=5),
                             st.booleans(), st.lists(st.integers(), max_size=2))


@fuzz(table=st.dictionaries(st.sampled_from(["max_ppl_increase_pct", "min_top1_agreement", "max_kl_mean",
                                              "min_cosine", "max_latency_regression_pct", "nonsense"]),
                             threshold_values, max_size=4),
       raw=st.none() | st.text(max_size=30))
def test_gate_configs_gate_or_fail_cleanly(tmp_path_factory, table, raw):
    from kiln.evaluate.gate import evaluate, load_report, load_thresholds

    root = tmp_path_factory.mktemp("g")
    lines = ["[gate]"]
    for k, v in table.items():
        if isinstance(v, float) and not math.isfinite(v):
            lines.append(f"{k} = {'nan' if math.isnan(v) else ('inf' if v > 0 else '-inf')}")
        else:
            lines.append(f"{k} = {json.dumps(v)}")
    (root / "kiln.toml").write_text(raw if raw is not None else "\n".join(lines) + "\n")
    report = {"schema": "kiln-report", "schema_version": 1, "metrics": {"ppl_increase_pct": 1.0, "top1_agreement": 0.99,
                                                                         "kl_mean": 0.01}, "latency": {"p50_ms": 1.0}}
    (root / "report.json").write_text(json.dumps(report))
    rep = only_kiln_errors(load_report, root / "report.json")
    thresholds = only_kiln_errors(load_thresholds, None, {}, cwd=Path(root))
    if isinstance(thresholds, dict) and isinstance(rep, dict):
        only_kiln_errors(evaluate, rep, thresholds)
