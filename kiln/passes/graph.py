"""A small mutable view over an ONNX graph: who produces and consumes each value, and the
constants behind initializers. Passes match patterns through it and then rewrite the proto.

Why not onnx-ir's use/def graph: every kiln pass reads and writes ``onnx.ModelProto`` (the exporter's
output, the checker, ONNX Runtime and the artifact all take protos), and this index is the small part
of onnx-ir the matchers need; the passes that map one-to-one onto an onnx-ir pass use it
(``eliminate-dead-nodes``) and the others say in their docstring why they do not."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.passes import weights

MS_DOMAIN = "com.microsoft"
_SCALING = {"Mul", "Div", "Add", "Sub"}
_ROUTING = _SCALING | {"Softmax", "LogSoftmax", "Sigmoid", "Cast"}


class Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.g = model.graph
        self._ids = itertools.count()
        self.reindex()

    def reindex(self) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.g.node:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers[inp].append(node)
        self.initializers = {t.name: t for t in self.g.initializer}
        self._ranks: dict[str, int] | None = None
        self._inferred = False
        self.graph_inputs = {i.name for i in self.g.input}
        self.graph_outputs = {o.name for o in self.g.output}

    # --- lookups -------------------------------------------------------------------------
    def nodes_of(self, op_type: str, domain: str = "") -> list[str]:
        """First-output names of the nodes of one type: stable handles across edits."""
        return [n.output[0] for n in self.g.node if n.op_type == op_type and n.domain in (domain, "ai.onnx" if not domain else domain)]

    def node(self, output: str) -> onnx.NodeProto | None:
        return self.producer.get(output)

    def parent(self, node: onnx.NodeProto, index: int, op_type: str | None = None) -> onnx.NodeProto | None:
        if index >= len(node.input) or not node.input[index]:
            return None
        p = self.producer.get(node.input[index])
        if p is None or (op_type is not None and p.op_type != op_type):
            return None
        return p

    def only_consumer(self, value: str, op_type: str | None = None) -> onnx.NodeProto | None:
        users = self.consumers.get(value, [])
        if len(users) != 1 or value in self.graph_outputs:
            return None
        if op_type is not None and users[0].op_type != op_type:
            return None
        return users[0]

    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant node output, else None. An initializer in external data is
        read from disk on each call (``kiln.passes.weights``): ask ``is_constant`` when the value is not needed."""
        if name in self.initializers:
            return weights.read(self.initializers[name])
        p = self.producer.get(name)
        if p is not None and p.op_type == "Constant" and p.attribute and p.attribute[0].name == "value":
            return numpy_helper.to_array(p.attribute[0].t)
        return None

    def is_constant(self, name: str) -> bool:
        """Whether ``constant(name)`` would return a value, without reading it."""
        if name in self.initializers:
            return True
        p = self.producer.get(name)
        return p is not None and p.op_type == "Constant" and bool(p.attribute) and p.attribute[0].name == "value"

    def shape_of_constant(self, name: str) -> tuple[int, ...] | None:
        """An initializer's shape without reading its data (None for anything else)."""
        t = self.initializers.get(name)
        return tuple(int(d) for d in t.dims) if t is not None else None

    def rank(self, value: str) -> int | None:
        """The rank of ``value``: declared (value_info, inputs, outputs, initializers), else from ONNX shape
        inference (run once per index, and only when asked); None when neither knows."""
        if value in self.initializers:
            return len(self.initializers[value].dims)
        if self._ranks is None:
            self._ranks = self._declared_ranks(self.g)
        if value not in self._ranks and not self._inferred:
            self._inferred = True
            self._ranks.update(self._declared_ranks(onnx.shape_inference.infer_shapes(self.model).graph))
        return self._ranks.get(value)

    @staticmethod
    def _declared_ranks(graph: onnx.GraphProto) -> dict[str, int]:
        return {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.value_info, *graph.input, *graph.output)
                if v.type.tensor_type.HasField("shape")}

    def ancestors_inputs(self, value: str) -> set[str]:
        """Graph inputs that ``value`` depends on."""
        seen, stack, found = set(), [value], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in self.graph_inputs:
                found.add(v)
            p = self.producer.get(v)
            if p is not None:
                stack.extend(i for i in p.input if i)
        return found

    def before_scaling(self, value: str) -> str:
        """Walk back from ``value`` through elementwise ops whose other operand is a constant over the last axis at
        most (an lm_head's bias, a logits scaling) and through a Tanh (a soft-cap, ``c * tanh(x / c)``): the value
        that chain starts from (``value`` itself when there is none)."""
        while (p := self.producer.get(value)) is not None and (p.op_type in _SCALING and len(p.input) == 2
                                                                or p.op_type == "Tanh"):
            if p.op_type == "Tanh":
                value = p.input[0]
                continue
            const = [i for i in p.input if self.is_constant(i)]
            if len(const) != 1:
                return value
            shape = self.shape_of_constant(const[0])
            shape = shape if shape is not None else self.constant(const[0]).shape
            if any(d != 1 for d in shape[:-1]):
                return value
            value = next(i for i in p.input if i != const[0])
        return value

    def routes(self, value: str, depth: int = 4) -> bool:
        """Whether ``value`` is a mixture-of-experts router's logits: it reaches a TopK within ``depth`` elementwise
        ops (Softmax, Sigmoid, Cast, a bias or a scale). The quantizers keep such a MatMul in FP32: a rounded router
        picks other experts, which no later layer can undo (CPU runtimes keep routers in FP32 too)."""
        frontier = [value]
        for _ in range(depth + 1):
            step = []
            for v in frontier:
                for c in self.consumers.get(v, []):
                    if c.op_type == "TopK" and c.input[0] == v:
                        return True
                    if c.op_type in _ROUTING:
                        step.extend(o for o in c.output if o)
            frontier = step
        return False

    # --- edits ---------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        names = set(self.producer) | set(self.initializers) | self.graph_inputs
        while True:
            name = f"{base}_kiln{next(self._ids)}"
            if name not in names:
                return name

    def add_initializer(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        self.g.initializer.append(weights.maybe_spill(numpy_helper.from_array(array, name)))
        self.initializers[name] = self.g.initializer[-1]
        return name

    def ensure_opset(self, domain: str, version: int) -> None:
        if not any(o.domain == domain for o in self.model.opset_import):
            self.model.opset_import.append(onnx.helper.make_opsetid(domain, version))

    def replace_nodes(self, remove: list[onnx.NodeProto], add: list[onnx.NodeProto]) -> None:
        """Remove ``remove`` and append ``add``, then re-sort and re-index.

        Nodes are matched by their outputs: protobuf copies messages on insertion, so object
        identity does not survive an edit. Callers re-fetch nodes (``nodes_of``) after each edit.
        """
        keys = {tuple(n.output) for n in remove}
        kept = [n for n in self.g.node if tuple(n.output) not in keys]
        del self.g.node[:]
        self.g.node.extend(kept + add)
        self.toposort()
        self.reindex()

    def toposort(self) -> None:
        nodes = list(self.g.node)
        available = set(self.graph_inputs) | {t.name for t in self.g.initializer} | {""}
        order, pending = [], nodes
        while pending:
            progressed, rest = False, []
            for n in pending:
                if all(i in available for i in n.input):
                    order.append(n)
                    available.update(n.output)
                    progressed = True
                else:
                    rest.append(n)
            if not progressed:
                order.extend(rest)  # a cycle or dangling input: leave it for the checker to report
                break
            pending = rest
        del self.g.node[:]
        self.g.node.extend(order)

    def prune(self) -> int:
        """Drop nodes whose outputs nobody uses, and initializers nobody reads; returns nodes removed."""
        removed = 0
        while True:
            live = [n for n in self.g.node if any(o in self.graph_outputs or self.consumers.get(o) for o in n.output if o)]
            if len(live) == len(self.g.node):
                break
            removed += len(self.g.node) - len(live)
            del self.g.node[:]
            self.g.node.extend(live)
            self.reindex()
        used = {i for n in self.g.node for i in n.input} | self.graph_outputs
        dead = [t for t in self.g.initializer if t.name not in used]
        for t in dead:
            self.g.initializer.remove(t)
        if dead:
            self.reindex()
        return removed


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def emit(g: Graph, new: list[onnx.NodeProto], op: str, inputs: list[str], base: str, domain: str = "",
         **attrs) -> str:
    """Append one node of ``op`` to ``new`` with a fresh output named after ``base``; returns that output."""
    out = g.fresh(base)
    new.append(onnx.helper.make_node(op, inputs, [out], name=g.fresh(op), domain=domain, **attrs))
    return out


class Constants:
    """Small initializers a rewrite makes once per pass run, found again by key."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.made: dict[str, str] = {}

    def int64(self, key: str, values: list[int] | int) -> str:
        return self._get(f"i:{key}", lambda: np.array(values, np.int64), key)

    def float32(self, key: str, value: float) -> str:
        return self._get(f"f:{key}", lambda: np.array(value, np.float32), key)

    def _get(self, key: str, make, base: str) -> str:
        if key not in self.made:
            self.made[key] = self.g.add_initializer(base.split(":")[0], make())
        return self.made[key]
