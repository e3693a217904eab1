"""MatMulNBits -> kiln's own kernel: the same node, inputs and attributes, in the ``ai.kiln`` domain.

kiln's custom-op library (``kiln/kernels``, loaded by ``kiln.runtimes.kernels``) computes the op with one
accumulation order for every row count and reads each weight once for all rows of a call. It packs the weights
into its own layout when the session creates the kernel, so the codes, scales and zero points stay exactly as
``quantize-nbits`` wrote them and only the node's domain changes: ``fallback`` turns the graph back into ONNX
Runtime's MatMulNBits for a machine without the library.

A node is taken when its weights are constants the library can read at load (B and zero points initializers,
scales an initializer or a Cast of one, which the session folds) and it has no inputs past the zero points
(g_idx, bias); 4 or 8 bits, block sizes 16 to 4096, and accuracy level 4 (int8 activations per block, as the
kernel computes them).
"""

from __future__ import annotations

import onnx

from kiln.passes.base import Pass, PassResult, Reason
from kiln.passes.graph import MS_DOMAIN, Graph, attr

DOMAIN = "ai.kiln"
OP = "MatMulNBits"


class UseKilnKernels(Pass):
    name = "kiln-kernels"

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        take, skipped = [], []
        for handle in g.nodes_of(OP, MS_DOMAIN):
            node = g.node(handle)
            why = self._refusal(g, node)
            if why:
                skipped.append(Reason(node.name or handle, why))
            else:
                take.append(node)
        for node in take:
            node.domain = DOMAIN
        if take:
            g.ensure_opset(DOMAIN, 1)
        return PassResult(g.model, bool(take), {"kiln_kernels": len(take)}, skipped)

    @staticmethod
    def _refusal(g: Graph, node: onnx.NodeProto) -> str | None:
        bits, block = attr(node, "bits", 4), attr(node, "block_size", 0)
        if bits not in (4, 8) or block < 16 or block > 4096 or block & (block - 1):
            return f"{bits} bits, block {block}: the kernel takes 4 or 8 bits and power-of-two blocks of 16 to 4096"
        if attr(node, "accuracy_level", 0) != 4:
            return (f"accuracy_level {attr(node, 'accuracy_level', 0)} keeps activations in float; the kernel "
                    "quantizes them to int8 per block (accuracy_level 4)")
        if len([i for i in node.input[4:] if i]):
            return "it has g_idx or bias inputs, which the kernel does not take"
        if node.input[1] not in g.initializers:
            return f"its weights {node.input[1]} are not an initializer (the kernel packs them at load)"
        if len(node.input) > 3 and node.input[3] and node.input[3] not in g.initializers:
            return f"its zero points {node.input[3]} are not an initializer"
        scales = node.input[2]
        cast = g.producer.get(scales)
        if scales not in g.initializers and not (cast is not None and cast.op_type == "Cast"
                                                 and cast.input[0] in g.initializers):
            return f"its scales {scales} are neither an initializer nor a Cast of one"
        return None


def fallback(model: onnx.ModelProto) -> int:
    """Turn every ``ai.kiln`` MatMulNBits of ``model`` back into ONNX Runtime's (in place); returns how many."""
    count = 0
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == OP:
            node.domain = MS_DOMAIN
            count += 1
    if count:
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
        if not any(o.domain == MS_DOMAIN for o in kept):
            model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return count


def fallback_name(graph_file: str) -> str:
    """The file of a graph's ONNX Runtime-only twin in an artifact."""
    return graph_file.removesuffix(".onnx") + ".fallback.onnx"


def uses_kiln_kernels(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN for n in model.graph.node)
