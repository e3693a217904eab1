"""kiln export triton: the repository's config.pbtxt parses as Triton's ModelConfig (the protobuf shipped in the
tritonclient package) with the graph's real inputs and outputs; the graph is the artifact's, byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import threading
from pathlib import Path

import numpy as np

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
    assert main(["export", "triton", str(artifacts["llama"]), "-o", str(tmp_path / "repo"), "--graph-only"]) == 0
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
    padded = tmp_path / "padded"  # a graph traced for lengths in blocks: Triton would feed it any length
    shutil.copytree(artifacts["bert"], padded)
    data = json.loads((padded / "manifest.json").read_text())
    data["length_multiple"] = {"axis": "sequence", "multiple": 16, "pad_token_id": 0}
    (padded / "manifest.json").write_text(json.dumps(data))
    assert main(["export", "triton", str(padded), "-o", str(repo)]) == 2
    assert "pads each request to the graph's whole blocks" in capsys.readouterr().err
    assert sorted(p.name for p in repo.iterdir()) == ["bert"]  # no staging directory left behind


class StandIn:
    """``triton_python_backend_utils`` as far as kiln's model.py uses it: tensors, responses, senders that record
    what they are sent (and can report a cancelled client)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError(Exception):
        pass

    class TritonModelException(Exception):
        pass

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, np.asarray(array)

        def as_numpy(self):
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.output_tensors, self.error = list(output_tensors), error

    class Sender:
        def __init__(self, cancel_after=None):
            self.responses, self.flags, self.cancel_after = [], [], cancel_after
            self.done = threading.Event()

        def send(self, response=None, flags=0):
            self.responses.append(response)
            self.flags.append(flags)
            if flags:
                self.done.set()

        def is_cancelled(self):
            return self.cancel_after is not None and len(self.responses) >= self.cancel_after

        def text(self):
            return "".join(r.output_tensors[0].as_numpy()[0].decode() for r in self.responses if r and r.output_tensors)

    class Request:
        def __init__(self, sender, **inputs):
            self.sender, self.inputs = sender, inputs

        def get_response_sender(self):
            return self.sender

    @staticmethod
    def get_input_tensor_by_name(request, name):
        value = request.inputs.get(name)
        return None if value is None else StandIn.Tensor(name, value)

    @staticmethod
    def using_decoupled_model_transaction_policy(config):
        return bool(config.get("model_transaction_policy", {}).get("decoupled"))


def test_decoder_generation_model_streams_through_the_scheduler(artifacts, tmp_path, monkeypatch, capsys):
    """The Python-backend model, run against a stand-in for ``triton_python_backend_utils``: concurrent prompts
    stream the same text as the runtime alone; a refused request is an error response; a cancelled client ends."""
    from google.protobuf import json_format

    import kiln.runtimes as kr

    assert main(["export", "triton", str(artifacts["llama"]), "-o", str(tmp_path / "repo"), "--max-batch", "3",
                 "--queue", "2", "--threads", "2"]) == 0
    assert "streaming generation model" in capsys.readouterr().err
    repo = tmp_path / "repo" / "llama"
    cfg, pb = parse(repo / "config.pbtxt")
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0
    assert [(i.name, i.data_type, i.optional) for i in cfg.input][:2] == [
        ("text_input", pb.TYPE_STRING, False), ("max_tokens", pb.TYPE_INT32, True)]
    assert cfg.parameters["slots"].string_value == "3" and cfg.parameters["queue"].string_value == "2"
    assert sha(repo / "1" / "artifact" / "model.onnx") == sha(artifacts["llama"] / "model.onnx")
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", StandIn)
    spec = importlib.util.spec_from_file_location("kiln_triton_model", repo / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
    model.initialize({"model_config": json.dumps(config), "model_repository": str(repo), "model_version": "1"})
    prompts = ["def fibonacci(n):", "The cat sat", "Compilers rewrite graphs", "A quick brown fox", "Deployment"]
    senders = [StandIn.Sender() for _ in prompts]
    tokens = np.array([12], np.int32)
    try:
        model.execute([StandIn.Request(s, text_input=np.array([p.encode()], object), max_tokens=tokens,
                                       temperature=np.array([0.0], np.float32)) for p, s in zip(prompts, senders)])
        too_long = StandIn.Sender()
        model.execute([StandIn.Request(too_long, text_input=np.array([b"x"], object),
                                       max_tokens=np.array([100000], np.int32))])
        cancelled = StandIn.Sender(cancel_after=1)
        model.execute([StandIn.Request(cancelled, text_input=np.array([b"The cat"], object),
                                       max_tokens=np.array([60], np.int32))])
        for s in [*senders, cancelled]:
            assert s.done.wait(120) and s.flags[-1] == 1
    finally:
        model.finalize()
    assert too_long.flags == [1] and "KV-cache capacity" in str(too_long.responses[0].error)
    assert len(cancelled.responses) < 60
    with kr.load(artifacts["llama"], threads=2) as alone:
        for p, s in zip(prompts, senders):
            assert s.text() == "".join(alone.stream(p, max_new_tokens=12)), p
