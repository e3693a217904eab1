"""What an attention mask in a traced graph computes, found by computing it: the subgraph from ``attention_mask``
(and ``input_ids``' shape) to the mask is run on probe paddings and compared with the masks a kernel can build
itself: causal or not, a sliding window or not, the padding applied or not.

Why run it rather than read it: every family builds its mask with its own ops (transformers' ``masking_utils`` under
tracing, an older family's own arithmetic, a slice of a registered causal buffer), and the fused kernels replace the mask by
their own. Running the subgraph on paddings left and right, at two lengths (one past the declared window), tells what
it is whatever ops compute it; a mask that is none of these (a prefix-LM, a chunked or block mask, one that reads the
token ids' values) is reported as such, and the attention keeps its own mask on the fallback path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kiln.passes.base import NoMatch
from kiln.passes.graph import Graph

PROBE_LENGTH = 12
WINDOW_PROBE_LIMIT = 512
"""Windows up to this length are checked by a probe one window long; a longer declared window is taken as declared
(verification checks the artifact at the lengths it tests)."""
_NEG = -1e4
"""An additive mask value at or below this hides its key: exp(-1e4) is 0 in float32, as exp(-inf) is (older
families add -10000, newer ones the float32 minimum)."""


@dataclass(frozen=True)
class MaskKind:
    """Key j is visible to query i iff (j <= i when ``causal``) and (i - j < ``window`` when set) and
    (``attention_mask[b, j]`` is 1 when ``padding``)."""

    causal: bool
    window: int | None
    padding: bool

    def describe(self) -> str:
        parts = ["causal" if self.causal else "bidirectional"]
        if self.window:
            parts.append(f"window {self.window}")
        parts.append("padding" if self.padding else "no padding")
        return ", ".join(parts)


def subgraph(g: Graph, value: str) -> tuple[list[onnx.NodeProto], set[str], set[str]]:
    """The nodes computing ``value`` (graph order), the initializers they read and the graph inputs they need."""
    needed, stack, inits, inputs = set(), [value], set(), set()
    while stack:
        v = stack.pop()
        if v in needed or not v:
            continue
        needed.add(v)
        if v in g.initializers:
            inits.add(v)
        elif v in g.graph_inputs:
            inputs.add(v)
        p = g.producer.get(v)
        if p is not None:
            stack.extend(p.input)
            for a in p.attribute:  # If / Loop bodies read outer values
                if a.type == onnx.AttributeProto.GRAPH:
                    stack.extend(i for n in a.g.node for i in n.input)
    nodes = [n for n in g.g.node if any(o in needed for o in n.output)]
    return nodes, inits, inputs


def evaluate(g: Graph, value: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator

    nodes, inits, inputs = subgraph(g, value)
    declared = {i.name: i for i in g.g.input}
    graph = helper.make_graph(nodes, "mask", [declared[i] for i in sorted(inputs)],
                              [helper.make_tensor_value_info(value, onnx.TensorProto.UNDEFINED, None)],
                              [onnx.numpy_helper.from_array(g.constant(i), i) for i in sorted(inits)])
    model = helper.make_model(graph, opset_imports=list(g.model.opset_import), functions=list(g.model.functions))
    model.ir_version = g.model.ir_version
    return ReferenceEvaluator(model).run(None, {k: feeds[k] for k in inputs})[0]


def _paddings(length: int) -> np.ndarray:
    """Rows: no padding, two on the left, two on the right."""
    mask = np.ones((3, length), np.int64)
    mask[1, :2] = 0
    mask[2, -2:] = 0
    return mask


def _allowed(result: np.ndarray, batch: int, queries: int) -> np.ndarray:
    """A boolean (B, S, T) view of a boolean or additive mask (B|1, H|1, S|1, T); NoMatch when it is not one."""
    if result.dtype != np.bool_:
        finite = result[np.isfinite(result)]
        if finite.size and not np.all((finite == 0) | (finite <= _NEG)):
            raise NoMatch("the additive mask carries values other than 0 and -inf (a position bias)")
        result = result > _NEG
    if result.ndim != 4:
        raise NoMatch(f"the mask is {result.ndim}-D, not (batch, heads, queries, keys)")
    if result.shape[1] > 1 and not np.all(result == result[:, :1]):
        raise NoMatch("the mask differs between heads")
    return np.broadcast_to(result[:, 0], (batch, queries, result.shape[3]))


def _candidate(kind: MaskKind, pad: np.ndarray, queries: int) -> np.ndarray:
    keys = pad.shape[1]
    i = np.arange(keys - queries, keys)[:, None]  # bottom-right aligned, as a cache would place them
    j = np.arange(keys)[None, :]
    allow = np.ones((queries, keys), bool)
    if kind.causal:
        allow &= j <= i
    if kind.window:
        allow &= (i - j) < kind.window
    out = np.broadcast_to(allow, (pad.shape[0], queries, keys))
    return out & pad.astype(bool)[:, None, :] if kind.padding else out


def _matches(allow: np.ndarray, kind: MaskKind, pad: np.ndarray) -> bool:
    queries = allow.shape[1]
    real = pad.astype(bool)[:, -queries:]  # only real queries' rows matter (a padding row's output is never read)
    want = _candidate(kind, pad, queries)
    return bool(np.all((allow == want) | ~real[:, :, None]))


def classify(g: Graph, mask: str | None, causal: bool, window_hint: int = 0,
             mask_input: str = "attention_mask") -> MaskKind:
    """The kind of ``mask`` (None: ``causal`` decides, with no padding), or NoMatch saying why it is none of them.
    Other inputs (``input_ids``, ``token_type_ids``) may give the mask their shape, never their values."""
    if mask is None:
        return MaskKind(causal, None, False)
    inputs = g.ancestors_inputs(mask)
    if mask_input not in inputs:
        raise NoMatch(f"the mask does not read {mask_input}")
    nodes, _, _ = subgraph(g, mask)
    others = inputs - {mask_input}
    for n in nodes:
        read = others.intersection(n.input)
        if read and n.op_type != "Shape":
            raise NoMatch(f"the mask depends on the values of {', '.join(sorted(read))}, not only on {mask_input}")
    declared = {i.name: i.type.tensor_type for i in g.g.input}
    if any(len(declared[i].shape.dim) != 2 for i in others):
        raise NoMatch(f"the mask reads the shape of {', '.join(sorted(others))}, which are not (batch, sequence)")
    long = window_hint + 3 if 0 < window_hint <= WINDOW_PROBE_LIMIT else 0
    kinds = []
    for length in sorted({PROBE_LENGTH, PROBE_LENGTH + 5, long} - {0}):
        pad = _paddings(length)
        try:
            shaped = {i: np.ones(pad.shape, onnx.helper.tensor_dtype_to_np_dtype(declared[i].elem_type)) for i in others}
            result = evaluate(g, mask, {mask_input: pad, **shaped})
        except Exception as e:  # an op the reference evaluator lacks, a shape it cannot take
            raise NoMatch(f"the mask could not be evaluated ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        kind = _kind_at(_allowed(np.asarray(result), pad.shape[0], length), pad)
        if kind is None:
            raise NoMatch(f"the mask is not causal, sliding-window or padding-only at length {length} (a custom mask)")
        kinds.append(kind)
    if len({(k.causal, k.padding) for k in kinds}) > 1 or len({k.window for k in kinds} - {None}) > 1:
        raise NoMatch("the mask changes kind with the sequence length")
    window = next((k.window for k in kinds if k.window), None)
    if window is None and kinds[0].causal and window_hint > WINDOW_PROBE_LIMIT:
        window = window_hint  # too long to probe: taken as declared
    return MaskKind(kinds[0].causal, window, kinds[0].padding)


def _kind_at(allow: np.ndarray, pad: np.ndarray) -> MaskKind | None:
    for causal in (True, False):
        for padding in (True, False):
            kind = MaskKind(causal, None, padding)
            if _matches(allow, kind, pad):
                return kind
    # a causal window: the unpadded row's last query sees exactly `window` keys
    seen = int(allow[0, -1].sum())
    if 0 < seen < allow.shape[2]:
        for padding in (True, False):
            kind = MaskKind(True, seen, padding)
            if _matches(allow, kind, pad):
                return kind
    return None
