"""kiln export triton: the repository's config.pbtxt parses as Triton's ModelConfig (the protobuf shipped in the
tritonclient package) with the graph's real inputs and outputs; the graph is the artifact's, byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from kiln.cli import main


def model_config_pb2():
    """tritonclient's generated ModelConfig module, loaded by path (its package __init__ would import grpc)."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None:
        pytest.skip("tritonclient is not installed (make test installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / "grpc" / "model_config_pb2.py"
    mod_spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def parse(path: Path):
    from google.protobuf import text_format

    pb = model_config_pb2()
    return text_format.Parse(path.read_text(), pb.ModelConfig()), pb


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_encoder_repository_batches_dynamically(artifacts, tmp_path):
    assert main(["export", "triton", str(artifacts["bert"]), "-o", str(tmp_path / "repo"), "--name", "bert",
                 "--max-batch", "16", "--max-wait-ms", "2", "--instances", "2", "--threads", "2"]) == 0
    cfg, pb = parse(tmp_path / "repo" / "bert" / "config.pbtxt")
    assert cfg.name == "bert" and cfg.backend == "onnxruntime" and cfg.max_batch_size == 16
    assert [i.name for i in cfg.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(list(i.dims) == [-1] and i.data_type == pb.TYPE_INT64 for i in cfg.input)
    assert [(o.name, list(o.dims), o.data_type) for o in cfg.output] == [("last_hidden_state", [-1, 32], pb.TYPE_FP32)]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 2000
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    assert cfg.parameters["intra_op_thread_count"].string_value == "2"
    assert sha(tmp_path / "repo" / "bert" / "1" / "model.onnx") == sha(artifacts["bert"] / "model.onnx")
    m = json.loads((tmp_path / "repo" / "bert" / "kiln" / "manifest.json").read_text())
    assert m["model"]["kind"] == "encoder" and (tmp_path / "repo" / "bert" / "kiln" / "tokenizer.json").is_file()


def test_decoder_repository_has_full_shapes_and_the_cache(artifacts, tmp_path):
    assert main(["export", "triton", str(artifacts["llama"]), "-o", str(tmp_path / "repo")]) == 0
    cfg, pb = parse(tmp_path / "repo" / "llama" / "config.pbtxt")
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
    names = [i.name for i in cfg.input]
    assert names[:2] == ["input_ids", "attention_mask"] and "past_key_values.0.key" in names
    keep = next(i for i in cfg.input if i.name == "logits_to_keep")
    assert list(keep.dims) == [1] and list(keep.reshape.shape) == []
    logits = next(o for o in cfg.output if o.name == "logits")
    assert list(logits.dims) == [-1, -1, 128] and any(o.name == "present.1.value" for o in cfg.output)


def test_bad_exports_are_one_line_errors(artifacts, seq2seq_artifacts, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["export", "triton", str(artifacts["bert"]), "-o", str(repo)]) == 0
    assert main(["export", "triton", str(artifacts["bert"]), "-o", str(repo)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["export", "triton", str(artifacts["bert"]), "-o", str(repo), "--force"]) == 0
    assert main(["export", "triton", str(artifacts["bert"]), "-o", str(repo), "--name", "a b"]) == 2
    assert main(["export", "triton", str(seq2seq_artifacts["t5"]), "-o", str(repo)]) == 2
    assert "encoder-decoder" in capsys.readouterr().err
    assert sorted(p.name for p in repo.iterdir()) == ["bert"]  # no staging directory left behind
