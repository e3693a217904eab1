"""Hand-built graphs of a few nodes for pass tests, and a runner with ORT's own optimisations off."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import attention_node as an

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


def attention_graph(kv_input: str = "x", causal: bool = False, seed: int = 0, mask: str = "bool",
                    softcap: float = 0.0) -> onnx.ModelProto:
    """Self-attention over x (B, S, 8) with 2 heads as kiln traces it: projections, head splits, one captured
    attention node (``ai.kiln.CapturedAttention``) with a padding mask (``mask``: "bool", "additive" or "none";
    ``causal`` adds the causal part), and the merge Reshape of its (B, S, H, D) output."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], [_init("split_shape", np.array([0, 0, HEADS, H // HEADS], dtype=np.int64)),
                        _init("merge_shape", np.array([0, 0, H], dtype=np.int64))]
    for tag, x in (("q", "x"), ("k", kv_input), ("v", kv_input)):
        n, i = _projection(x, tag, [0, 2, 1, 3], rng)
        nodes += n
        inits += i
    inits += [_init("axes", np.array([1, 2], dtype=np.int64)), _init("ones2", np.array([1, 1], dtype=np.int64)),
              _init("one1", np.array([1], dtype=np.int64)), _init("c_zero", np.array(0, np.int64)),
              _init("c_one", np.array(1, np.int64)), _init("ax_0", np.array([0], np.int64)),
              _init("ax_1", np.array([1], np.int64)), _init("zero_f", np.array(0.0, np.float32)),
              _init("neg_f", np.array(-1e9, np.float32))]
    nodes += [  # (B, 1, S, S): key j is real [and j <= i]
        helper.make_node("Cast", ["attention_mask"], ["mask_b"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["mask_b", "axes"], ["mask_b4"]),
        helper.make_node("Shape", ["attention_mask"], ["mask_seq"], start=1, end=2),
        helper.make_node("Concat", ["ones2", "mask_seq", "one1"], ["mask_shape"], axis=0),
        helper.make_node("Expand", ["mask_b4", "mask_shape"], ["pad4d"]),
    ]
    last = "pad4d"
    if causal:
        nodes += [helper.make_node("Squeeze", ["mask_seq"], ["seq"]),
                  helper.make_node("Range", ["c_zero", "seq", "c_one"], ["ar"]),
                  helper.make_node("Unsqueeze", ["ar", "ax_0"], ["ar_row"]),
                  helper.make_node("Unsqueeze", ["ar", "ax_1"], ["ar_col"]),
                  helper.make_node("LessOrEqual", ["ar_row", "ar_col"], ["causal"]),
                  helper.make_node("And", ["pad4d", "causal"], ["mask_causal"])]
        last = "mask_causal"
    if mask == "additive":
        nodes.append(helper.make_node("Where", [last, "zero_f", "neg_f"], ["mask_add"]))
        last = "mask_add"
    node = an.make(["q_t", "k_t", "v_t", last if mask != "none" else ""], "ctx", "sdpa", scale=0.5, q_heads=HEADS,
                   kv_heads=HEADS, head_size=H // HEADS, v_head_size=H // HEADS, causal=causal, softcap=softcap)
    nodes += [node, helper.make_node("Reshape", ["ctx", "merge_shape"], ["y"], name="merge_reshape")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", H]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])]
    if kv_input != "x":
        inputs.append(helper.make_tensor_value_info(kv_input, TensorProto.FLOAT, ["batch", "sequence", H]))
    graph = helper.make_graph(nodes, "attn", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(an.DOMAIN, 1)])
    model.ir_version = 10
    return model


def lowered(model: onnx.ModelProto, standard_op: bool = True) -> onnx.ModelProto:
    """``model`` with every captured attention node lowered to standard ops (the ``Attention`` op, or with
    ``standard_op=False`` MatMul / Softmax / MatMul): the runnable reference a fused graph is compared with
    (``lower-attention`` itself is checked against numpy in test_lower_attention.py)."""
    from kiln.passes import run_passes
    from kiln.passes.lower_attention import LowerAttention

    return run_passes(model, [LowerAttention(standard_op)])[0]


def reference_attention(q, k, v, mask=None, scale=1.0, softcap=0.0, causal=False, sinks=None, bias=None):
    """The captured node's contract in numpy (kiln.passes.attention_node): (B, Hq, S, D) x (B, Hkv, T, D) x
    (B, Hkv, T, Dv) -> (B, S, Hq, Dv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = (q.astype(np.float64) @ k.transpose(0, 1, 3, 2)) * scale
    if softcap:
        s = np.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    elif causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ v).transpose(0, 2, 1, 3)


def residual_graph(bias: bool = True, gelu: str | None = None, extra_use: bool = False, rms: bool = False) -> onnx.ModelProto:
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
              helper.make_node("RMSNormalization", ["sum", "gamma"], ["y"], name="ln", epsilon=1e-5, axis=-1) if rms else
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


HD = 16  # GroupQueryAttention needs a head size that is a multiple of 8; a folded rotary a multiple of 16


def decoder_attention_graph(q_heads: int = 2, kv_heads: int = 1, head_size: int = HD, rotary: bool = True,
                            packed: bool | str = False, causal: bool = True, bias: bool = True, seed: int = 0,
                            head_norm: str | None = None, slice_order: str = "qkv", rotary_dim: int | None = None,
                            window: int = 0, prefix: int = 0) -> onnx.ModelProto:
    """One decoder self-attention layer as kiln traces it: projections (or a packed Split), head split,
    RotaryEmbedding from mask-derived positions, the captured attention node (``ai.kiln.CapturedAttention``) with a
    causal & padding bool mask (``window``: also a sliding window; ``prefix``: the first ``prefix`` positions see
    each other, a prefix-LM mask), and the merge Reshape of its (B, S, H, D) output.
    ``head_norm``: an RMSNorm over each head's features on Q and K, ``"before"`` the head split's Transpose or
    ``"after"`` it. ``packed="slices"``: Q, K and V cut from a packed projection by three Slices (``slice_order`` the
    order their columns lie in). ``packed="heads"``: one projection whose output holds each head's Q, K and V side by
    side, viewed as (B, S, heads, 3 x head size), transposed and Split in three. ``rotary_dim``: partial rotary, the
    first ``rotary_dim`` features of each Q and K head rotated by a RotaryEmbedding on a Slice, Concat with the
    unrotated rest."""
    rng = np.random.default_rng(seed)
    d = q_heads * head_size
    widths = {"q": d, "k": kv_heads * head_size, "v": kv_heads * head_size}
    nodes, inits = [], [_init("c_one", np.array(1, np.int64)), _init("c_zero", np.array(0, np.int64)),
                        _init("ax_last", np.array([-1], np.int64)), _init("ax_12", np.array([1, 2], np.int64)),
                        _init("ax_0", np.array([0], np.int64)), _init("ax_1", np.array([1], np.int64)),
                        _init("ax_2", np.array([2], np.int64)), _init("c_one1", np.array([1], np.int64)),
                        _init("merge_shape", np.array([0, 0, d], np.int64))]
    src = {}
    if packed == "heads":  # (B, S, H * 3 * hd) -> (B, S, H, 3 hd) -> (B, H, S, 3 hd) -> Split -> q_t, k_t, v_t
        assert q_heads == kv_heads and head_norm is None
        inits += [_init("Wqkv", rng.standard_normal((d, 3 * d)).astype(np.float32) * 0.3),
                  _init("qkv_shape", np.array([0, 0, q_heads, 3 * head_size], np.int64))]
        nodes += [helper.make_node("MatMul", ["x", "Wqkv"], ["qkv"], name="qkv_mm"),
                  helper.make_node("Reshape", ["qkv", "qkv_shape"], ["qkv_heads"], name="qkv_reshape"),
                  helper.make_node("Transpose", ["qkv_heads"], ["qkv_t"], name="qkv_t", perm=[0, 2, 1, 3]),
                  helper.make_node("Split", ["qkv_t"], ["q_t", "k_t", "v_t"], name="qkv_split", axis=3, num_outputs=3)]
    elif packed:
        inits += [_init("Wqkv", rng.standard_normal((d, sum(widths.values()))).astype(np.float32) * 0.3),
                  _init("split_sizes", np.array(list(widths.values()), np.int64))]
        nodes.append(helper.make_node("MatMul", ["x", "Wqkv"], ["qkv"], name="qkv_mm"))
        if packed == "slices":
            lo = 0
            for t in slice_order:
                hi = lo + widths[t] if t != slice_order[-1] else np.iinfo(np.int64).max
                inits += [_init(f"{t}_lo", np.array([lo], np.int64)), _init(f"{t}_hi", np.array([hi], np.int64))]
                nodes.append(helper.make_node("Slice", ["qkv", f"{t}_lo", f"{t}_hi", "ax_2", "c_one1"], [f"{t}_lin"],
                                              name=f"{t}_slice"))
                lo += widths[t]
        else:
            nodes.append(helper.make_node("Split", ["qkv", "split_sizes"], ["q_lin", "k_lin", "v_lin"], name="qkv_split",
                                          axis=2))
        src = {t: f"{t}_lin" for t in widths}
    else:
        for t, w in widths.items():
            inits.append(_init(f"W{t}", rng.standard_normal((d, w)).astype(np.float32) * 0.3))
            nodes.append(helper.make_node("MatMul", ["x", f"W{t}"], [f"{t}_mm"], name=f"{t}_mm"))
            src[t] = f"{t}_mm"
            if bias:
                inits.append(_init(f"b{t}", rng.standard_normal(w).astype(np.float32) * 0.1))
                nodes.append(helper.make_node("Add", [f"{t}_mm", f"b{t}"], [f"{t}_lin"], name=f"{t}_add"))
                src[t] = f"{t}_lin"
    heads = {"q": q_heads, "k": kv_heads, "v": kv_heads}
    for t in widths if packed != "heads" else ():
        inits.append(_init(f"{t}_shape", np.array([0, 0, heads[t], head_size], np.int64)))
        normed = head_norm is not None and t != "v"
        if normed:
            inits.append(_init(f"{t}_norm_w", (1 + rng.standard_normal(head_size) * 0.3).astype(np.float32)))
        norm = helper.make_node("RMSNormalization", [f"{t}_pre", f"{t}_norm_w"], [f"{t}_post"], name=f"{t}_norm",
                                axis=-1, epsilon=1e-6)
        split = f"{t}_pre" if normed and head_norm == "before" else f"{t}_heads"
        nodes.append(helper.make_node("Reshape", [src[t], f"{t}_shape"], [split], name=f"{t}_reshape"))
        if normed and head_norm == "before":
            norm.output[0] = f"{t}_heads"
            nodes.append(norm)
        transposed = f"{t}_pre" if normed and head_norm == "after" else f"{t}_t"
        nodes.append(helper.make_node("Transpose", [f"{t}_heads"], [transposed], name=f"{t}_t", perm=[0, 2, 1, 3]))
        if normed and head_norm == "after":
            norm.output[0] = f"{t}_t"
            nodes.append(norm)
    # positions = cumsum(mask) - 1, clipped at 0; angles = positions x inv_freq
    rd = rotary_dim or head_size
    inv_freq = (1.0 / 10000 ** (np.arange(0, rd, 2) / rd)).astype(np.float32)
    inits.append(_init("inv_freq", inv_freq))
    nodes += [helper.make_node("CumSum", ["attention_mask", "c_one"], ["cumsum"]),
              helper.make_node("Sub", ["cumsum", "c_one"], ["pos0"]),
              helper.make_node("Max", ["pos0", "c_zero"], ["pos"]),
              helper.make_node("Unsqueeze", ["pos", "ax_last"], ["pos3"]),
              helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
              helper.make_node("Mul", ["posf", "inv_freq"], ["angles"]),
              helper.make_node("Cos", ["angles"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"])]
    q, k, v = "q_t", "k_t", "v_t"
    if rotary and rotary_dim:
        inits += [_init("rd_lo", np.array([0], np.int64)), _init("rd_hi", np.array([rotary_dim], np.int64)),
                  _init("rd_end", np.array([np.iinfo(np.int64).max], np.int64)), _init("ax_3", np.array([3], np.int64))]
        for t, h in (("q", q_heads), ("k", kv_heads)):
            nodes += [helper.make_node("Slice", [f"{t}_t", "rd_lo", "rd_hi", "ax_3"], [f"{t}_part"], name=f"{t}_part"),
                      helper.make_node("Slice", [f"{t}_t", "rd_hi", "rd_end", "ax_3"], [f"{t}_pass"], name=f"{t}_pass"),
                      helper.make_node("RotaryEmbedding", [f"{t}_part", "cos", "sin"], [f"{t}_part_rot"],
                                       name=f"{t}_rope", num_heads=h),
                      helper.make_node("Concat", [f"{t}_part_rot", f"{t}_pass"], [f"{t}_rot"], name=f"{t}_cat", axis=-1)]
        q, k = "q_rot", "k_rot"
    elif rotary:
        nodes += [helper.make_node("RotaryEmbedding", ["q_t", "cos", "sin"], ["q_rot"], name="q_rope", num_heads=q_heads),
                  helper.make_node("RotaryEmbedding", ["k_t", "cos", "sin"], ["k_rot"], name="k_rope", num_heads=kv_heads)]
        q, k = "q_rot", "k_rot"
    # mask = causal (j <= i) [& i - j < window] [| both in the prefix] & padding (key j is real): (B, 1, S, S) bool
    nodes += [helper.make_node("Shape", ["attention_mask"], ["seq1"], start=1, end=2),
              helper.make_node("Squeeze", ["seq1"], ["seq"]),
              helper.make_node("Range", ["c_zero", "seq", "c_one"], ["ar"]),
              helper.make_node("Unsqueeze", ["ar", "ax_0"], ["ar_row"]),
              helper.make_node("Unsqueeze", ["ar", "ax_1"], ["ar_col"]),
              helper.make_node("Cast", ["attention_mask"], ["pad_b"], to=TensorProto.BOOL),
              helper.make_node("Unsqueeze", ["pad_b", "ax_12"], ["pad4"])]
    allowed = "pad4"
    if causal:
        nodes.append(helper.make_node("LessOrEqual", ["ar_row", "ar_col"], ["causal"]))
        allowed = "causal"
        if window:
            inits.append(_init("window", np.array(window, np.int64)))
            nodes += [helper.make_node("Sub", ["ar_col", "ar_row"], ["dist"]),
                      helper.make_node("Less", ["dist", "window"], ["near"]),
                      helper.make_node("And", ["causal", "near"], ["windowed"])]
            allowed = "windowed"
        if prefix:
            inits.append(_init("prefix", np.array(prefix, np.int64)))
            nodes += [helper.make_node("Less", ["ar_row", "prefix"], ["in_prefix"]),
                      helper.make_node("Or", [allowed, "in_prefix"], ["prefixed"])]
            allowed = "prefixed"
        nodes.append(helper.make_node("And", [allowed, "pad4"], ["mask4"]))
    else:
        nodes.append(helper.make_node("Identity", ["pad4"], ["mask4"]))
    nodes.append(an.make([q, k, v, "mask4"], "ctx", "sdpa", scale=head_size ** -0.5, q_heads=q_heads, kv_heads=kv_heads,
                         head_size=head_size, v_head_size=head_size, causal=causal, window=window))
    nodes.append(helper.make_node("Reshape", ["ctx", "merge_shape"], ["y"], name="merge_reshape"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", d]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])]
    nodes.append(helper.make_node("Shape", ["input_ids"], ["ids_shape"]))  # decoders read input_ids; keep it live
    graph = helper.make_graph(nodes, "dec_attn", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", d]),
                               helper.make_tensor_value_info("ids_shape", TensorProto.INT64, [2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(an.DOMAIN, 1)])
    model.ir_version = 10
    return model


def decoder_feeds(d: int, seed: int = 1) -> dict[str, np.ndarray]:
    """A left-padded batch of 3: full row, a one-token row, a half row."""
    rng = np.random.default_rng(seed)
    batch, seq = 3, 6
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, :-1] = 0
    mask[2, :3] = 0
    return {"x": rng.standard_normal((batch, seq, d)).astype(np.float32), "attention_mask": mask,
            "input_ids": np.zeros((batch, seq), dtype=np.int64)}
