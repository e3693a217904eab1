"""Blocked weight-only quantization: MatMul with a constant weight -> ``com.microsoft.MatMulNBits``.

Each output column's weights are split into blocks of ``block_size`` along the input dimension K, and
every block gets its own scale: one large weight spends the resolution of its block only. At run time
ONNX Runtime's CPU kernel with ``accuracy_level`` 4 quantizes the activations to int8 per row and block
as well, so the few huge activation channels of small LLMs cost the blocks they
sit in, not the whole tensor as ``DynamicQuantizeMatMul``'s one per-tensor activation scale does.

Grid (symmetric, the kernel's default zero point 2^(bits-1)): the block's largest-magnitude weight maps
exactly to the most negative code (the scale carries the sign), as ONNX Runtime's own RTN quantizer does;
this uses all 2^bits codes and keeps the extreme weight exact. A tied lm_head (``MatMul(h, Transpose(E))``)
is quantized from E's transpose; the embedding Gather keeps reading E in FP32.

Codes are packed low bits first along K into (N, k_blocks, block_size * bits / 8) bytes; scales are
(N, k_blocks). The math and the codes store live in ``kiln.passes.codes`` (shared with the solvers and kiln's kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kiln.passes.weights import maybe_spill
from kiln.passes.base import NoMatch, Pass, PassResult, Progress, Reason
from kiln.passes.codes import (BITS, GRIDS, GROUP_SIZE, PROMOTED, Codebook, Quantized, half_scales, pack, pack_zeros,
                               rtn)
from kiln.passes.fuse_moe import SWIGLU, deinterleave, interleave
from kiln.passes.graph import MS_DOMAIN, Graph, attr
from kiln.passes.quantize_int8 import MIN_INNER, matmul_weight, quantizable_matrix

PART_BYTES = 32 << 20
"""MatMulNBits weights whose packed codes exceed this are lowered as several MatMulNBits over slices of the outputs
(each under it), concatenated. ONNX Runtime's CPU kernel prepacks each weight into its own layout while the original
is still in memory, so the largest weight's two copies set a session's peak: the 1.1B INT4 artifact's INT8 lm_head
(100 MB) took load RSS from 0.99 to 1.08 GiB; in four parts the peak is 1.00 GiB. One row of logits is a Concat."""


def int_tensor(name: str, values: np.ndarray, bits: int) -> onnx.TensorProto:
    """A signed INT4 (two values a byte, low nibble first, row-major) or INT8 initializer from int8 values."""
    t = onnx.TensorProto(name=name, dims=list(values.shape))
    if bits == 8:
        t.data_type, t.raw_data = TensorProto.INT8, values.astype(np.int8).tobytes()
        return t
    flat = (values.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    t.data_type, t.raw_data = TensorProto.INT4, pack(flat, 4).tobytes()
    return t


def blockwise_weight(g: Graph, node: onnx.NodeProto, min_elements: int) -> np.ndarray | None:
    """The (K, N) weight of a MatMul this pass takes: a constant (``matmul_weight``'s rule), or the transpose of
    one (a tied lm_head: ``MatMul(h, Transpose(embedding))``, whose transpose is too large to be folded)."""
    w = matmul_weight(g, node, min_elements)
    if w is not None or node.op_type != "MatMul":
        return w
    tr = g.producer.get(node.input[1])
    if tr is None or tr.op_type != "Transpose" or list(attr(tr, "perm", [1, 0])) != [1, 0] or g.routes(node.output[0]):
        return None
    t = g.constant(tr.input[0])
    w = t.T if t is not None else None
    return w if quantizable_matrix(w, min_elements) else None


def weights(model: onnx.ModelProto, min_elements: int = 1024) -> list[str]:
    """Every weight this pass can quantize (its MatMul's second input), in graph order: for the budget."""
    g = Graph(model)
    return [n.input[1] for n in g.g.node if blockwise_weight(g, n, min_elements) is not None]


class QuantizeBlockwise(Pass):
    """Weights -> ``MatMulNBits`` (``bits`` 4 or 8, one scale per ``block_size`` inputs of each column), or on
    the ``dequantize`` form (TensorRT) blocked ``DequantizeLinear`` (opset 21) feeding the MatMul.

    ``given``: codes computed elsewhere (GPTQ, an imported checkpoint), packed as they are.
    Other weights are rounded to nearest on ``grid``. ``head_bits``: the lm_head (the MatMul whose output is a
    graph output, through a bias or a scaling at most, or whose weight is the transpose of the embedding table): None as the rest, 0 keeps FP32.
    ``embedding_bits``: the token-embedding Gather's table -> ``GatherBlockQuantized`` (0: kept FP32; CPU form)."""

    name = "quantize-nbits"

    def __init__(self, bits: int = 8, block_size: int = GROUP_SIZE, accuracy_level: int = 4, keep_fp32: tuple[str, ...] = (),
                 min_elements: int = 1024, grid: str = "signed", given: Codebook | None = None,
                 head_bits: int | None = None, head_block_size: int = 32, embedding_bits: int = 0,
                 form: str = "matmulnbits", promote_int8: tuple[str, ...] = ()) -> None:
        for b, bs in ((bits, block_size), (head_bits or bits, head_block_size)):
            if b not in BITS or (bs != 0 and (bs < 16 or bs & (bs - 1))):
                raise ValueError(f"MatMulNBits takes bits {BITS} and a power-of-two block size >= 16 "
                                 f"(or 0: one block per row; got {b} bits, block {bs})")
        if grid not in GRIDS or form not in ("matmulnbits", "dequantize") or embedding_bits not in (0, *BITS):
            raise ValueError(f"grid {grid!r} / form {form!r} / embedding bits {embedding_bits} unknown")
        if form == "dequantize" and grid != "positive":
            raise ValueError("the DequantizeLinear form takes the positive symmetric grid only (TensorRT)")
        self.bits, self.block_size, self.accuracy_level = bits, block_size, accuracy_level
        self.keep_fp32, self.promote_int8 = set(keep_fp32), set(promote_int8)
        self.min_elements, self.grid, self.form = min_elements, grid, form
        self.given = given if given is not None else Codebook()
        self.head_bits, self.head_block_size, self.embedding_bits = head_bits, head_block_size, embedding_bits

    def run(self, model: onnx.ModelProto) -> PassResult:
        g = Graph(model)
        stats = {"quantized": 0, "kept_fp32": 0, "bits": self.bits, "block_size": self.block_size, "grid": self.grid,
                 "given": 0, "act_order_gathers": 0, "head": None, "embedding": None}
        skipped = []
        opset = next((o.version for o in g.model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if self.form == "dequantize" and opset < 21:
            return PassResult(g.model, False, stats, [Reason("graph", f"opset {opset}: blocked DequantizeLinear needs "
                                                                     "opset 21 or later (compile with --opset 21+)")])
        tables = self._tables(g)
        ends = {g.before_scaling(o.name) for o in g.g.output}  # what a head writes: an output, or before its bias / scaling
        plans = []  # (matmul, its prepared initializers): every decision before the first change
        shared: dict[str, int] = {}  # table -> the plan of its tied head, whose codes the embedding reads too
        handles = g.nodes_of("MatMul")
        progress = Progress("quantize-nbits: weights", len(handles))
        for i, handle in enumerate(handles):
            progress.step(i)
            mm = g.node(handle)
            where = mm.name or handle
            w = blockwise_weight(g, mm, self.min_elements)
            if w is None:
                skipped.append(Reason(where, "second input is not a constant FP32 matrix of at least "
                                             f"{self.min_elements} elements: nothing to quantize"))
                continue
            tr = g.producer.get(mm.input[1])
            head = mm.output[0] in ends or (tr is not None and tr.op_type == "Transpose" and tr.input[0] in tables)
            fp32 = "accuracy budget" if mm.input[1] in self.keep_fp32 else \
                "--lm-head fp32" if head and self.head_bits == 0 else None
            if fp32:  # before a promotion: the budget never lowers a weight the options keep FP32
                stats["kept_fp32"] += 1
                stats["head"] = "fp32" if head else stats["head"]
                skipped.append(Reason(where, f"weight {mm.input[1]} kept in FP32 ({fp32})"))
                continue
            q = None if mm.input[1] in self.promote_int8 else self.given.find(w)
            if mm.input[1] in self.promote_int8:
                q = rtn(w, *PROMOTED, self.grid)
                stats["promoted_int8"] = stats.get("promoted_int8", 0) + 1
            elif q is not None:
                stats["given"] += 1
                if q.bits != self.bits:  # a solver's mixed widths (gptq.Settings.more_bits)
                    stats["more_bits"] = stats.get("more_bits", 0) + 1
            elif head and self.head_bits is not None:
                q = rtn(w, self.head_bits, self.head_block_size, self.grid)
                if tr is not None and tr.input[0] in tables and self._shareable(q):
                    shared[tr.input[0]] = len(plans)
            else:
                q = rtn(w, self.bits, self.block_size, self.grid)
                stats["rounded"] = stats.get("rounded", 0) + 1
            if head:
                stats["head"] = f"int{q.bits}"
            if self.form == "dequantize" and q.zeros is not None:
                raise ValueError(f"{where}: the DequantizeLinear form takes symmetric codes only")
            # only the packed tensors are kept (spilled to disk when a weight store is open), never the FP32 weight
            plans.append((mm, self._prepare(g, mm, q)))
            del w, q
        moes = []  # (MoE, its QMoE, the QMoE's initializers, counts)
        for handle in g.nodes_of("MoE", MS_DOMAIN):
            node = g.node(handle)
            try:
                if self.form != "matmulnbits":
                    raise NoMatch("the DequantizeLinear form has no mixture-of-experts op")
                moes.append((node, *self._moe(g, node)))
            except NoMatch as e:
                skipped.append(Reason(node.name or handle, f"{e}: its experts stay FP32"))
        embeds = []  # (Gather, its GatherBlockQuantized): the table quantized now and dropped, as the weights are
        if self.embedding_bits and self.form == "matmulnbits":
            for node in tables.values():
                rows, cols = self._table_shape(g, node.input[0])
                if node.input[0] in shared and not plans[shared[node.input[0]]][1].rest:
                    embeds.append((node, self._shared_rows(g, node, plans[shared[node.input[0]]][1]), (), "int8"))
                    stats["embedding_shared"] = 1
                    stats.setdefault("embedding_tables", []).append([node.input[0], rows, cols])
                    continue
                if cols % self.head_block_size:  # the gathered rows would come back padded to whole blocks
                    skipped.append(Reason(node.name or node.input[0], f"embedding table of {cols} columns is not a "
                                          f"multiple of the {self.head_block_size}-wide block: it stays FP32"))
                    continue
                stats.setdefault("embedding_tables", []).append([node.input[0], rows, cols])
                q = rtn(g.constant(node.input[0]).T, self.embedding_bits, self.head_block_size, "signed")
                data = maybe_spill(numpy_helper.from_array(pack(q.codes, q.bits).reshape(q.codes.shape[0], -1),
                                                           g.fresh(f"{node.input[0]}_q{q.bits}")))
                scales = maybe_spill(numpy_helper.from_array(q.scales, g.fresh(f"{node.input[0]}_scales")))
                new = helper.make_node("GatherBlockQuantized", [data.name, node.input[1], scales.name],
                                       list(node.output), name=g.fresh("GatherBlockQuantized"), domain=MS_DOMAIN,
                                       bits=q.bits, block_size=q.block_size, gather_axis=0, quantize_axis=1)
                embeds.append((node, [new], (data, scales), f"int{q.bits}"))
                del q
        parts = [(p.codes, p.scales, p.zeros, p.perm, *(t for r in p.rest for t in (r.codes, r.scales, r.zeros)))
                 for _, p in plans]
        stored = sum(stored_bits(*t) for t in parts) + sum(stored_bits(*t) for _, _, t, _ in moes)
        weights_in = sum(p.k * p.n for _, p in plans) + sum(c["elements"] for *_, c in moes)
        if weights_in:  # what the quantized weights cost, scales and zero points included (not the embedding)
            stats["bits_per_weight"] = round(stored / weights_in, 3)
        for mm, prepared in plans:
            g.replace_nodes([mm], self._lower(g, mm, prepared, stats))
            stats["quantized"] += 1
        for node, new, tensors, counts in moes:
            g.g.initializer.extend(tensors)
            g.replace_nodes([node], [new])
            for key, n in counts.items():
                if key != "elements":
                    stats[key] = stats.get(key, 0) + n
        for node, new, tensors, kind in embeds:
            g.g.initializer.extend(tensors)
            g.replace_nodes([node], new)
            stats["embedding"] = kind
        if plans or embeds or moes:
            g.ensure_opset(MS_DOMAIN, 1)
            g.prune()
        return PassResult(g.model, bool(plans or embeds or moes), stats, skipped)

    def _shareable(self, q: Quantized) -> bool:
        """A tied head's codes are exactly what the embedding would get (``rtn`` of the same table, 8 bits, the same
        block, the signed grid) and can be gathered as whole rows: one copy of the table serves both."""
        return self.embedding_bits == 8 and q.bits == 8 and q.block_size == self.head_block_size and \
            self.grid == "signed" and q.zeros is None and q.perm is None and q.k % q.block_size == 0 and \
            self.form == "matmulnbits"

    @staticmethod
    def _shared_rows(g: Graph, node: onnx.NodeProto, head: Prepared) -> list[onnx.NodeProto]:
        """The embedding Gather over the tied head's own codes (N, blocks, block) and scales (N, blocks): the rows
        of the ids, (code - 128) * scale per block, flattened to the ids' shape + (K,). The same numbers
        GatherBlockQuantized computes from a copy (a small LLM's tied table: tens of MB not stored twice)."""
        ids = node.input[1]
        t = {k: g.fresh(f"{node.output[0]}_{k}") for k in ("codes", "float", "centered", "scales", "scale4", "rows",
                                                               "ids_shape", "shape")}
        mid = g.add_initializer("int8_zero", np.array(128.0, np.float32))
        last = g.add_initializer("minus_one", np.array([-1], np.int64))
        nodes: list[onnx.NodeProto] = []
        scales = float_scales(g, head.scales, nodes)
        return nodes + [
                helper.make_node("Gather", [head.codes.name, ids], [t["codes"]], name=g.fresh("SharedRows"), axis=0),
                helper.make_node("Cast", [t["codes"]], [t["float"]], name=g.fresh("SharedCast"), to=TensorProto.FLOAT),
                helper.make_node("Sub", [t["float"], mid], [t["centered"]], name=g.fresh("SharedCenter")),
                helper.make_node("Gather", [scales, ids], [t["scales"]], name=g.fresh("SharedScales"), axis=0),
                helper.make_node("Unsqueeze", [t["scales"], last], [t["scale4"]], name=g.fresh("SharedScale")),
                helper.make_node("Mul", [t["centered"], t["scale4"]], [t["rows"]], name=g.fresh("SharedDequantize")),
                helper.make_node("Shape", [ids], [t["ids_shape"]], name=g.fresh("SharedIdsShape")),
                helper.make_node("Concat", [t["ids_shape"], last], [t["shape"]], name=g.fresh("SharedShape"), axis=0),
                helper.make_node("Reshape", [t["rows"], t["shape"]], list(node.output), name=g.fresh("SharedFlat"))]

    def _moe(self, g: Graph, node: onnx.NodeProto) -> tuple[onnx.NodeProto, list[onnx.TensorProto], dict[str, int]]:
        """A ``MoE`` node (fuse-moe) -> ``QMoE`` over the same inputs: each expert's gate-up and down weights
        quantized as their MatMuls would have been (the solver's codes found by the FP32 weight, else rounded),
        rows in the node's layout (gate and up interleaved), one block size for both (the op takes one)."""
        fc1, fc2 = (g.constant(node.input[i]) if len(node.input) > i and node.input[i] else None for i in (2, 4))
        if fc1 is None or fc2 is None or fc1.dtype != np.float32 or any(
                len(node.input) > i and node.input[i] for i in (3, 5, 6, 7)):
            raise NoMatch("its experts are not constant FP32 weights without biases")
        if any(attr(node, a) != v for a, v in SWIGLU.items() if a != "activation_type") or \
                attr(node, "activation_type", b"").decode() != SWIGLU["activation_type"]:
            raise NoMatch("not the interleaved SwiGLU layout fuse-moe writes")
        router = g.producer.get(node.input[1])
        if attr(node, "normalize_routing_weights", 0) != 1 and (router is None or router.op_type != "Log"):
            # QMoE renormalises the top-k weights whatever the attribute says; over log(R) that changes nothing
            raise NoMatch("its routing is not renormalised and not log(R): QMoE always renormalises")
        hidden, inner = int(fc1.shape[2]), int(fc2.shape[2])
        block = self.block_size  # rounded experts narrower than a block take the widest power of two that fits
        while block > 16 and (hidden % block or inner % block) and not len(self.given):
            block //= 2
        if block == 0 or hidden % block or inner % block:
            raise NoMatch(f"expert widths {hidden} / {inner} are not whole blocks of {block}")
        counts = {"quantized": 0, "given": 0, "rounded": 0, "moe": 1, "elements": int(fc1.size + fc2.size)}
        tensors: list[onnx.TensorProto] = []
        inputs = {}
        same = lambda a: a  # noqa: E731
        # fc1's rows are interleaved in the node: de-interleaved to find the expert's weight, interleaved back after
        for fc, name, rows_of, order in ((fc1, "fc1", deinterleave, lambda a: interleave(*np.split(a, 2))),
                                         (fc2, "fc2", same, same)):
            codes, scales, zeros = [], [], []
            for e in range(fc.shape[0]):
                w = np.ascontiguousarray(rows_of(fc[e]).T)  # (K, N) as the expert's MatMul held it
                q = self.given.find(w)
                counts["given" if q is not None else "rounded"] += 1
                q = q if q is not None else rtn(w, self.bits, block, self.grid)
                if q.perm is not None or q.block_size != block or q.bits != self.bits or q.k % block:
                    raise NoMatch(f"expert {e}'s codes ({q.bits} bits, block {q.block_size}, act-order "
                                  f"{q.perm is not None}) are not {self.bits}-bit blocks of {block} in input order")
                codes.append(order(pack(q.codes, q.bits).reshape(q.codes.shape[0], -1)))
                scales.append(order(q.scales))
                zeros.append(None if q.zeros is None else pack_zeros(order(q.zeros), q.bits))
                counts["quantized"] += 1
            if len({z is None for z in zeros}) != 1:
                raise NoMatch(f"its {name} experts mix symmetric and asymmetric codes")
            base = f"{node.name or node.output[0]}_{name}"
            for role, arrays in (("q", codes), ("scales", scales), ("zero_points", zeros)):
                if arrays[0] is not None:
                    tensors.append(maybe_spill(numpy_helper.from_array(np.stack(arrays), g.fresh(f"{base}_{role}"))))
                    inputs[f"{name}_{role}"] = tensors[-1].name
        names = [node.input[0], node.input[1], inputs["fc1_q"], inputs["fc1_scales"], "", inputs["fc2_q"],
                 inputs["fc2_scales"], "", "", "", "", inputs.get("fc1_zero_points", ""), inputs.get("fc2_zero_points", "")]
        while names[-1] == "":
            names.pop()
        keep = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        new = helper.make_node("QMoE", names, list(node.output), name=node.name or g.fresh("QMoE"), domain=MS_DOMAIN,
                               **keep, expert_weight_bits=self.bits, block_size=block,
                               accuracy_level=self.accuracy_level)
        return new, tensors, counts

    def _tables(self, g: Graph) -> dict[str, onnx.NodeProto]:
        """Token-embedding Gathers: a constant 2-D FP32 table read along axis 0 at a graph input's indices, as given
        or only reshaped (some families flatten the ids to (-1, length) before the lookup)."""
        out = {}
        inputs = {i.name for i in g.g.input}
        for handle in g.nodes_of("Gather"):
            node = g.node(handle)
            if attr(node, "axis", 0) != 0 or self._ids_source(g, node.input[1]) not in inputs:
                continue
            init = g.initializers.get(node.input[0])
            if init is not None:  # judged by its dims and type: a streamed 128k x 4096 table is not read for this
                ok = init.data_type == TensorProto.FLOAT and len(init.dims) == 2 and \
                    init.dims[0] * init.dims[1] >= self.min_elements and init.dims[0] >= MIN_INNER
            else:
                ok = quantizable_matrix(g.constant(node.input[0]), self.min_elements)
            if ok:
                out[node.input[0]] = node
        return out

    @staticmethod
    def _table_shape(g: Graph, name: str) -> tuple[int, int]:
        """(rows, columns) of an embedding table, from its initializer's dims (not read) or its constant."""
        init = g.initializers.get(name)
        rows, cols = (init.dims[0], init.dims[1]) if init is not None else g.constant(name).shape
        return int(rows), int(cols)

    @staticmethod
    def _ids_source(g: Graph, value: str) -> str:
        """The value ``value`` reshapes (Reshape, Flatten, Squeeze, Unsqueeze, Identity: the same ids in another
        shape), followed to its origin; ``value`` itself when something else made it."""
        for _ in range(8):
            p = g.node(value)
            if p is None or p.domain not in ("", "ai.onnx") or \
                    p.op_type not in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
                return value
            value = p.input[0]
        return value

    def _prepare(self, g: Graph, mm: onnx.NodeProto, q: Quantized) -> Prepared:
        """The initializers one MatMul's lowering needs, made (and spilled) now; the graph is not touched."""
        base = mm.input[1]

        def tensor(suffix: str, array: np.ndarray) -> onnx.TensorProto:
            return maybe_spill(numpy_helper.from_array(array, g.fresh(f"{base}_{suffix}")))

        perm = tensor("perm", q.perm.astype(np.int64)) if q.perm is not None else None
        if self.form == "dequantize":
            # (K, N) signed int values along K in blocks: DequantizeLinear(axis 0, block_size), then the MatMul
            vals = (q.codes.astype(np.int16) - (1 << (q.bits - 1))).reshape(q.codes.shape[0], -1)[:, :q.k].T
            codes = maybe_spill(int_tensor(g.fresh(f"{base}_int{q.bits}"), vals.astype(np.int8), q.bits))
            scales = tensor("scales", np.ascontiguousarray(q.scales.T))
            zeros = None
        else:
            packed = pack(q.codes, q.bits)
            scale_type = np.float16 if half_scales(q.scales) else np.float32
            n = int(q.codes.shape[0])
            count = -(-packed.nbytes // PART_BYTES)
            rows = -(-n // count)
            parts = []
            for i, lo in enumerate(range(0, n, rows)):
                tag = f"_part{i}" if count > 1 else ""
                hi = min(n, lo + rows)
                parts.append(Part(tensor(f"q{q.bits}{tag}", packed[lo:hi]),
                                  tensor(f"scales{tag}", q.scales[lo:hi].astype(scale_type)),
                                  tensor(f"zero_points{tag}", pack_zeros(q.zeros[lo:hi], q.bits))
                                  if q.zeros is not None else None, hi - lo))
            return Prepared(parts[0].codes, parts[0].scales, parts[0].zeros, perm, q.bits, q.block_size, int(q.k), n,
                            tuple(parts[1:]))
        return Prepared(codes, scales, zeros, perm, q.bits, q.block_size, int(q.k), int(q.codes.shape[0]))

    def _lower(self, g: Graph, mm: onnx.NodeProto, p: Prepared, stats: dict) -> list[onnx.NodeProto]:
        for t in (p.codes, p.scales, p.zeros, p.perm):
            if t is not None:
                g.g.initializer.append(t)
        x = mm.input[0]
        nodes = []
        if p.perm is not None:  # act-order: the kernel reads the inputs in the solver's column order
            x = g.fresh(f"{mm.input[1]}_reordered")
            nodes.append(helper.make_node("Gather", [mm.input[0], p.perm.name], [x], name=g.fresh("Gather"), axis=-1))
            stats["act_order_gathers"] += 1
        if self.form == "dequantize":
            deq = g.fresh(f"{mm.input[1]}_dequantized")
            nodes += [helper.make_node("DequantizeLinear", [p.codes.name, p.scales.name], [deq],
                                       name=g.fresh("DequantizeLinear"), axis=0, block_size=p.block_size),
                      helper.make_node("MatMul", [x, deq], [mm.output[0]], name=mm.name or g.fresh("MatMul"))]
            return nodes
        parts = [Part(p.codes, p.scales, p.zeros, p.n - sum(r.n for r in p.rest)), *p.rest]
        outputs = [mm.output[0]] if len(parts) == 1 else [g.fresh(f"{mm.output[0]}_part{i}") for i in range(len(parts))]
        for part, out in zip(parts, outputs):
            scales = float_scales(g, part.scales, nodes)
            inputs = [x, part.codes.name, scales] + ([part.zeros.name] if part.zeros is not None else [])
            nodes.append(helper.make_node("MatMulNBits", inputs, [out], name=g.fresh("MatMulNBits"),
                                          domain=MS_DOMAIN, K=p.k, N=part.n, bits=p.bits, block_size=p.block_size,
                                          accuracy_level=self.accuracy_level))
        if len(parts) > 1:
            for t in (t for r in p.rest for t in (r.codes, r.scales, r.zeros) if t is not None):
                g.g.initializer.append(t)
            nodes.append(helper.make_node("Concat", outputs, [mm.output[0]], name=g.fresh("Concat"), axis=-1))
            stats["split"] = stats.get("split", 0) + 1
        return nodes


def float_scales(g: Graph, scales: onnx.TensorProto, nodes: list[onnx.NodeProto]) -> str:
    """The FP32 scales a kernel reads: the initializer itself, or a Cast of FP16 ones (appended to ``nodes``)."""
    if scales.data_type != TensorProto.FLOAT16:
        return scales.name
    out = g.fresh(f"{scales.name}_float")
    nodes.append(helper.make_node("Cast", [scales.name], [out], name=g.fresh("ScalesCast"), to=TensorProto.FLOAT))
    return out


def stored_bits(*tensors: onnx.TensorProto | None) -> int:
    """Bits the initializers take on disk, from their dims and type (spilled ones hold no raw data here)."""
    size = {TensorProto.UINT8: 8, TensorProto.INT8: 8, TensorProto.FLOAT: 32, TensorProto.FLOAT16: 16,
            TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.INT64: 64}
    return sum(int(np.prod(t.dims, dtype=np.int64)) * size[t.data_type] for t in tensors if t is not None)


@dataclass(frozen=True)
class Part:
    """A slice of a weight's outputs lowered on its own (``PART_BYTES``)."""

    codes: onnx.TensorProto
    scales: onnx.TensorProto
    zeros: onnx.TensorProto | None
    n: int


@dataclass(frozen=True)
class Prepared:
    """One weight's lowered initializers, made before the graph changes (``QuantizeBlockwise._prepare``): the first
    (or only) part's in ``codes`` / ``scales`` / ``zeros``, the other parts' in ``rest``."""

    codes: onnx.TensorProto
    scales: onnx.TensorProto
    zeros: onnx.TensorProto | None
    perm: onnx.TensorProto | None
    bits: int
    block_size: int
    k: int
    n: int
    rest: tuple[Part, ...] = ()
