"""The manifest's JSON Schema and kiln's own validator for it (kiln.runtimes.schema): every artifact the tests
compile fits it, kiln's validator agrees with the ``jsonschema`` package on valid and damaged manifests alike, and
``load`` refuses a damaged one with one line naming the field."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

import kiln.runtimes as kr
from kiln.errors import ArtifactError
from kiln.runtimes import schema as schema_lib
from kiln.runtimes.artifact import malformed

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def manifests(artifacts, seq2seq_artifacts):
    paths = {**artifacts, **{f"seq2seq-{k}": v for k, v in seq2seq_artifacts.items()}}
    return {name: json.loads((path / "manifest.json").read_text()) for name, path in paths.items()}


def test_the_schema_is_draft_2020_12_and_every_compiled_artifact_fits(manifests):
    schema = schema_lib.manifest_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert {m["model"]["kind"] for m in manifests.values()} == {"encoder", "decoder", "seq2seq"}
    for name, data in manifests.items():
        jsonschema.validate(data, schema)
        assert schema_lib.first_error(data) is None and malformed(data) is None, name


def damage(data: dict, rng: np.random.Generator) -> dict:
    """A copy of ``data`` with one value somewhere replaced by a value of another kind."""
    out = copy.deepcopy(data)
    node = out
    for depth in range(int(rng.integers(1, 5))):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return out
        key = keys[int(rng.integers(len(keys)))]
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.3 or depth == 3:
            node[key] = [None, 0, -1, "", "x/y", 1.5, True, [], {}, "float8"][int(rng.integers(10))]
            return out
        node = child
    return out


def test_kiln_agrees_with_jsonschema_on_damaged_manifests(manifests):
    schema = schema_lib.manifest_schema()
    validator = jsonschema.Draft202012Validator(schema)
    rng = np.random.default_rng(0)
    refused = 0
    for data in manifests.values():
        for _ in range(150):
            bad = damage(data, rng)
            ours = schema_lib.first_error(bad)
            assert (ours is None) == validator.is_valid(bad), (ours, list(validator.iter_errors(bad))[:1])
            refused += ours is not None
    assert refused > 300  # the damage reaches checked fields, not only free-form records


@pytest.mark.parametrize("path,value,message", [
    (("model", "max_sequence_length"), 0, "model.max_sequence_length is 0, below the minimum 1"),
    (("model", "kind"), "vision", 'model.kind is "vision", not one of "encoder", "decoder", "seq2seq"'),
    (("inputs", 0, "dtype"), "float8", 'inputs[0].dtype is "float8", not one of'),
    (("inputs", 0, "shape"), [0, "sequence"], "inputs[0].shape[0] is 0, which fits none of its allowed forms"),
    (("graphs", "model"), "../model.onnx", "graphs.model '../model.onnx' does not match"),
    (("files", "model.onnx"), "abc", "files.model.onnx 'abc' does not match"),
    (("kv_cache", "capacity"), "512", 'kv_cache.capacity is "512", not integer'),
    (("generation", "eos_token_ids"), [2, -1], "generation.eos_token_ids[1] is -1, below the minimum 0"),
    (("tokenizer", "pad_token_id"), 1.5, "tokenizer.pad_token_id is 1.5, not integer or null"),
    # a key of the damaged manifest's own, quoted and escaped: the error stays one line (a fuzz seed found it)
    (("dynamic_axes", "\n"), None, 'dynamic_axes["\\n"] is null, not object'),
    (("dynamic_axes", "x" * 10_000), None, 'dynamic_axes["' + "x" * 40 + '"] is null, not object'),
    # what a traced graph asks of the runtime (kiln.compiler.decided): bounded before it is used
    (("length_multiple",), {"axis": "sequence", "multiple": 1, "pad_token_id": 0},
     "length_multiple.multiple is 1, below the minimum 2"),
    (("length_multiple",), {"axis": "sequence", "multiple": 10**9, "pad_token_id": 0},
     "length_multiple.multiple is 1000000000, above the maximum 65536"),
    (("length_multiple",), {"axis": "past_sequence", "multiple": 16, "pad_token_id": 0},
     'length_multiple.axis is "past_sequence", not one of "sequence", "source"'),
    (("assumptions",), {"model": [{"output": "o" * 100, "value": False, "where": "x.py:1"}]},
     "assumptions.model[0].output is 100 characters long, more than 64"),
    (("assumptions",), {"model": [{"output": "o", "value": False, "where": "x.py:1"}] * 65},
     "assumptions.model has 65 entries, more than 64"),
    (("assumptions",), {"model": [{"output": "o", "value": "no", "where": "x.py:1"}]},
     'assumptions.model[0].value is "no", not boolean'),
])
def test_load_names_the_damaged_field(artifacts, tmp_path, path, value, message):
    art = tmp_path / "a"
    shutil.copytree(artifacts["llama"], art)
    data = json.loads((art / "manifest.json").read_text())
    node = data
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    (art / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as e:
        kr.load(art)
    assert f"is malformed: {message}" in str(e.value) and str(e.value).endswith("recompile the artifact")
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_rules_across_sections(artifacts, seq2seq_artifacts):
    data = json.loads((artifacts["llama"] / "manifest.json").read_text())
    data["kv_cache"]["present"] = data["kv_cache"]["present"][:-1]
    assert "past names but" in malformed(data)
    data = json.loads((next(iter(seq2seq_artifacts.values())) / "manifest.json").read_text())
    data["graphs"] = {"model": "encoder.onnx"}
    assert malformed(data).startswith("graphs ['model'] (a seq2seq has ['decoder', 'encoder'])")


def test_a_keyword_the_validator_does_not_check_is_refused(monkeypatch, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}))
    monkeypatch.setattr(schema_lib, "SCHEMA_FILE", path)
    schema_lib.manifest_schema.cache_clear()
    try:
        with pytest.raises(ValueError, match="uses multipleOf"):
            schema_lib.manifest_schema()
    finally:
        schema_lib.manifest_schema.cache_clear()
