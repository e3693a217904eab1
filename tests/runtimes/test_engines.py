"""TensorRT engine bookkeeping without a GPU: --profile parsing, profiles from the manifest's dynamic axes (a
decoder's zero-length past included), the cache key, and the reason a stale or foreign engine is refused."""

from __future__ import annotations

import json

import pytest

import kiln.runtimes as kr
from kiln.errors import UsageError
from kiln.runtimes.engines import EngineRecord, axis_ranges, cache_key, input_profiles, parse_profile, refusal


def test_profile_flag_parses_and_refuses_nonsense():
    assert parse_profile("batch=1:4:8, seq=1:128:512,past=0:64:255") == {
        "batch": (1, 4, 8), "sequence": (1, 128, 512), "past_sequence": (0, 64, 255)}
    for bad, words in (("batch=1:4", "AXIS=MIN:OPT:MAX"), ("width=1:2:3", "AXIS=MIN:OPT:MAX"),
                       ("batch=4:2:8", "MIN <= OPT <= MAX"), ("batch=a:b:c", "AXIS=MIN:OPT:MAX"),
                       ("batch=0:0:0", "MAX >= 1")):
        with pytest.raises(UsageError, match=words):
            parse_profile(bad)


def test_encoder_profiles_follow_the_dynamic_axes(artifacts):
    m = kr.load(artifacts["bert"]).manifest.data
    ranges = axis_ranges(m)
    seq_max = m["dynamic_axes"]["sequence"]["max"]
    assert ranges == {"batch": (1, 1, 8), "sequence": (1, min(128, seq_max), seq_max)}
    shapes = input_profiles(m, axis_ranges(m, parse_profile("batch=1:4:16,seq=1:16:32")))
    assert shapes["input_ids"] == ((1, 1), (4, 16), (16, 32)) and set(shapes) == {s["name"] for s in m["inputs"]}
    with pytest.raises(UsageError, match="outside what the artifact allows"):
        axis_ranges(m, {"sequence": (1, 8, seq_max + 1)})
    with pytest.raises(UsageError, match="no past_sequence axis"):
        axis_ranges(m, {"past_sequence": (0, 1, 2)})


def test_decoder_profile_covers_prefill_and_decode(artifacts):
    m = kr.load(artifacts["llama"]).manifest.data
    cap = m["kv_cache"]["capacity"]
    ranges = axis_ranges(m)
    assert ranges["past_sequence"][0] == 0 and ranges["past_sequence"][2] == cap - 1  # a zero-length past is allowed
    assert ranges["total_sequence"] == (1, ranges["past_sequence"][1] + 1, cap)
    shapes = input_profiles(m, ranges)
    key = shapes["past_key_values.0.key"]
    kv = m["kv_cache"]
    assert key[0] == (1, kv["num_kv_heads"], 0, kv["head_size"]) and key[2][2] == cap - 1
    assert shapes["logits_to_keep"] == ((), (), ())


def record(**kw):
    base = dict(tensorrt="10.8.0", compute_capability="9.0", profiles={"input_ids": ((1, 1), (1, 128), (8, 512))},
                precision="fp16", graph_sha256="ab" * 32)
    return EngineRecord(**(base | kw))


def test_cache_key_changes_with_each_of_its_five_parts():
    base = record()
    variants = [record(tensorrt="11.0.0"), record(compute_capability="8.9"), record(precision="int8"),
                record(graph_sha256="cd" * 32), record(profiles={"input_ids": ((1, 1), (1, 64), (8, 512))})]
    keys = {base.key} | {v.key for v in variants}
    assert len(keys) == 6 and all(len(k) == 16 for k in keys)
    assert cache_key("10.8.0", "9.0", {"input_ids": ((1, 1), (1, 128), (8, 512))}, "fp16", "ab" * 32) == base.key
    again = EngineRecord.from_json(json.loads(json.dumps(base.to_json())))
    assert again == base and again.key == base.to_json()["key"]


@pytest.mark.parametrize("stored,words", [
    (record(graph_sha256="cd" * 32), "different graph"),
    (record(tensorrt="10.7.0"), "TensorRT 10.7.0, this is TensorRT 10.8.0"),
    (record(compute_capability="8.6"), "compute capability 8.6, this GPU is 9.0"),
    (record(precision="int8"), "precision recipe int8, asked for fp16"),
    (record(profiles={"input_ids": ((1, 1), (1, 64), (8, 512))}), "profiles differ"),
])
def test_stale_or_foreign_engines_are_refused_with_the_reason(stored, words):
    why = refusal(stored, record())
    assert why is not None and words in why and "kiln build-engine --force" in why


def test_a_matching_engine_may_run_and_a_broken_record_is_an_artifact_error():
    assert refusal(record(), record()) is None
    from kiln.errors import ArtifactError

    with pytest.raises(ArtifactError, match="rebuild it"):
        EngineRecord.from_json({"tensorrt": "10"})


def test_build_engine_without_tensorrt_or_gpu_is_one_line_exit_1(artifacts, capsys):
    from kiln.cli import main
    from kiln.runtimes.tensorrt import missing

    why = missing()
    if why is None:
        pytest.skip("this machine has TensorRT and a GPU: tools/gpu_check.py is the check there")
    assert main(["build-engine", str(artifacts["bert"])]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and err[0].startswith("kiln build-engine: error: kiln build-engine needs TensorRT and an "
                                               "NVIDIA GPU: " + why) and "pip install 'kiln[gpu]'" in err[0]
    assert not (artifacts["bert"] / "engines").exists()


def test_auto_backend_falls_back_to_cpu_and_says_why(artifacts, capsys, caplog):
    import logging

    from kiln.cli import main
    from kiln.runtimes.tensorrt import missing

    if missing() is None:
        pytest.skip("this machine has TensorRT and a GPU")
    with caplog.at_level(logging.INFO, logger="kiln.runtimes"):
        model = kr.load(artifacts["bert"], backend="auto")
    assert model.backend["name"] == "onnxruntime-cpu" and model.backend["requested"] == "auto"
    assert set(model.backend["skipped"]) == {"tensorrt", "onnxruntime-cuda"}
    assert "backend auto: onnxruntime-cpu" in caplog.text
    assert main(["run", str(artifacts["bert"]), "--text", "hello", "--backend", "auto"]) == 0
    err = capsys.readouterr().err
    assert "backend onnxruntime-cpu (tensorrt skipped: " in err and "onnxruntime-cuda skipped: " in err
    assert main(["run", str(artifacts["bert"]), "--text", "hello", "--backend", "onnxruntime-cuda"]) == 1
    err = capsys.readouterr().err
    assert "backend onnxruntime-cuda: " in err and "pip install 'kiln[gpu]' (onnxruntime-gpu)" in err
    assert main(["run", str(artifacts["bert"]), "--text", "hello", "--backend", "tpu"]) == 2


def test_graph_identity_covers_the_external_weights(artifacts):
    """The cache key's graph sha256 comes from the manifest's checked file sha256s: the graph file and the weights
    beside it, so new weights in the same graph structure make a different key."""
    from kiln.runtimes.artifact import read_manifest
    from kiln.runtimes.tensorrt import graph_sha256

    m = read_manifest(artifacts["llama"])
    base = graph_sha256(m)
    assert len(base) == 64 and graph_sha256(read_manifest(artifacts["llama"])) == base
    data = dict(m.data, files=dict(m.data["files"], **{"model.onnx.data": "00" * 32}))
    assert graph_sha256(type(m)(m.root, data)) != base
    data = dict(m.data, files={k: v for k, v in m.data["files"].items() if not k.startswith("tokenizer")})
    assert graph_sha256(type(m)(m.root, data)) == base  # other files do not matter


def test_pick_runs_the_first_current_engine_and_says_why_the_others_may_not():
    from kiln.runtimes.engines import pick

    stale, foreign, good = record(tensorrt="10.7.0"), record(compute_capability="8.6"), record()
    any_profile = EngineRecord("10.8.0", "9.0", {}, "fp16", "ab" * 32)  # loading: profiles are checked per run
    name, refused = pick([("a.plan", stale), ("b.plan", foreign), ("c.plan", good)], any_profile)
    assert name == "c.plan" and len(refused) == 2
    assert "a.plan: it was built by TensorRT 10.7.0" in refused[0] and "b.plan: it was built for compute" in refused[1]
    assert pick([("a.plan", stale)], any_profile)[0] is None


def test_feeds_outside_the_engine_profile_are_refused_before_running():
    from kiln.runtimes.engines import outside_profile

    profiles = {"input_ids": ((1, 1), (1, 128), (8, 512))}
    assert outside_profile({"input_ids": (8, 512), "other": (99,)}, profiles) is None
    why = outside_profile({"input_ids": (9, 4)}, profiles)
    assert why is not None and "[9, 4], outside the engine's profile [1, 1]..[8, 512]" in why and "--profile" in why


def fake_engine(artifact, tmp_path, monkeypatch, **fields):
    """A copy of ``artifact`` with an engine record (and a dummy plan) as kiln build-engine writes them, on a machine
    pretending to have TensorRT 10.8.0 and a compute capability 9.0 GPU."""
    import shutil

    import kiln.runtimes.tensorrt as rt
    from kiln.runtimes.artifact import read_manifest

    out = tmp_path / "with-engine"
    shutil.copytree(artifact, out)
    monkeypatch.setattr(rt, "missing", lambda: None)
    monkeypatch.setattr(rt, "tensorrt_version", lambda: "10.8.0")
    monkeypatch.setattr(rt, "compute_capability", lambda: "9.0")
    m = read_manifest(out)
    rec = EngineRecord(**{"tensorrt": "10.8.0", "compute_capability": "9.0",
                          "profiles": {"input_ids": ((1, 1), (1, 128), (8, 512))},
                          "precision": m.data["precision"], "graph_sha256": rt.graph_sha256(m), **fields})
    (out / "engines").mkdir()
    (out / "engines" / f"{rec.key}.plan").write_bytes(b"plan")
    (out / "engines" / f"{rec.key}.json").write_text(json.dumps(rec.to_json()))
    return out, rec


def test_auto_picks_tensorrt_only_for_a_current_engine(artifacts, tmp_path, monkeypatch):
    import kiln.runtimes.tensorrt as rt
    from kiln.runtimes import choose_backend
    from kiln.runtimes.artifact import read_manifest

    out, rec = fake_engine(artifacts["bert"], tmp_path, monkeypatch)
    plan, why = rt.usable_engine(read_manifest(out))
    assert plan == out / "engines" / f"{rec.key}.plan" and why == ""
    assert choose_backend(read_manifest(out)) == ("tensorrt", {})
    monkeypatch.setattr(rt, "tensorrt_version", lambda: "10.9.0")  # TensorRT upgraded: the engine is stale
    chosen, skipped = choose_backend(read_manifest(out))
    assert chosen == "onnxruntime-cpu" and "built by TensorRT 10.8.0, this is TensorRT 10.9.0" in skipped["tensorrt"]


def test_tensorrt_backend_without_tensorrt_is_one_line(artifacts):
    from kiln.runtimes.tensorrt import EngineUnavailableError, missing

    why = missing()
    if why is None:
        pytest.skip("this machine has TensorRT and a GPU")
    import re

    with pytest.raises(EngineUnavailableError, match=f"backend tensorrt cannot run .*: {re.escape(why)}; pip install"):
        kr.load(artifacts["bert"], backend="tensorrt")


def test_gpu_check_says_what_it_could_not_run(capsys):
    import gpu_check

    from kiln.runtimes.tensorrt import missing

    why = missing()
    if why is None:
        pytest.skip("this machine has TensorRT and a GPU: run tools/gpu_check.py itself")
    assert gpu_check.main(["--models", "minilm", "--precisions", "fp16"]) == 2
    out = capsys.readouterr().out
    assert f"nothing run: {why}. Not run: minilm fp16 (engine build, TensorRT parity" in out


def test_onnxruntime_tensorrt_provider_caches_in_the_artifact_and_says_when_missing(artifacts, tmp_path, capsys):
    import shutil

    from kiln.cli import main
    from kiln.runtimes.artifact import read_manifest
    from kiln.runtimes.onnxruntime import tensorrt_provider_options

    out = tmp_path / "a"
    shutil.copytree(artifacts["bert"], out)
    opts = tensorrt_provider_options(read_manifest(out))
    cache = out / "engines" / "onnxruntime-trt"
    assert opts["trt_engine_cache_path"] == opts["trt_timing_cache_path"] == str(cache) and cache.is_dir()
    assert opts["trt_engine_cache_enable"] == opts["trt_timing_cache_enable"] == "True"
    import onnxruntime as ort

    if "TensorrtExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the TensorRT provider")
    assert main(["run", str(out), "--text", "hello", "--backend", "onnxruntime-tensorrt"]) == 1
    err = capsys.readouterr().err
    assert "backend onnxruntime-tensorrt: this onnxruntime has no Tensorrt execution provider" in err
    assert err.count("\n") == 1
