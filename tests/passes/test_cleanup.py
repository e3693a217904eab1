"""Cleanup passes: each fires, refuses what it must keep (with a reason), and is idempotent."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from graphs import op_types, run_unoptimised
from kiln.passes import run_passes
from kiln.passes.cleanup import (
    DeduplicateInitializers,
    EliminateDeadNodes,
    EliminateIdentity,
    EliminateUnusedIO,
    FoldConstants,
)


def graph(nodes, inits=(), outputs=("y",)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2]) for o in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def c(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


def test_identity_chain_removed_and_output_kept():
    m = graph([helper.make_node("Identity", ["x"], ["a"], name="i1"), helper.make_node("Identity", ["a"], ["b"], name="i2"),
               helper.make_node("Relu", ["b"], ["r"]), helper.make_node("Identity", ["r"], ["y"], name="out")])
    out, record = run_passes(m, [EliminateIdentity()])
    assert record[0]["stats"] == {"removed": 2}
    assert record[0]["skipped"] == [{"where": "out", "why": "its output is a graph output name"}]
    assert op_types(out) == ["Relu", "Identity"] and out.graph.node[0].input[0] == "x"
    x = {"x": np.array([-1.0, 2.0], dtype=np.float32)}
    np.testing.assert_array_equal(run_unoptimised(out, x)[0], run_unoptimised(m, x)[0])
    again, record = run_passes(out, [EliminateIdentity()])
    assert record[0]["modified"] is False and again.SerializeToString() == out.SerializeToString()


def test_duplicate_initializers_merged():
    m = graph([helper.make_node("Add", ["x", "c1"], ["s"]), helper.make_node("Mul", ["s", "c2"], ["t"]),
               helper.make_node("Sub", ["t", "c3"], ["y"])], [c("c1", [1, 2]), c("c2", [1, 2]), c("c3", [3, 4])])
    out, record = run_passes(m, [DeduplicateInitializers()])
    assert record[0]["stats"] == {"merged": 1}
    assert sorted(t.name for t in out.graph.initializer) == ["c1", "c3"]
    x = {"x": np.array([0.5, 1.5], dtype=np.float32)}
    np.testing.assert_array_equal(run_unoptimised(out, x)[0], run_unoptimised(m, x)[0])
    _, record = run_passes(out, [DeduplicateInitializers()])
    assert record[0]["modified"] is False


def test_dead_nodes_and_initializers_removed():
    m = graph([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Add", ["x", "w"], ["unused"])], [c("w", [1, 1])])
    out, record = run_passes(m, [EliminateDeadNodes()])
    assert record[0]["stats"] == {"nodes": 1, "initializers": 1}
    assert op_types(out) == ["Relu"] and not out.graph.initializer
    _, record = run_passes(out, [EliminateDeadNodes()])
    assert record[0]["modified"] is False


def test_live_graph_untouched():
    m = graph([helper.make_node("Relu", ["x"], ["y"])])
    out, record = run_passes(m, [EliminateIdentity(), DeduplicateInitializers(), EliminateDeadNodes()])
    assert not any(r["modified"] for r in record)
    assert out.SerializeToString() == m.SerializeToString()


def test_fold_constants_folds_and_reports_the_rest():
    m = graph([helper.make_node("Add", ["c1", "c2"], ["s"], name="const_add"),
               helper.make_node("Mul", ["s", "c1"], ["m"], name="const_mul"),
               helper.make_node("Add", ["x", "m"], ["y"], name="live")], [c("c1", [1, 2]), c("c2", [3, 4])])
    out, record = run_passes(m, [FoldConstants()])
    assert record[0]["stats"] == {"folded": 2}
    assert op_types(out) == ["Add"]
    feeds = {"x": np.array([1.0, 1.0], np.float32)}
    np.testing.assert_allclose(run_unoptimised(out, feeds)[0], run_unoptimised(m, feeds)[0])
    again, record2 = run_passes(out, [FoldConstants()])
    assert record2[0]["modified"] is False and record2[0]["stats"] == {"folded": 0}


def test_fold_constants_keeps_large_results_and_says_why():
    big = numpy_helper.from_array(np.ones(64, np.float32), "big")
    m = graph([helper.make_node("Neg", ["big"], ["n"], name="big_neg"),
               helper.make_node("ReduceSum", ["n"], ["s"], keepdims=0),
               helper.make_node("Add", ["x", "s"], ["y"])], [big])
    out, record = run_passes(m, [FoldConstants(size_limit=16)])
    assert "Neg" in op_types(out)
    assert any(r["where"] == "big_neg" and "exceed 16 elements" in r["why"] for r in record[0]["skipped"])


def test_unused_inputs_and_optional_outputs_removed():
    g = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1),
         helper.make_node("Dropout", ["y"], ["z", "dmask"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
              helper.make_tensor_value_info("unused", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2])], [c("s", [1, 1]), c("b", [0, 0])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out, record = run_passes(m, [EliminateUnusedIO()])
    assert record[0]["stats"] == {"inputs": 1, "node_outputs": 3}
    assert [i.name for i in out.graph.input] == ["x"]
    assert [list(n.output) for n in out.graph.node] == [["y"], ["z"]]
    assert record[0]["skipped"][0]["where"] == "unused"
    twice, record2 = run_passes(out, [EliminateUnusedIO()])
    assert record2[0]["modified"] is False
    assert twice.SerializeToString() == out.SerializeToString()


def test_used_optional_output_is_kept():
    g = helper.make_graph([helper.make_node("Dropout", ["x"], ["y", "dmask"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                           helper.make_tensor_value_info("dmask", TensorProto.BOOL, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    _, record = run_passes(m, [EliminateUnusedIO()])
    assert record[0]["stats"] == {"inputs": 0, "node_outputs": 0}
