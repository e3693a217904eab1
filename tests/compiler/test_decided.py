"""What the trace fixes when a forward stops torch.export (kiln/compiler/decided.py): a decision on tensor data is
traced for the branch the example took, with its condition as a graph output the runtime checks; a length the
forward needs in whole blocks is traced in blocks and the runtime pads to them. End to end on LED (an
encoder-decoder's encoder with both) and ProphetNet: tests/compiler/test_sweep.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kiln.compiler import capture, decided
from kiln.errors import ArtifactError, InputError, UnsupportedModelError
from kiln.runtimes.artifact import TensorSpec
from kiln.runtimes.base import check_assumptions, cut_blocks, in_blocks


class GlobalTokens(torch.nn.Module):
    """Branches in Python on whether any token is marked global (mask value 2), as Longformer does."""

    def forward(self, x, mask):
        if (mask > 1).flatten().any().item():
            return x * 100.0
        return x + 1.0


class SkipsWhileTracing(torch.nn.Module):
    """Also checks something only when not traced, as transformers' mask helpers do (``is_tracing``)."""

    def forward(self, x, mask):
        if not torch.compiler.is_exporting() and bool((mask == 1).all()):
            x = x + 0.0
        if (mask > 1).any().item():
            return x * 100.0
        return x + 1.0


def export(module, tmp_path):
    x, mask = torch.randn(2, 5), torch.ones(2, 5, dtype=torch.long)
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("sequence", min=1, max=64)
    with torch.no_grad():
        program, log = capture.export(module, (x, mask), source="test", dynamic_shapes={
            "x": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}, input_names=["x", "mask"], output_names=["y"],
            opset_version=23)
    program.save(str(tmp_path / "m.onnx"))
    return ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]), log


@pytest.mark.parametrize("module", [GlobalTokens(), SkipsWhileTracing()], ids=["decides", "skips-when-traced"])
def test_a_decision_on_tensor_data_is_traced_with_its_condition_as_an_output(tmp_path, module):
    session, log = export(module, tmp_path)
    assert log.assumptions == [{"output": "kiln_assumption_0", "value": False,
                                "where": log.assumptions[0]["where"]}]
    assert log.assumptions[0]["where"].startswith("test_decided.py:")
    assert [o.name for o in session.get_outputs()] == ["y", "kiln_assumption_0"]
    x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    plain = np.ones((3, 7), np.int64)
    y, cond = session.run(None, {"x": x, "mask": plain})
    np.testing.assert_allclose(y, x + 1, rtol=0, atol=0)
    assert check_assumptions({"y": y, "kiln_assumption_0": cond}, log.assumptions, "model") == {"y": y}
    marked = plain.copy()
    marked[1, 2] = 2  # the other branch: the graph would answer x + 1 where the model answers x * 100
    y, cond = session.run(None, {"x": x, "mask": marked})
    with pytest.raises(InputError, match=r"other branch at test_decided\.py:\d+ in forward"):
        check_assumptions({"y": y, "kiln_assumption_0": cond}, log.assumptions, "model")


class ManyDecisions(torch.nn.Module):
    """A decision per position: more than a manifest holds."""

    def forward(self, x, mask):
        for i in range(decided.MAX_DECISIONS + 1):
            if (mask[:, i % mask.shape[1]] > 1).any().item():
                x = x * 2.0
        return x


def test_more_decisions_than_a_manifest_holds_are_refused(tmp_path, monkeypatch):
    from kiln.runtimes.schema import manifest_schema

    assert manifest_schema()["properties"]["assumptions"]["additionalProperties"]["maxItems"] == decided.MAX_DECISIONS
    monkeypatch.setattr(decided, "MAX_DECISIONS", 2)  # the same check at a smaller bound
    with pytest.raises(UnsupportedModelError, match="takes 3 decisions on tensor data .* more than the 2 kiln checks"):
        export(ManyDecisions(), tmp_path)


def test_a_graph_without_the_condition_its_manifest_names_is_refused():
    with pytest.raises(ArtifactError, match="no output kiln_assumption_0"):
        check_assumptions({"y": np.zeros(1)}, [{"output": "kiln_assumption_0", "value": False, "where": "m.py:1"}],
                          "model")


def test_a_decision_the_run_never_took_cannot_be_replayed():
    mode = decided.Decisions([decided.Decision(False, "elsewhere.py:1 in forward")])
    with pytest.raises(UnsupportedModelError, match="when traced but not when run"), mode:
        torch.tensor(True).item()


def test_the_block_is_read_from_the_guards_that_fixed_the_length():
    dim = torch.export.Dim("sequence", min=1, max=128)
    violation = RuntimeError("Constraints violated (sequence)! Not all values of sequence satisfy the generated "
                             "guard (s0 + ((16 + (-1)*(s0 % 16)) % 16)) != 8*s1 and Mod(s0, 8) ...")
    assert decided.block(violation, dim) == 16
    assert decided.block(RuntimeError("Constraints violated (sequence)! s0 <= 23"), dim) is None
    assert decided.block(RuntimeError("Constraints violated (source)! s0 % 16"), dim) is None  # another axis
    assert decided.block(RuntimeError("Constraints violated (sequence)! s0 % 100"), dim) is None  # no 2 blocks fit


def test_in_blocks_repeats_the_examples_to_two_blocks_and_derives_the_axis():
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("sequence", min=1, max=128)
    ids = torch.arange(10).reshape(2, 5)
    shapes, args = decided.in_blocks({"ids": {0: batch, 1: seq}, "kv": ({0: batch}, {0: batch, 2: seq})},
                                     (ids, ids.clone(), torch.zeros(2, 3, 5)), seq, 16)
    assert shapes["ids"][0] is batch and str(shapes["ids"][1]) == str(16 * torch.export.Dim("sequence_blocks"))
    assert shapes["kv"][0] == {0: batch} and args[0].shape == (2, 32) and args[1].shape == (2, 5)
    assert args[2].shape == (2, 3, 32)
    assert args[0][0, :10].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_the_runtime_pads_to_whole_blocks_masked_and_cuts_the_outputs_back():
    specs = [TensorSpec("input_ids", "int64", ("batch", "sequence")),
             TensorSpec("attention_mask", "int64", ("batch", "sequence"))]
    outputs = [TensorSpec("last_hidden_state", "float32", ("batch", "sequence", 4)),
               TensorSpec("pooled", "float32", ("batch", 4))]
    blocks = {"axis": "sequence", "multiple": 8, "pad_token_id": 1}
    feeds = {"input_ids": np.full((2, 5), 7), "attention_mask": np.ones((2, 5), np.int64)}
    padded, length = in_blocks(specs, feeds, blocks)
    assert length == 5 and padded["input_ids"].shape == (2, 8)
    assert padded["input_ids"][0].tolist() == [7] * 5 + [1] * 3
    assert padded["attention_mask"][0].tolist() == [1] * 5 + [0] * 3
    values = {"last_hidden_state": np.zeros((2, 8, 4), np.float32), "pooled": np.zeros((2, 4), np.float32)}
    cut = cut_blocks(outputs, values, blocks, length)
    assert cut["last_hidden_state"].shape == (2, 5, 4) and cut["pooled"].shape == (2, 4)
    whole = {"input_ids": np.full((1, 16), 7), "attention_mask": np.ones((1, 16), np.int64)}
    assert in_blocks(specs, whole, blocks)[0]["input_ids"].shape == (1, 16)
    assert in_blocks(specs, feeds, None) == (feeds, None)


def test_an_artifact_in_blocks_answers_any_length_as_the_unpadded_graph_does(artifacts, tmp_path):
    """``Model.run`` pads to whole blocks (masked) and cuts back: on a BERT artifact told its lengths come in blocks
    of 16, every length gives the real positions the unpadded run gives; a pad id that is not masked would not."""
    import kiln.runtimes as kr

    art = tmp_path / "bert"
    shutil.copytree(artifacts["bert"], art)
    data = json.loads((art / "manifest.json").read_text())
    data["length_multiple"] = {"axis": "sequence", "multiple": 16, "pad_token_id": 0}
    (art / "manifest.json").write_text(json.dumps(data))
    plain, padded = kr.load(artifacts["bert"]), kr.load(art)
    rng = np.random.default_rng(0)
    for length in (1, 5, 16, 19):
        ids = rng.integers(5, 90, (2, length))
        mask = np.ones_like(ids)
        mask[1, length // 2 + 1:] = 0
        want = plain.run({"input_ids": ids, "attention_mask": mask})
        got = padded.run({"input_ids": ids, "attention_mask": mask})
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].shape == want[name].shape
            real = mask.astype(bool) if got[name].ndim == 3 else np.ones(got[name].shape[0], bool)
            np.testing.assert_allclose(got[name][real], want[name][real], rtol=1e-4, atol=1e-5)
