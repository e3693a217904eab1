"""What a library owes the process it runs in: settings put back, no files left behind, no graph handed to
ONNX Runtime as bytes (protobuf's 2 GB limit)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import pytest

from conftest import fast_options
from kiln.cli import main
from kiln.compiler import compile


def process_state() -> dict:
    import torch
    import transformers

    return {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"), "torch.onnx": logging.getLogger("torch.onnx").level,
            "transformers": transformers.utils.logging.get_verbosity(),
            "bars": transformers.utils.logging.is_progress_bar_enabled(), "threads": torch.get_num_threads(),
            "pyplot": "matplotlib.pyplot" in sys.modules}


def test_compile_and_report_put_process_state_back(checkpoints, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    torch.set_num_threads(2)
    before = process_state()
    out = compile(checkpoints["bert"], tmp_path / "a", fast_options(threads=1))
    data = tmp_path / "data.txt"
    data.write_text("The cat sat on the mat.\nA quick brown fox jumps over the lazy dog.\n")
    assert main(["report", str(out), "--reference", str(checkpoints["bert"]), "--data", str(data), "-o",
                 str(tmp_path / "r"), "-q", "--threads", "1", "--latency-seconds", "0.1"]) == 0
    assert process_state() == before


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_passing_compile_leaves_nothing_in_the_temp_directory(checkpoints, tmp_path, monkeypatch, precision):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    compile(checkpoints["llama"], tmp_path / "a", fast_options(precision=precision))
    assert list(scratch.iterdir()) == []


def test_graphs_reach_onnxruntime_as_files(checkpoints, tmp_path, monkeypatch):
    """INT8 calibration, the budget search and kiln report's per-layer run all open intermediate graphs."""
    import onnxruntime as ort

    real = ort.InferenceSession
    given = []

    def session(path_or_bytes, *args, **kwargs):
        given.append(type(path_or_bytes).__name__)
        assert isinstance(path_or_bytes, (str, os.PathLike)), "a model handed over as bytes fails past 2 GB"
        return real(path_or_bytes, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", session)
    out = compile(checkpoints["bert"], tmp_path / "q", fast_options(precision="int8", max_drop="cosine=0.9"))
    data = tmp_path / "data.txt"
    data.write_text("The cat sat on the mat.\nA quick brown fox jumps over the lazy dog.\n")
    assert main(["report", str(out), "--reference", str(checkpoints["bert"]), "--data", str(data), "-o",
                 str(tmp_path / "r"), "-q", "--latency-seconds", "0.1"]) == 0
    assert len(given) > 3 and set(given) == {"str"}
