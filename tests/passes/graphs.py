"""Hand-built graphs of a few nodes for pass tests, and a runner with ORT's own optimisations off."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

H, HEADS = 8, 2


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def _projection(x: str, tag: str, perm: list[int], rng) -> tuple[list, list]:
    nodes = [
        helper.make_node("MatMul", [x, f"W{tag}"], [f"{tag}_mm"], name=f"{tag}_mm"),
        helper.make_node("Add", [f"{tag}_mm", f"b{tag}"], [f"{tag}_lin"], name=f"{tag}_add"),
        helper.make_node("Reshape", [f"{tag}_lin", "split_shape"], [f"{tag}_heads"], name=f"{tag}_reshape"),
        helper.make_node("Transpose", [f"{tag}_heads"], [f"{tag}_t"], name=f"{tag}_t", perm=perm),
    ]
    inits = [_init(f"W{tag}", rng.standard_normal((H, H)).astype(np.float32) * 0.5),
             _init(f"b{tag}", rng.standard_normal(H).astype(np.float32) * 0.1)]
    return nodes, inits


def attention_graph(core: str = "explicit", kv_input: str = "x", causal: bool = False, seed: int = 0) -> onnx.ModelProto:
    """Self-attention over x (B, S, 8) with 2 heads and a padding mask; ``core`` is "explicit" or "onnx"."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], [_init("split_shape", np.array([0, 0, HEADS, H // HEADS], dtype=np.int64)),
                        _init("merge_shape", np.array([0, 0, H], dtype=np.int64))]
    for tag, x, perm in (("q", "x", [0, 2, 1, 3]), ("k", kv_input, [0, 2, 3, 1] if core == "explicit" else [0, 2, 1, 3]),
                         ("v", kv_input, [0, 2, 1, 3])):
        n, i = _projection(x, tag, perm, rng)
        nodes += n
        inits += i
    if core == "explicit":
        inits += [_init("scale", np.array(0.5, dtype=np.float32)), _init("one", np.array(1.0, dtype=np.float32)),
                  _init("neg", np.array(-10000.0, dtype=np.float32)), _init("axes", np.array([1, 2], dtype=np.int64))]
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
            helper.make_node("Sub", ["one", "mask_f"], ["inv"]),
            helper.make_node("Mul", ["inv", "neg"], ["bias2d"]),
            helper.make_node("Unsqueeze", ["bias2d", "axes"], ["mask_bias"]),
            helper.make_node("MatMul", ["q_t", "k_t"], ["scores"], name="scores"),
            helper.make_node("Mul", ["scores", "scale"], ["scaled"], name="scaled"),
            helper.make_node("Add", ["scaled", "mask_bias"], ["masked"], name="masked"),
            helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
            helper.make_node("MatMul", ["probs", "v_t"], ["ctx"], name="ctx"),
        ]
    else:
        inits.append(_init("axes", np.array([1, 2], dtype=np.int64)))
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["mask_b"], to=TensorProto.BOOL),
            helper.make_node("Unsqueeze", ["mask_b", "axes"], ["mask4d"]),
            helper.make_node("Attention", ["q_t", "k_t", "v_t"] + ([] if causal else ["mask4d"]), ["ctx"], name="sdpa",
                             scale=0.5, is_causal=int(causal)),
        ]
    nodes += [helper.make_node("Transpose", ["ctx"], ["ctx_t"], name="merge_t", perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "merge_shape"], ["y"], name="merge_reshape")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", H]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])]
    if kv_input != "x":
        inputs.append(helper.make_tensor_value_info(kv_input, TensorProto.FLOAT, ["batch", "sequence", H]))
    graph = helper.make_graph(nodes, "attn", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def residual_graph(bias: bool = True, gelu: str | None = None, extra_use: bool = False) -> onnx.ModelProto:
    """y = LayerNorm(MatMul(x, W) [+ b] + r); optionally a bias Add + Gelu branch; optionally the sum reused."""
    rng = np.random.default_rng(0)
    inits = [_init("W", rng.standard_normal((H, H)).astype(np.float32)), _init("b", rng.standard_normal(H).astype(np.float32)),
             _init("gamma", rng.standard_normal(H).astype(np.float32)), _init("beta", rng.standard_normal(H).astype(np.float32))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"])]
    last = "mm"
    if bias:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["lin"]))
        last = "lin"
    nodes += [helper.make_node("Add", [last, "r"], ["sum"], name="residual"),
              helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], name="ln", epsilon=1e-5, axis=-1)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", H])]
    if gelu:
        nodes += [helper.make_node("Add", ["y", "b"], ["g_in"], name="gelu_bias"),
                  helper.make_node("Gelu", ["g_in"], ["g"], name="gelu", approximate=gelu)]
        outputs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, ["batch", "sequence", H]))
    if extra_use:
        nodes.append(helper.make_node("Relu", ["sum"], ["sum_relu"]))
        outputs.append(helper.make_tensor_value_info("sum_relu", TensorProto.FLOAT, ["batch", "sequence", H]))
    shape = ["batch", "sequence", H]
    graph = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                                             helper.make_tensor_value_info("r", TensorProto.FLOAT, shape)],
                              outputs, inits, value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                                                          for n in ("mm", "lin", "sum")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def run_unoptimised(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def feeds(*names: str, batch: int = 2, seq: int = 5, padded: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {n: rng.standard_normal((batch, seq, H)).astype(np.float32) for n in names}
    mask = np.ones((batch, seq), dtype=np.int64)
    if padded:
        mask[1, 3:] = 0
    out["attention_mask"] = mask
    return out


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]
