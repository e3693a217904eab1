"""logits-to-keep: K = 0 keeps every position (the default a runtime fills), K > 0 the last K, bit for bit; a head
it does not recognise is refused and the graph left exactly as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import run_passes
from kiln.passes.logits_to_keep import INPUT, LogitsToKeep


def head_graph(op: str = "MatMul", scaled: bool = True, rank: int = 3, tied: bool = False,
               bias: bool = False) -> onnx.ModelProto:
    """x -> Relu -> head -> [scale] -> [+ bias] -> logits; ``tied``: the head reads Transpose(table), as a tied
    lm_head does; ``bias``: a (vocab,) bias after the scale (Phi-2's lm_head)."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(10, 4) if tied else (4, 10)).astype(np.float32)
    inits = [numpy_helper.from_array(table, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "s")]
    nodes = [helper.make_node("Relu", ["x"], ["h"])]
    if tied:
        nodes.append(helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]))
    nodes.append(helper.make_node(op, ["h", "Wt" if tied else "W"], ["z" if scaled or bias else "logits"], name="head"))
    if scaled:
        nodes.append(helper.make_node("Mul", ["z", "s"], ["zs" if bias else "logits"], name="scale"))
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(size=10).astype(np.float32), "b"))
        nodes.append(helper.make_node("Add", ["zs" if scaled else "z", "b"], ["logits"], name="bias"))
    dims = ["batch", "sequence", 10][-rank:] if rank == 3 else ["rows", 10]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 4]
                                                                         if rank == 3 else ["rows", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, dims)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model, x, keep=None):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x} | ({INPUT: np.array(keep, np.int64)} if keep is not None else {})
    return s.run(["logits"], feeds)[0]


@pytest.mark.parametrize("scaled,tied,bias", [(True, False, False), (False, False, False), (True, True, False),
                                              (True, False, True), (False, False, True)])
def test_keeps_all_or_the_last_k_positions(scaled, tied, bias):
    model = head_graph(scaled=scaled, tied=tied, bias=bias)
    out, record = run_passes(model, [LogitsToKeep()])
    assert record[0]["stats"] == {"sliced": 1}
    x = np.random.default_rng(1).normal(size=(2, 7, 4)).astype(np.float32)
    full = run(model, x)
    np.testing.assert_array_equal(run(out, x, 0), full)
    for k in (1, 3, 7, 50):
        np.testing.assert_array_equal(run(out, x, k), full[:, -min(k, 7):])


@pytest.mark.parametrize("model,why", [(head_graph("Gemm", rank=2), "Gemm"), (head_graph(rank=2), "not declared")])
def test_unrecognised_heads_are_refused_untouched(model, why):
    out, record = run_passes(model, [LogitsToKeep()])
    assert record[0]["stats"] == {"sliced": 0} and why in record[0]["skipped"][0]["why"]
    assert out.SerializeToString() == model.SerializeToString()
