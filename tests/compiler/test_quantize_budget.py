"""The INT8 accuracy budget: a planted sensitive layer stays FP32; bad calibration input fails clearly."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.compiler import quantize
from kiln.errors import UsageError

D = 64


def two_layer_graph() -> onnx.ModelProto:
    """x -> MatMul(W1) -> scale channels (one 300x larger) -> MatMul(W2) -> y. W2's input has an outlier
    channel, so per-tensor activation quantization ruins W2's product; W1's input is benign."""
    rng = np.random.default_rng(0)
    boost = np.ones(D, np.float32)
    boost[7] = 300.0
    inits = [numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32) / 8, "W1"),
             numpy_helper.from_array(boost, "boost"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32) / 8, "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Mul", ["h", "boost"], ["hb"]),
             helper.make_node("MatMul", ["hb", "W2"], ["y"])]
    g = helper.make_graph(nodes, "budget", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, {"x": f["x"]})[0] for f in feeds]).astype(np.float64)


def feeds(seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, D)).astype(np.float32), "input_ids": np.zeros((8, 1), np.int64)} for _ in range(3)]


def test_planted_sensitive_layer_stays_fp32():
    result = quantize.search(two_layer_graph(), run, feeds(1), feeds(2), 0.95, lambda m: None)
    assert result["kept_fp32"] == ["W2"]
    assert result["sensitivity"]["W2"] > 10 * result["sensitivity"]["W1"]
    assert result["heldout_cosine_min"] >= 0.95
    ops = [n.op_type for n in result["model"].graph.node]
    assert ops == ["DynamicQuantizeMatMul", "Mul", "MatMul"]


def test_impossible_budget_says_how_close_it_got():
    noise = np.random.default_rng(3)  # every run differs from the reference, even all-FP32: nothing can meet it

    def noisy(model, f):
        out = run(model, f)
        return out + noise.standard_normal(out.shape) * 0.2 * np.abs(out).mean()

    with pytest.raises(quantize.AccuracyBudgetError, match=r"not met: with 2 of 2 weights kept in FP32 the held-out minimum"):
        quantize.search(two_layer_graph(), noisy, feeds(1), feeds(2), 0.9999, lambda m: None)


def test_budget_and_calibration_errors(tmp_path):
    with pytest.raises(UsageError, match="give cosine=VALUE"):
        quantize.parse_budget("ppl=2")
    with pytest.raises(UsageError, match="must be in"):
        quantize.parse_budget("cosine=1.5")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(UsageError, match="has 0 usable texts"):
        quantize.read_texts(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(UsageError, match='needs a "text" field'):
        quantize.read_texts(str(bad))
    with pytest.raises(UsageError, match="does not exist"):
        quantize.read_texts(str(tmp_path / "missing.txt"))
    cal, held = quantize.split([f"sentence number {i}" for i in range(40)])
    assert cal and held and not set(cal) & set(held)


def test_cli_budget_on_a_tiny_encoder(checkpoints, tmp_path, capsys):
    from kiln.compiler.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"The cat sat on the mat number {i}." for i in range(24)))
    out = tmp_path / "q"
    rc = main(["compile", str(checkpoints["bert"]), "-o", str(out), "-q", "--threads", "2", "--precision", "int8",
               "--max-drop", "cosine=0.99", "--calibration", str(texts), "--verify-max-length", "32"])
    assert rc == 0, capsys.readouterr().err
    import json

    entry = next(p for p in json.loads((out / "manifest.json").read_text())["passes"] if p["name"] == "quantize-int8")
    assert entry["budget"]["heldout_cosine_min"] >= 0.99 and entry["budget"]["weights"] == 12
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc = main(["compile", str(checkpoints["bert"]), "-o", str(tmp_path / "e"), "-q", "--precision", "int8",
               "--max-drop", "cosine=0.99", "--calibration", str(empty)])
    assert rc == 2 and "has 0 usable texts" in capsys.readouterr().err and not (tmp_path / "e").exists()


def test_budget_without_int8_is_a_usage_error(checkpoints, tmp_path, capsys):
    from kiln.compiler.cli import main

    assert main(["compile", str(checkpoints["bert"]), "-o", str(tmp_path / "x"), "-q", "--max-drop", "cosine=0.99"]) == 2
    assert "add --precision int8" in capsys.readouterr().err and not (tmp_path / "x").exists()
