"""The pass runner: records stats, honours --disable-pass, names the failing pass and those before it."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from kiln.passes import Pass, PassError, PassResult, Reason, run_passes


def identity_chain(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [f"t{i}"], [f"t{i + 1}"], name=f"id{i}") for i in range(n)]
    nodes.append(helper.make_node("Relu", [f"t{n}"], ["y"], name="relu"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class DropIdentity(Pass):
    """Test pass: removes Identity nodes, skips those whose output is a graph output."""

    name = "drop-identity"

    def run(self, model):
        model = onnx.ModelProto.FromString(model.SerializeToString())
        outputs = {o.name for o in model.graph.output}
        keep, rename, skipped = [], {}, []
        for node in model.graph.node:
            if node.op_type == "Identity" and node.output[0] not in outputs:
                rename[node.output[0]] = rename.get(node.input[0], node.input[0])
                continue
            if node.op_type == "Identity":
                skipped.append(Reason(node.name, "output is a graph output"))
            node.input[:] = [rename.get(i, i) for i in node.input]
            keep.append(node)
        del model.graph.node[:]
        model.graph.node.extend(keep)
        return PassResult(model, bool(rename), {"removed": len(rename)}, skipped)


class Breaks(Pass):
    name = "breaks"
    says_modified = True

    def run(self, model):
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.node[0].input[0] = "nowhere"
        return PassResult(model, self.says_modified)


def test_pass_fires_and_records_stats():
    model, record = run_passes(identity_chain(3), [DropIdentity()])
    assert [n.op_type for n in model.graph.node] == ["Relu"]
    assert record == [{"name": "drop-identity", "modified": True, "stats": {"removed": 3}}]


def test_second_run_changes_nothing():
    once, _ = run_passes(identity_chain(3), [DropIdentity()])
    twice, record = run_passes(once, [DropIdentity()])
    assert twice.SerializeToString() == once.SerializeToString()
    assert record[0]["modified"] is False and record[0]["stats"] == {"removed": 0}


def test_skipped_candidates_are_reported():
    model = identity_chain(0)
    model.graph.node.append(helper.make_node("Identity", ["y"], ["z"], name="tail"))
    model.graph.output[0].name = "z"
    _, record = run_passes(model, [DropIdentity()])
    assert record[0]["skipped"] == [{"where": "tail", "why": "output is a graph output"}]


def test_disabled_pass_is_recorded_not_run():
    model, record = run_passes(identity_chain(2), [DropIdentity()], disabled=["drop-identity"])
    assert len(model.graph.node) == 3
    assert record == [{"name": "drop-identity", "disabled": True, "stats": {}}]


def test_unknown_disable_name():
    with pytest.raises(PassError, match="no-such.*no such pass.*drop-identity"):
        run_passes(identity_chain(1), [DropIdentity()], disabled=["no-such"])


def test_broken_graph_names_the_pass_and_those_before():
    with pytest.raises(PassError, match="pass breaks failed after drop-identity.*--disable-pass breaks"):
        run_passes(identity_chain(2), [DropIdentity(), Breaks()])


class BreaksQuietly(Breaks):
    """Breaks the graph and says it changed nothing (a planted contract bug)."""

    name = "breaks-quietly"
    says_modified = False


def test_the_checker_runs_when_the_graph_changed_whatever_the_pass_says(monkeypatch):
    """A pass that changed nothing is not checked again (the checker reads the graph: seconds on a 135M model, for
    each of a dozen passes with nothing to rewrite); one that changed it is, even when it claims otherwise."""
    import kiln.passes.base as base

    checked = []
    real = base._check
    monkeypatch.setattr(base, "_check", lambda m: (checked.append(len(m.graph.node)), real(m)))
    once, _ = run_passes(identity_chain(3), [DropIdentity()])
    assert checked == [1]
    run_passes(once, [DropIdentity()])  # nothing left to drop
    assert checked == [1]
    with pytest.raises(PassError, match="pass breaks-quietly failed"):
        run_passes(identity_chain(1), [BreaksQuietly()])
    assert checked[-1] == 2
