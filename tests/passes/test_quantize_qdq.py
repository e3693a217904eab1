"""quantize-qdq (static INT8), its calibration statistics, SmoothQuant and split-outliers, against numpy references."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import op_types, run_unoptimised
from onnx import TensorProto, helper, numpy_helper

from kiln.errors import KilnError
from kiln.passes import run_passes
from kiln.compiler.graphrun import expose
from kiln.passes.calibration import Statistics, entropy, minmax, percentile, ranges
from kiln.passes.check_tensorrt import problems
from kiln.passes.quantize_int8 import QuantizeDynamicInt8, dequantize_per_column, quantize_per_column
from kiln.passes.quantize_qdq import QuantizeStaticQDQ, activation_qparams, dequantize_linear, quantize_linear
from kiln.passes.smoothquant import SmoothQuant, smoothing_factors
from kiln.passes.split_outliers import SplitOutlierChannels, outlier_channels

K, N = 64, 48


def two_projections(norm: bool = False, residual: bool = False, outlier: float = 1.0):
    """x (B, S, K) [-> LayerNorm] -> two MatMuls reading the same tensor (Q/K-style), each with a bias Add."""
    rng = np.random.default_rng(1)
    inits, nodes, act = [], [], "x"
    gamma = np.ones(K, np.float32)
    gamma[5] = outlier  # a planted outlier channel in the activation the MatMuls read
    if norm:
        inits += [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(np.full(K, 0.1, np.float32), "beta")]
        nodes.append(helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln", axis=-1))
        act = "ln"
    outputs = []
    for tag in ("a", "b"):
        inits += [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32) * 0.2, f"W{tag}"),
                  numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), f"b{tag}")]
        nodes += [helper.make_node("MatMul", [act, f"W{tag}"], [f"mm{tag}"], name=f"proj_{tag}"),
                  helper.make_node("Add", [f"mm{tag}", f"b{tag}"], [f"y{tag}"], name=f"bias_{tag}")]
        outputs.append(helper.make_tensor_value_info(f"y{tag}", TensorProto.FLOAT, ["B", "S", N]))
    if residual:  # the activation is also read by something that is not a weight MatMul
        nodes.append(helper.make_node("Add", [act, "x"], ["res"], name="residual"))
        outputs.append(helper.make_tensor_value_info("res", TensorProto.FLOAT, ["B", "S", K]))
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])], outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def batches(n: int = 4, seed: int = 2) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((2, 7, K)) * 2 + 0.5).astype(np.float32)} for _ in range(n)]


def calibrate(model, feeds, names) -> Statistics:
    sess = ort.InferenceSession(expose(model, names).SerializeToString(), providers=["CPUExecutionProvider"])
    stats = Statistics()
    for f in feeds:
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, f)))
        stats.observe({n: out[n] for n in names})
    return stats


# --- the numpy reference ------------------------------------------------------------------


def test_activation_qparams_cover_the_range_and_keep_zero_exact():
    scale, zero = activation_qparams(-1.0, 3.0, symmetric=False)
    assert zero.dtype == np.uint8 and zero == 64 and np.isclose(scale, 4 / 255)
    scale, zero = activation_qparams(-1.0, 3.0, symmetric=True)
    assert zero.dtype == np.int8 and zero == 0 and np.isclose(scale, 3 / 127)
    assert activation_qparams(0.5, 2.0, symmetric=False)[1] == 0  # the range is widened to include 0
    x = np.linspace(-1, 3, 1001, dtype=np.float32)
    for symmetric in (False, True):
        s, z = activation_qparams(-1.0, 3.0, symmetric)
        err = np.abs(dequantize_linear(quantize_linear(x, s, z), s, z) - x)
        assert err.max() <= s / 2 + 1e-6
        assert dequantize_linear(quantize_linear(np.zeros(1, np.float32), s, z), s, z)[0] == 0.0
    s, z = activation_qparams(-1.0, 1.0, symmetric=True)
    assert quantize_linear(np.array([5.0, -5.0], np.float32), s, z).tolist() == [127, -128]  # saturates like ONNX


@pytest.mark.parametrize("symmetric", [False, True])
def test_qdq_graph_matches_numpy_reference(symmetric):
    model = two_projections()
    feeds = batches()
    rng_ = ranges(calibrate(model, feeds, ["x"]))
    out, record = run_passes(model, [QuantizeStaticQDQ(rng_, symmetric=symmetric)])
    assert record[0]["stats"] == {"quantized": 2, "activations": 1, "kept_fp32": 0}
    assert op_types(out).count("QuantizeLinear") == 1  # one pair for the input both projections read
    x = batches(1, seed=9)[0]["x"]
    s, z = activation_qparams(*rng_["x"], symmetric)
    xq = dequantize_linear(quantize_linear(x, s, z), s, z)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    exact = run_unoptimised(model, {"x": x})
    for tag, got, ref in zip("ab", run_unoptimised(out, {"x": x}), exact):
        wq, ws = quantize_per_column(inits[f"W{tag}"])
        expected = xq @ dequantize_per_column(wq, ws) + inits[f"b{tag}"]
        np.testing.assert_allclose(got, expected, atol=1e-4)
        assert 1e-4 < np.abs(got - ref).max() < 0.05 * np.abs(ref).max()  # quantized, and close
    # ONNX Runtime's own QDQ fusion (integer kernels) computes the same thing
    fused = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(fused, run_unoptimised(out, {"x": x})):
        np.testing.assert_allclose(a, b, atol=1e-3)


def test_tensorrt_flavour_runs_exact_on_the_cpu_with_the_runtimes_session_config(tmp_path):
    """TensorRT's symmetric int8 Q/DQ on ONNX Runtime's CPU (verification, the CPU fallback): neighbouring weights at
    +-127 and inputs near the int8 limits, where the fused int8 x int8 kernel of an x86 CPU without VNNI saturates
    pairs of products in int16 (a tiny Llama's top-1 fell to 86% on AVX2). kiln.runtimes turns ONNX Runtime's QDQ
    fusion off for TensorRT artifacts, and the result equals the numpy reference on every CPU."""
    from kiln.runtimes import cpu_session_config
    from kiln.runtimes.artifact import Manifest

    rng = np.random.default_rng(4)
    w = np.sign(rng.standard_normal((K, 1))).repeat(N, 1).astype(np.float32) * rng.uniform(0.5, 1, (1, N)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", N])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    x = np.abs(rng.standard_normal((2, 5, K))).astype(np.float32) * np.sign(w[:, :1].T)[None]  # every product positive
    out, _ = run_passes(model, [QuantizeStaticQDQ({"x": (float(x.min()), float(x.max()))}, symmetric=True)])
    path = tmp_path / "model.onnx"
    onnx.save(out, str(path))
    config = cpu_session_config(Manifest(tmp_path, {"target": "tensorrt"}), "onnxruntime-cpu")
    assert config == {"session.disable_quant_qdq": "1"}
    assert cpu_session_config(Manifest(tmp_path, {"target": "onnxruntime-cpu"}), "onnxruntime-cpu") == {}
    opts = ort.SessionOptions()
    for k, v in config.items():
        opts.add_session_config_entry(k, v)
    got = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    s, z = activation_qparams(float(x.min()), float(x.max()), True)
    wq, ws = quantize_per_column(w)
    expected = dequantize_linear(quantize_linear(x, s, z), s, z) @ dequantize_per_column(wq, ws)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_tensorrt_flavour_is_symmetric_with_per_channel_weights_only():
    model = two_projections(norm=True)
    out, _ = run_passes(model, [QuantizeStaticQDQ(ranges(calibrate(model, batches(), ["ln"])), symmetric=True)])
    g = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    qdq = [n for n in out.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(qdq) == 4  # Q + DQ on the activation, one DQ per weight
    for n in qdq:
        assert g[n.input[2]].dtype == np.int8 and not g[n.input[2]].any()  # zero points 0, int8
        per_channel = g[n.input[1]].ndim == 1
        assert per_channel == (g[n.input[0]].dtype == np.int8 if n.input[0] in g else False)  # only weights
    assert problems(out) == []  # TensorRT's parser takes it


def test_missing_ranges_kept_weights_and_second_run():
    model = two_projections()
    with pytest.raises(KilnError, match="calibrated activation ranges"):
        run_passes(model, [QuantizeStaticQDQ(None)])
    out, record = run_passes(model, [QuantizeStaticQDQ({"other": (0.0, 1.0)})])
    assert record[0]["modified"] is False and "no calibrated range for its input x" in record[0]["skipped"][0]["why"]
    out, record = run_passes(model, [QuantizeStaticQDQ({"x": (-4.0, 4.0)}, keep_fp32=("Wb",))])
    assert record[0]["stats"]["quantized"] == 1 and record[0]["stats"]["kept_fp32"] == 1
    again, record = run_passes(out, [QuantizeStaticQDQ({"x": (-4.0, 4.0)}, keep_fp32=("Wb",))])
    assert record[0]["modified"] is False and again.SerializeToString() == out.SerializeToString()


# --- calibration --------------------------------------------------------------------------


def test_statistics_over_batches_with_growing_range():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((100, 8)).astype(np.float32) * scale for scale in (0.1, 1.0, 10.0)]
    stats = Statistics()
    for p in parts:
        stats.observe({"t": p})
    s, every = stats["t"], np.concatenate(parts)
    assert minmax(s) == (float(every.min()), float(every.max()))
    assert s.hist.sum() == every.size  # re-binning keeps every count
    np.testing.assert_array_equal(s.channel_absmax, np.abs(every).max(0))


def test_percentile_and_entropy_clip_a_rare_outlier_minmax_keeps_it():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_000).astype(np.float32)
    x[123] = 50.0
    stats = Statistics()
    stats.observe({"t": x})
    assert minmax(stats["t"])[1] == 50.0
    lo, hi = percentile(stats["t"], 99.99)
    assert 3.0 < hi < 5.0 and -5.0 < lo < -3.0
    lo, hi = entropy(stats["t"])
    assert 3.0 < hi < 6.0 and -6.0 < lo < -3.0  # KL keeps the Gaussian's tails, drops the lone outlier
    with pytest.raises(ValueError, match="calibration method"):
        ranges(stats, "mse")


# --- SmoothQuant --------------------------------------------------------------------------


def test_smoothing_factors_balance_activation_and_weight():
    s = smoothing_factors(np.array([100.0, 1.0, 0.0]), np.array([1.0, 1.0, 2.0]), alpha=0.5)
    np.testing.assert_allclose(s, [10.0, 1.0, 1.0])  # a dead channel is left alone


@pytest.mark.parametrize("residual", [False, True])
def test_smoothquant_keeps_fp32_outputs_and_folds_into_the_norm(residual):
    model = two_projections(norm=True, residual=residual, outlier=30.0)
    stats = calibrate(model, batches(), ["ln"])
    out, record = run_passes(model, [SmoothQuant({"ln": stats["ln"].channel_absmax}, alpha=0.5)])
    st = record[0]["stats"]
    assert st["smoothed"] == 2 and (st["folded"], st["inserted_mul"]) == ((0, 1) if residual else (1, 0))
    x = batches(1, seed=9)[0]
    for a, b in zip(run_unoptimised(out, x), run_unoptimised(model, x)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    x = batches()[0]  # within the calibrated range: the error is rounding, not saturation
    # and it is what makes the outlier channel quantize well: less error than without smoothing
    act = "ln" if not residual else next(n.output[0] for n in out.graph.node if n.op_type == "Mul")

    def error(m, name):
        q, _ = run_passes(m, [QuantizeStaticQDQ(ranges(calibrate(m, batches(), [name])))])
        return max(np.abs(a - b).max() for a, b in zip(run_unoptimised(q, x), run_unoptimised(model, x)))

    assert error(out, act) < 0.5 * error(model, "ln")


# --- split-outliers -----------------------------------------------------------------------


def test_outlier_channels_are_the_large_ones_largest_first_capped():
    amax = np.ones(64)
    amax[[3, 9, 40]] = [7.0, 20.0, 10.0]
    assert outlier_channels(amax, 6.0, 8).tolist() == [9, 40, 3]
    assert outlier_channels(amax, 6.0, 2).tolist() == [9, 40]
    assert outlier_channels(amax, 25.0, 8).tolist() == []
    assert outlier_channels(np.zeros(8), 6.0, 8).tolist() == []


@pytest.mark.parametrize("residual", [False, True])
def test_split_outliers_is_exact_in_fp32_and_rescues_int8(residual):
    model = two_projections(norm=True, residual=residual, outlier=30.0)
    stats = calibrate(model, batches(), ["ln"])
    out, record = run_passes(model, [SplitOutlierChannels({"ln": stats["ln"].channel_absmax})])
    assert record[0]["stats"] == {"split": 2, "activations": 1, "channels": 1}
    x = batches()[0]
    for a, b in zip(run_unoptimised(out, x), run_unoptimised(model, x)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # the quantizer takes the big products (bias still folded) and leaves the one-channel side products FP32
    q_split, rec = run_passes(out, [QuantizeDynamicInt8()])
    assert rec[0]["stats"] == {"quantized": 2, "with_bias": 2, "kept_fp32": 0}
    assert op_types(q_split).count("MatMul") == 2  # the outlier-channel products
    q_plain, _ = run_passes(model, [QuantizeDynamicInt8()])

    def error(m):
        return max(np.abs(a - b).mean() for a, b in zip(run_unoptimised(m, x), run_unoptimised(model, x)))

    assert error(q_split) < 0.5 * error(q_plain)
    again, record = run_passes(out, [SplitOutlierChannels({"ln": stats["ln"].channel_absmax})])
    assert record[0]["modified"] is False and again.SerializeToString() == out.SerializeToString()
