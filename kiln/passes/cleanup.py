"""Cleanup passes: Identity elimination, duplicate initializers, dead nodes and unused initializers, and
Gemm rewritten as MatMul + Add for the quantizers."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import Graph


def _rename_inputs(g: Graph, mapping: dict[str, str]) -> None:
    for node in g.g.node:
        node.input[:] = [mapping.get(i, i) for i in node.input]


class EliminateIdentity(Pass):
    """Identity nodes, except those whose output is a graph output name. Not onnx-ir's
    ``IdentityEliminationPass``: that one renames values to keep an output's name, and kiln reports each
    kept Identity with its reason instead."""

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
    """Byte-identical initializers merged into one. Not onnx-ir's ``DeduplicateInitializersPass``: it only
    compares tensors up to a size limit (1024 elements by default), and the copies that matter here are
    large (a tied embedding and lm_head exported twice)."""

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
    """Nodes and initializers nothing reads: onnx-ir's ``RemoveUnusedNodesPass`` (graph inputs and outputs
    stay as they are), with the counts kiln records."""

    name = "eliminate-dead-nodes"

    def run(self, model: onnx.ModelProto) -> PassResult:
        import onnx_ir as ir
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        nodes, inits = len(model.graph.node), len(model.graph.initializer)
        result = RemoveUnusedNodesPass()(ir.serde.deserialize_model(model))
        if not result.modified:
            return PassResult(model, False, {"nodes": 0, "initializers": 0}, [])
        out = ir.serde.serialize_model(result.model)
        return PassResult(out, True, {"nodes": nodes - len(out.graph.node),
                                      "initializers": inits - len(out.graph.initializer)}, [])


class FoldConstants(Pass):
    """Evaluate nodes whose inputs are all constant (onnxscript's folder); counts what it folded.

    Large results stay as nodes (the folder's size limits keep the graph file from ballooning);
    each such node is reported as skipped."""

    name = "fold-constants"

    def __init__(self, size_limit: int = 1 << 20) -> None:
        self.size_limit = size_limit  # elements, for any input or output of a folded node

    def run(self, model: onnx.ModelProto) -> PassResult:
        from onnxscript.optimizer import fold_constants

        before = len(model.graph.node)
        fold_constants(model, input_size_limit=self.size_limit, output_size_limit=self.size_limit)
        g = Graph(model)
        g.prune()
        constant = set(g.initializers)
        skipped = []
        for node in g.g.node:
            if node.input and all(i in constant or not i for i in node.input) and node.op_type != "Constant":
                skipped.append(Reason(node.name or node.output[0], f"{node.op_type} has only constant inputs but its "
                                      f"tensors exceed {self.size_limit} elements or not evaluable here"))
        folded = before - len(g.g.node)
        return PassResult(g.model, folded > 0, {"folded": folded}, skipped)


class EliminateUnusedIO(Pass):
    """Graph inputs no node reads, and optional node outputs nobody uses.

    A dropped graph input stays in the manifest (callers may still feed it; the runtime drops the
    feed), so the artifact's contract does not change with the model's internals."""

    name = "eliminate-unused-io"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        unused = [i for i in g.g.input if not g.consumers.get(i.name) and i.name not in g.graph_outputs]
        for i in unused:
            g.g.input.remove(i)
        cleared = 0
        for node in g.g.node:
            schema = _schema(node)
            if schema is None:
                continue
            for idx in range(len(node.output) - 1, 0, -1):  # trailing optional outputs only
                name = node.output[idx]
                optional = idx < len(schema.outputs) and schema.outputs[idx].option == onnx.defs.OpSchema.FormalParameterOption.Optional
                if not name or not optional or g.consumers.get(name) or name in g.graph_outputs:
                    break
                del node.output[idx]
                cleared += 1
        if unused or cleared:
            g.reindex()
        return PassResult(g.model, bool(unused or cleared), {"inputs": len(unused), "node_outputs": cleared},
                          [Reason(i.name, "kept in the manifest; the runtime ignores a feed for it") for i in unused])


def _schema(node: onnx.NodeProto) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(node.op_type, domain=node.domain)
    except onnx.defs.SchemaError:
        return None


class GemmToMatMul(Pass):
    """Gemm with a constant weight -> MatMul + bias Add, so the quantizers see one weight-MatMul form
    (a Conv1D-style Linear exports as Gemm on 2-D views)."""

    name = "gemm-to-matmul"

    def run(self, model: onnx.ModelProto) -> PassResult:
        from onnx import helper

        from kiln.passes.graph import attr

        g = Graph(model)
        done, skipped = 0, []
        for handle in g.nodes_of("Gemm"):
            node = g.node(handle)
            where = node.name or handle
            w = g.constant(node.input[1])
            bias = g.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if w is None or w.ndim != 2 or attr(node, "transA", 0):
                skipped.append(Reason(where, "weight is not a constant matrix, or A is transposed"))
                continue
            if bias is not None and bias.ndim > 1:
                skipped.append(Reason(where, f"bias of shape {bias.shape} is not a vector"))
                continue
            w = (w.T if attr(node, "transB", 0) else w) * attr(node, "alpha", 1.0)
            nodes = [helper.make_node("MatMul", [node.input[0], g.add_initializer(f"{node.input[1]}_mm", np.ascontiguousarray(w))],
                                      [node.output[0] if bias is None else g.fresh(f"{where}_mm")], name=g.fresh("MatMul"))]
            if bias is not None:
                b = g.add_initializer(f"{node.input[2]}_bias", (bias * attr(node, "beta", 1.0)).astype(bias.dtype))
                nodes.append(helper.make_node("Add", [nodes[0].output[0], b], [node.output[0]], name=g.fresh("Add")))
            g.replace_nodes([node], nodes)
            done += 1
        if done:
            g.prune()
        return PassResult(g.model, done > 0, {"rewritten": done}, skipped)
