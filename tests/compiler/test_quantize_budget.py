"""The accuracy budget: a planted sensitive layer stays FP32 (INT8) or goes INT8 then FP32 (INT4); bad calibration
input fails clearly."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.compiler import corpus
from kiln.compiler.quantize import budget as quantize
from kiln.errors import UsageError
from kiln.passes import run_passes
from kiln.compiler.graphrun import expose
from kiln.passes.calibration import Statistics, ranges
from kiln.passes.quantize_int8 import QuantizeDynamicInt8
from kiln.passes.quantize_nbits import QuantizeBlockwise
from kiln.passes.quantize_qdq import QuantizeStaticQDQ

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
    return x_to_y(nodes, inits)


def x_to_y(nodes, inits) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` from input x (B, D) to output y (B, D)."""
    g = helper.make_graph(nodes, "budget", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [sess.run(None, {"x": f["x"]})[0].astype(np.float64) for f in feeds]


def dynamic(model):
    return lambda keep, promote: run_passes(model, [QuantizeDynamicInt8(keep_fp32=tuple(keep))])[0]


def static(model):
    names = ["x", "hb"]
    sess = ort.InferenceSession(expose(model, names).SerializeToString(), providers=["CPUExecutionProvider"])
    stats = Statistics()
    for f in feeds(1):
        stats.observe(dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": f["x"]}))))
    act = ranges(stats)
    return lambda keep, promote: run_passes(model, [QuantizeStaticQDQ({n: act[n] for n in names}, keep_fp32=tuple(keep))])[0]


def feeds(seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((8, D)).astype(np.float32), "input_ids": np.zeros((8, 1), np.int64)} for _ in range(3)]


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_planted_sensitive_layer_stays_fp32(mode):
    model = two_layer_graph()
    make = dynamic(model) if mode == "dynamic" else static(model)
    result = quantize.search(model, make, run, feeds(1), feeds(2), quantize.Budget("cosine", 0.95), lambda m: None)
    assert result["kept_fp32"] == ["W2"]
    assert result["sensitivity"]["W2"] > 10 * result["sensitivity"]["W1"]
    assert result["heldout_cosine"] >= 0.95
    ops = [n.op_type for n in result["model"].graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    assert ops == (["DynamicQuantizeMatMul", "Mul", "MatMul"] if mode == "dynamic" else ["MatMul", "Mul", "MatMul"])
    if mode == "static":  # W1 behind Q/DQ, W2 plain FP32
        mm = [n for n in result["model"].graph.node if n.op_type == "MatMul"]
        assert mm[0].input[1].startswith("W1_dq")
        assert mm[1].input[1] == "W2"


def three_layer_int4_graph() -> onnx.ModelProto:
    """x -> W1 -> W2 -> W3 -> y. W1 and W3 hold 4-bit codes times a scale (each block's -8 present, so
    round-to-nearest reproduces them exactly); W2 is Gaussian with one input row 12x larger in every column, which
    takes its block's 4-bit resolution (8 bits keep it)."""
    rng = np.random.default_rng(0)

    def on_grid() -> np.ndarray:
        codes = rng.integers(0, 16, (D, D))
        codes[::32] = 0
        return ((codes - 8) * 0.02).astype(np.float32)

    w2 = rng.standard_normal((D, D)).astype(np.float32) / 8
    w2[5] *= 12
    inits = [numpy_helper.from_array(w, f"W{i}") for i, w in enumerate((on_grid(), w2, on_grid()), 1)]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("MatMul", ["h1", "W2"], ["h2"]),
             helper.make_node("MatMul", ["h2", "W3"], ["y"])]
    return x_to_y(nodes, inits)


def int4(model):
    return lambda keep, promote: run_passes(model, [QuantizeBlockwise(
        bits=4, block_size=32, accuracy_level=0, keep_fp32=tuple(keep), promote_int8=tuple(promote))])[0]


@pytest.mark.parametrize("value, kept, promoted", [(0.99, [], ["W2"]), (0.99999, ["W2"], [])])
def test_int4_budget_promotes_to_int8_then_fp32(value, kept, promoted):
    """All-INT4 gives min cosine 0.939 (W2 ruined), W2 at INT8 0.9996, W2 FP32 1.0: cosine 0.99 takes INT8 for W2
    alone; 0.99999 needs W2 in FP32, and W1/W3, exact at 4 bits, go back to INT4 rather than staying INT8."""
    model = three_layer_int4_graph()
    result = quantize.search(model, int4(model), run, feeds(1), feeds(2), quantize.Budget("cosine", value),
                             lambda m: None, lambda m: ["W1", "W2", "W3"], tiers=2)
    assert (result["kept_fp32"], result["promoted_int8"]) == (kept, promoted)
    assert list(result["sensitivity"])[0] == "W2" and result["sensitivity"]["W1"] < 1e-6
    assert result["heldout_cosine"] >= value
    ops = [n.op_type for n in result["model"].graph.node if n.op_type != "Cast"]  # Casts: FP16 scales
    assert ops == (["MatMulNBits"] * 3 if not kept else ["MatMulNBits", "MatMul", "MatMulNBits"])
    bits = [next(a.i for a in n.attribute if a.name == "bits") for n in result["model"].graph.node if n.op_type == "MatMulNBits"]
    assert bits == ([4, 8, 4] if promoted else [4, 4])


def test_int4_budget_only_fp32_meets_is_an_error():
    model = three_layer_int4_graph()
    with pytest.raises(quantize.AccuracyBudgetError, match=r"met only with all 3 weights in FP32"):
        quantize.search(model, int4(model), run, feeds(1), feeds(2), quantize.Budget("cosine", 1.0),
                        lambda m: None, lambda m: ["W1", "W2", "W3"], tiers=2)


def test_next_token_metrics_against_a_hand_computation():
    ids = np.array([[5, 1, 2]])
    mask = np.array([[1, 1, 1]])
    ref = np.log(np.array([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1 / 3] * 3]]))
    got = np.log(np.array([[[0.5, 0.4, 0.1], [0.2, 0.6, 0.2], [1 / 3] * 3]]))
    m = quantize.next_token_metrics([ref], [got], [{"input_ids": ids, "attention_mask": mask}])
    # targets: position 0 -> token 1, position 1 -> token 2
    ppl_ref, ppl_got = np.exp(-(np.log(0.2) + np.log(0.8)) / 2), np.exp(-(np.log(0.4) + np.log(0.2)) / 2)
    assert m["ppl"] == pytest.approx(100 * (ppl_got / ppl_ref - 1))
    assert m["top1"] == 0.5  # argmax 0 vs 0 agrees, 2 vs 1 does not
    kl = sum((p * np.log(p / q)).sum() for p, q in ((np.array([0.7, 0.2, 0.1]), np.array([0.5, 0.4, 0.1])),
                                                    (np.array([0.1, 0.1, 0.8]), np.array([0.2, 0.6, 0.2])))) / 2
    assert m["kl"] == pytest.approx(kl)
    padded = quantize.next_token_metrics([ref], [got], [{"input_ids": ids, "attention_mask": np.array([[0, 1, 1]])}])
    assert padded["kl"] == pytest.approx((np.array([0.1, 0.1, 0.8]) * np.log(np.array([0.1, 0.1, 0.8]) / np.array([0.2, 0.6, 0.2]))).sum())


def test_impossible_budget_says_how_close_it_got():
    noise = np.random.default_rng(3)  # every run differs from the reference, even all-FP32: nothing can meet it

    def noisy(model, f):
        return [o + noise.standard_normal(o.shape) * 0.2 * np.abs(o).mean() for o in run(model, f)]

    with pytest.raises(quantize.AccuracyBudgetError, match=r"not met: with 2 of 2 weights kept in FP32 the held-out minimum"):
        quantize.search(two_layer_graph(), dynamic(two_layer_graph()), noisy, feeds(1), feeds(2),
                        quantize.Budget("cosine", 0.9999), lambda m: None)


def test_budget_and_calibration_errors(tmp_path):
    with pytest.raises(UsageError, match="give one of cosine=VALUE"):
        quantize.parse_budget("mse=2")
    with pytest.raises(UsageError, match="must be in"):
        quantize.parse_budget("cosine=1.5")
    with pytest.raises(UsageError, match="cannot be negative"):
        quantize.parse_budget("ppl=-1")
    with pytest.raises(UsageError, match="for this decoder use ppl, top1, kl"):
        quantize.parse_budget("cosine=0.99", "decoder")
    assert quantize.parse_budget("ppl=2", "decoder") == quantize.Budget("ppl", 2.0)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(UsageError, match="has 0 usable texts"):
        corpus.read_texts(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(UsageError, match='needs a "text" field'):
        corpus.read_texts(str(bad))
    with pytest.raises(UsageError, match="does not exist"):
        corpus.read_texts(str(tmp_path / "missing.txt"))
    cal, held = corpus.split([f"sentence number {i}" for i in range(40)])
    assert cal and held and not set(cal) & set(held)


def test_cli_budget_on_a_tiny_encoder(checkpoints, tmp_path, capsys):
    from kiln.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"The cat sat on the mat number {i}." for i in range(24)))
    out = tmp_path / "q"
    rc = main(["compile", str(checkpoints["bert"]), "-o", str(out), "-q", "--threads", "2", "--precision", "int8",
               "--max-drop", "cosine=0.99", "--calibration", str(texts), "--verify-max-length", "32"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    # the accuracy cost is printed next to the speed gain
    assert "int8 (quantize-int8): " in printed.out and "kept FP32; cost vs eager FP32: min cosine" in printed.out
    assert "held-out cosine" in printed.out and "x eager" in printed.out
    import json

    entry = next(p for p in json.loads((out / "manifest.json").read_text())["passes"] if p["name"] == "quantize-int8")
    assert entry["budget"]["heldout_cosine"] >= 0.99 and entry["budget"]["weights"] == 8  # 2 x (QKV, out, 2 FFN)
    q = json.loads((out / "report.json").read_text())["quantization"]
    assert q["budget"]["heldout"] >= 0.99 and q["speedup_vs_eager"] > 0 and 0.9 < q["cosine_min_vs_eager"] <= 1
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc = main(["compile", str(checkpoints["bert"]), "-o", str(tmp_path / "e"), "-q", "--precision", "int8",
               "--max-drop", "cosine=0.99", "--calibration", str(empty)])
    assert rc == 2 and "has 0 usable texts" in capsys.readouterr().err and not (tmp_path / "e").exists()


def test_budget_without_int8_is_a_usage_error(checkpoints, tmp_path, capsys):
    from kiln.cli import main

    assert main(["compile", str(checkpoints["bert"]), "-o", str(tmp_path / "x"), "-q", "--max-drop", "cosine=0.99"]) == 2
    assert "add --precision int8" in capsys.readouterr().err and not (tmp_path / "x").exists()
