"""Cleanup passes: Identity elimination, duplicate initializers, dead nodes and unused initializers."""

from __future__ import annotations

import hashlib

import onnx

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph


def _rename_inputs(g: Graph, mapping: dict[str, str]) -> None:
    for node in g.g.node:
        node.input[:] = [mapping.get(i, i) for i in node.input]


class EliminateIdentity(Pass):
    name = "eliminate-identity"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        mapping, remove, skipped = {}, [], []
        for node in g.g.node:
            if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
                continue
            if node.output[0] in g.graph_outputs:
                skipped.append(Reason(node.name or node.output[0], "its output is a graph output name"))
                continue
            mapping[node.output[0]] = node.input[0]
            remove.append(node)
        # chains of Identity resolve to the first real value
        for k in mapping:
            while mapping[k] in mapping:
                mapping[k] = mapping[mapping[k]]
        if remove:
            _rename_inputs(g, mapping)
            g.replace_nodes(remove, [])
        return PassResult(g.model, bool(remove), {"removed": len(remove)}, skipped)


class DeduplicateInitializers(Pass):
    name = "dedup-initializers"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        seen: dict[tuple, str] = {}
        mapping: dict[str, str] = {}
        for t in g.g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL or t.name in g.graph_inputs or t.name in g.graph_outputs:
                continue
            key = (t.data_type, tuple(t.dims), hashlib.sha256(onnx.numpy_helper.to_array(t).tobytes()).hexdigest())
            if key in seen:
                mapping[t.name] = seen[key]
            else:
                seen[key] = t.name
        if mapping:
            _rename_inputs(g, mapping)
            g.reindex()
            g.prune()
        return PassResult(g.model, bool(mapping), {"merged": len(mapping)}, [])


class EliminateDeadNodes(Pass):
    name = "eliminate-dead-nodes"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        before_init = len(g.g.initializer)
        removed = g.prune()
        dropped = before_init - len(g.g.initializer)
        return PassResult(g.model, bool(removed or dropped), {"nodes": removed, "initializers": dropped}, [])
