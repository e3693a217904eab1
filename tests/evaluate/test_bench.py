"""kiln bench: structure of the results (never their values: wall-clock numbers are not asserted)."""

from __future__ import annotations

import json

import pytest

from kiln.cli import main


def test_encoder_against_eager_and_json(artifacts, checkpoints, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(artifacts["bert"]), "--eager", str(checkpoints["bert"]), "--batch-size", "1", "2",
               "--seq-len", "8", "16", "--budget-seconds", "0.2", "--rounds", "2", "--threads", "2", "-q", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "artifact speed-up" in printed and "eager" in printed
    data = json.loads(out.read_text())
    assert data["schema"] == "kiln-bench" and data["kind"] == "encoder" and data["artifact_size_mb"] > 0
    assert data["peak_rss_mb"] > 0 and data["eager"] and [(e["batch"], e["seq_len"]) for e in data["results"]] == [
        (1, 8), (1, 16), (2, 8), (2, 16)]
    assert data["backend"]["name"] == "onnxruntime-cpu" and "backend onnxruntime-cpu" in printed
    for e in data["results"]:
        art, eager = e["systems"]["artifact"], e["systems"]["eager"]
        for r in (art, eager):
            lat = r["latency"]
            assert lat["runs"] >= 2 * 3 and lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"]
        assert art["speedup_vs"]["eager"] > 0  # its value: test_numbers_from_a_known_clock


def test_numbers_from_a_known_clock(monkeypatch):
    """Latency, throughput and speed-up checked against a clock whose cost per call is known, not against the
    formulas bench uses: the artifact costs 2 ms a forward pass, eager 6 ms."""
    from types import SimpleNamespace

    from kiln.evaluate import bench as B
    from kiln.evaluate.options import BenchOptions

    now = [0.0]
    monkeypatch.setattr(B, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def system(name, ms):
        def forward(ids, mask):
            now[0] += ms / 1e3
        return B.System(name, forward, None, 3 * 2**20)

    fake = SimpleNamespace(max_sequence_length=64, backend={"name": "onnxruntime-cpu"},
                           manifest=SimpleNamespace(data={"model": {"kind": "encoder", "vocab_size": 100}, "precision": "fp32"}))
    monkeypatch.setattr(B, "artifact_system", lambda path, threads, backend: (system("artifact", 2.0), fake))
    monkeypatch.setattr(B, "eager_system", lambda path, decoder: system("eager", 6.0))
    monkeypatch.setattr("kiln.compiler.scoped.torch_threads", lambda n: __import__("contextlib").nullcontext())
    result = B.bench("art", eager="ckpt", options=BenchOptions(batch_sizes=(4,), seq_lens=(16,), budget_s=0.1, rounds=2))
    art, eager = (result["results"][0]["systems"][n] for n in ("artifact", "eager"))
    approx = pytest.approx
    assert art["latency"]["p50_ms"] == approx(2.0) and eager["latency"]["p50_ms"] == approx(6.0)
    assert art["sequences_per_s"] == approx(2000.0) and art["tokens_per_s"] == approx(32000.0)  # 4 rows / 2 ms, x16
    assert eager["sequences_per_s"] == approx(4 / 0.006)
    assert art["speedup_vs"]["eager"] == approx(3.0) and result["artifact_size_mb"] == 3.0


def test_decoder_prefill_and_decode_against_another_artifact(artifacts, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(artifacts["llama"]), "--compare", str(artifacts["mistral"]), "--seq-len", "12",
               "--budget-seconds", "0.2", "--rounds", "1", "-q", "--json", str(out)])
    assert rc == 0 and "decode tok/s" in capsys.readouterr().out
    e = json.loads(out.read_text())["results"][0]
    for r in e["systems"].values():
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert "compare" in e["systems"]["artifact"]["speedup_vs"]


def test_bench_input_errors(artifacts, tmp_path, capsys):
    assert main(["bench", str(artifacts["bert"]), "--seq-len", "100000", "-q"]) == 2
    assert "--seq-len 100000 does not fit" in capsys.readouterr().err
    assert main(["bench", str(artifacts["bert"]), "--batch-size", "0", "-q"]) == 2
    assert main(["bench", str(tmp_path / "missing"), "-q"]) != 0
    assert "missing" in capsys.readouterr().err


def test_encoder_decoder_times_the_encoder_and_decoding(seq2seq_artifacts, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(seq2seq_artifacts["bart"]), "--seq-len", "10", "--budget-seconds", "0.2", "--rounds", "1",
                 "-q", "--json", str(out)]) == 0
    assert "decode tok/s" in capsys.readouterr().out
    data = json.loads(out.read_text())
    r = data["results"][0]["systems"]["artifact"]
    assert data["kind"] == "seq2seq" and r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0


def test_auto_backend_is_recorded(artifacts, tmp_path, capsys):
    from kiln.runtimes.tensorrt import missing

    if missing() is None:
        pytest.skip("this machine has TensorRT and a GPU")
    out = tmp_path / "bench.json"
    assert main(["bench", str(artifacts["bert"]), "--batch-size", "1", "--seq-len", "8", "--budget-seconds", "0.1",
                 "--rounds", "1", "-q", "--backend", "auto", "--json", str(out)]) == 0
    b = json.loads(out.read_text())["backend"]
    assert b["name"] == "onnxruntime-cpu" and b["requested"] == "auto" and "tensorrt" in b["skipped"]


def test_decoder_concurrent_requests_through_continuous_batching(artifacts, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(artifacts["llama"]), "--concurrent", "1", "4", "--seq-len", "8", "--new-tokens", "6",
               "-q", "--json", str(out)])
    assert rc == 0 and "TTFT p50" in capsys.readouterr().out
    rows = json.loads(out.read_text())["concurrent"]
    assert [(r["clients"], r["tokens"]) for r in rows] == [(1, 6), (4, 24)]
    assert rows[0]["mean_decode_batch"] == 1 and rows[1]["mean_decode_batch"] > 1  # four requests shared steps
    assert rows[1]["vs_one_client"] > 0 and rows[1]["itl_p50_ms"] <= rows[1]["itl_p99_ms"]
    assert main(["bench", str(artifacts["bert"]), "--concurrent", "2", "-q"]) == 2
    assert "not a decoder-only artifact" in capsys.readouterr().err
