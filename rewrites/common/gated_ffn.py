"""Gated (SwiGLU) FFN blocks of decoders and their weight projections, shared by passes that cut them up.

    X ──proj(gate)──▶ g ──Sigmoid──▶ s;  Mul(g, s) ──▶ silu ─┐
    X ──proj(up)────▶ u ─────────────────────────────────────Mul──▶ A ──proj(down)──▶ Y

A projection ``proj`` is one of (:class:`Projection`):

- ``matmul``: ``MatMul(x, W const float32 [K, N])``;
- ``nbits``: ``com.microsoft MatMulNBits(x, q [N, K/bs, bs/2] uint8, scales, zero points?)`` with 4-bit
  blocks of ``bs`` along K;
- ``nbits+mins``: the exact form of 4-bit affine blocks (``w = d·q + m``, a GGUF Q4_1 export):
  ``Add(MatMulNBits(x, q, d, zero points 0), MatMul(ReduceSum(Reshape(x, [.., K/bs, bs]), -1), mins [K/bs, N]))``.

A projection can be cut to a subset of its output columns (any set) or of its input rows (whole blocks of
``bs`` for the 4-bit forms) and written back as new nodes (:meth:`Projection.emit`); :meth:`Projection.dense`
is its float32 ``[K, N]`` weight (dequantized), for calibration in numpy. Every intermediate value of the
block must be read only inside it, else the block is skipped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, node_domain


def _const(v: ir.Value | None) -> np.ndarray | None:
    return None if v is None or v.const_value is None else v.const_value.numpy()


def _only_reader(v: ir.Value) -> ir.Node | None:
    uses = list(v.uses())
    if len(uses) != 1 or v.is_graph_output():
        return None
    return uses[0][0]


def _unpack4(packed: np.ndarray, n: int) -> np.ndarray:
    """uint8 pairs (low nibble first) to ``n`` values per row."""
    lo, hi = packed & 0xF, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)[:, :n]


def _pack4(vals: np.ndarray) -> np.ndarray:
    if vals.shape[1] % 2:
        vals = np.concatenate([vals, np.zeros((vals.shape[0], 1), vals.dtype)], axis=1)
    return (vals[:, 0::2] | (vals[:, 1::2] << 4)).astype(np.uint8)


@dataclasses.dataclass
class Projection:
    """One weight projection ``x -> y`` (see the module docstring) and the nodes it is made of."""

    kind: str  # "matmul" | "nbits" | "nbits+mins"
    x: ir.Value
    y: ir.Value
    nodes: tuple[ir.Node, ...]
    K: int
    N: int
    block: int = 0
    level: int = 0
    w: np.ndarray | None = None  # matmul: [K, N]
    q: np.ndarray | None = None  # nbits: [N, K/bs, bs/2]
    scales: np.ndarray | None = None  # [N, K/bs]
    zp: np.ndarray | None = None  # [N, K/bs] unpacked 4-bit values (None: the default 8)
    mins: np.ndarray | None = None  # [K/bs, N]

    @property
    def unit(self) -> int:
        """The smallest run of input rows a cut along K keeps whole."""
        return self.block or 1

    def dense(self) -> np.ndarray:
        """The float32 weight ``[K, N]`` this projection multiplies by."""
        if self.kind == "matmul":
            return self.w
        nb = self.K // self.block
        q = _unpack4(self.q.reshape(self.N, -1), self.K).reshape(self.N, nb, self.block).astype(np.float32)
        zp = np.full((self.N, nb), 8.0, np.float32) if self.zp is None else self.zp.astype(np.float32)
        w = (q - zp[..., None]) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins.T[..., None]
        return np.ascontiguousarray(w.reshape(self.N, self.K).T)

    def cut(self, *, cols: np.ndarray | None = None, rows: np.ndarray | None = None) -> Projection:
        """A projection of the output columns ``cols`` and/or the input rows ``rows`` (sorted; for the
        4-bit forms ``rows`` must be whole blocks)."""
        p = dataclasses.replace(self, nodes=())
        if cols is not None:
            p.N = len(cols)
            if p.kind == "matmul":
                p.w = p.w[:, cols]
            else:
                p.q, p.scales = p.q[cols], p.scales[cols]
                p.zp = None if p.zp is None else p.zp[cols]
                p.mins = None if p.mins is None else p.mins[:, cols]
        if rows is not None:
            p.K = len(rows)
            if p.kind == "matmul":
                p.w = p.w[rows]
            else:
                blocks = rows.reshape(-1, p.block)[:, 0] // p.block
                if not np.array_equal(rows, (blocks[:, None] * p.block + np.arange(p.block)).reshape(-1)):
                    raise ValueError("a 4-bit projection is cut along K in whole blocks only")
                p.q, p.scales = p.q[:, blocks], p.scales[:, blocks]
                p.zp = None if p.zp is None else p.zp[:, blocks]
                p.mins = None if p.mins is None else p.mins[blocks]
        return p

    def concat(self, other: Projection) -> Projection:
        """One projection of both output column sets, ``self``'s first (same input, kind and blocks)."""
        if (other.kind, other.K, other.block) != (self.kind, self.K, self.block):
            raise ValueError("projections of different kinds or shapes do not concatenate")
        p = dataclasses.replace(self, nodes=(), N=self.N + other.N)

        def cat(a, b, axis=0):
            return None if a is None else np.concatenate([a, b], axis=axis)

        if p.kind == "matmul":
            p.w = cat(self.w, other.w, 1)
        else:
            p.q, p.scales, p.zp = cat(self.q, other.q), cat(self.scales, other.scales), cat(self.zp, other.zp)
            p.mins = cat(self.mins, other.mins, 1)
        return p

    def block_sums(self, x: ir.Value, graph: ir.Graph, prefix: str) -> tuple[list[ir.Node], ir.Value]:
        """Nodes of ``ReduceSum(Reshape(x, [.., K/bs, bs]), -1)`` (the exact form's correction input)."""
        rank = len(x.shape) if x.shape is not None else 3
        shape = init_value(graph, f"{prefix}_block_shape",
                            np.array([0] * (rank - 1) + [self.K // self.block, self.block], np.int64))
        blocks = ir.node("Reshape", [x, shape], name=f"{prefix}_blocks")
        sums = ir.node("ReduceSum", [blocks.outputs[0], init_value(graph, f"{prefix}_block_axis",
                                                                     np.array([-1], np.int64))],
                       {"keepdims": 0}, name=f"{prefix}_block_sums")
        return [blocks, sums], sums.outputs[0]

    def emit(self, x: ir.Value, graph: ir.Graph, prefix: str, sums: ir.Value | None = None
             ) -> tuple[list[ir.Node], ir.Value]:
        """Nodes computing this projection of ``x``, constants registered in ``graph``; (nodes, output).
        ``sums``: the block sums of ``x`` already computed (:meth:`block_sums`), for the exact form."""

        def init(arr: np.ndarray, suffix: str) -> ir.Value:
            return init_value(graph, f"{prefix}_{suffix}", arr)

        if self.kind == "matmul":
            node = ir.node("MatMul", [x, init(self.w, "w")], name=f"{prefix}_matmul")
            return [node], node.outputs[0]
        ins = [x, init(self.q, "q4"), init(self.scales.reshape(-1), "scales")]
        if self.zp is not None:
            ins.append(init(_pack4(self.zp.astype(np.uint8)).reshape(-1), "zero_points"))
        mm = ir.node("MatMulNBits", ins, {"K": self.K, "N": self.N, "bits": 4, "block_size": self.block,
                                         "accuracy_level": self.level}, domain=MS_DOMAIN, name=f"{prefix}_nbits")
        if self.mins is None:
            return [mm], mm.outputs[0]
        pre: list[ir.Node] = []
        if sums is None:
            pre, sums = self.block_sums(x, graph, prefix)
        corr = ir.node("MatMul", [sums, init(self.mins, "mins")], name=f"{prefix}_min_correction")
        add = ir.node("Add", [mm.outputs[0], corr.outputs[0]], name=f"{prefix}_add")
        return [mm, *pre, corr, add], add.outputs[0]


def init_value(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    """The constant ``arr`` registered in ``graph`` as the initializer ``name``."""
    arr = np.ascontiguousarray(arr)
    v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                 const_value=ir.tensor(arr, name=name))
    graph.register_initializer(v)
    return v


def projection(y: ir.Value) -> Projection | None:
    """The projection producing ``y``, or None."""
    node = y.producer()
    if node is None:
        return None
    dom = node_domain(node)
    if node.op_type == "MatMul" and dom == "":
        w = _const(node.inputs[1])
        if w is None or w.ndim != 2 or w.dtype != np.float32:
            return None
        return Projection("matmul", node.inputs[0], y, (node,), int(w.shape[0]), int(w.shape[1]), w=w)
    if node.op_type == "MatMulNBits" and dom == MS_DOMAIN:
        return _nbits(node, y)
    if node.op_type == "Add" and dom == "":
        a, b = (i.producer() if i is not None else None for i in node.inputs)
        for mm, corr in ((a, b), (b, a)):
            if mm is None or corr is None or mm.op_type != "MatMulNBits" or corr.op_type != "MatMul":
                continue
            p = _nbits(mm, y)
            sums = corr.inputs[0].producer()
            blocks = sums.inputs[0].producer() if sums is not None and sums.op_type == "ReduceSum" else None
            mins = _const(corr.inputs[1])
            if p is None or blocks is None or blocks.op_type != "Reshape" or blocks.inputs[0] is not p.x \
                    or mins is None or mins.shape != (p.K // p.block, p.N):
                continue
            # the block sums may be shared with a sibling projection of the same x (cleanup's CSE)
            if any(_only_reader(v) is None for v in (mm.outputs[0], corr.outputs[0])):
                continue
            p.kind, p.mins, p.nodes = "nbits+mins", mins, (mm, blocks, sums, corr, node)
            return p
    return None


def _nbits(node: ir.Node, y: ir.Value) -> Projection | None:
    at = node.attributes
    if at.get_int("bits", 4) != 4 or len(node.inputs) > 4 or (len(node.inputs) == 4 and node.inputs[3] is None):
        return None
    k, n, bs = at.get_int("K"), at.get_int("N"), at.get_int("block_size")
    q, sc = _const(node.inputs[1]), _const(node.inputs[2])
    zp = _const(node.inputs[3]) if len(node.inputs) > 3 else None
    if q is None or sc is None or k % bs or sc.dtype != np.float32 or (len(node.inputs) > 3 and zp is None) \
            or (zp is not None and zp.dtype != np.uint8):
        return None
    nb = k // bs
    zpu = None if zp is None else _unpack4(zp.reshape(n, -1), nb)
    return Projection("nbits", node.inputs[0], y, (node,), k, n, bs, at.get_int("accuracy_level", 0),
                      q=q.reshape(n, nb, bs // 2), scales=sc.reshape(n, nb), zp=zpu)


@dataclasses.dataclass
class GatedFFN:
    """One SwiGLU block: ``down(silu(gate(x)) * up(x))``."""

    gate: Projection
    up: Projection
    down: Projection
    act: tuple[ir.Node, ...]  # Sigmoid, Mul (silu), Mul (gate * up)

    @property
    def x(self) -> ir.Value:
        return self.gate.x

    @property
    def y(self) -> ir.Value:
        return self.down.y

    @property
    def width(self) -> int:
        return self.gate.N

    @property
    def hidden(self) -> int:
        return self.gate.K

    @property
    def nodes(self) -> tuple[ir.Node, ...]:
        """Every node of the block, once each (gate and up may share their block sums)."""
        return tuple({id(n): n for n in (*self.gate.nodes, *self.up.nodes, *self.act, *self.down.nodes)}.values())

    def closed(self) -> bool:
        """Whether every value made inside the block but its output is read only inside it."""
        inside = {id(n) for n in self.nodes}
        for n in self.nodes:
            for o in n.outputs:
                if o is self.y:
                    continue
                if o.is_graph_output() or any(id(u) not in inside for u, _ in o.uses()):
                    return False
        return True


#: the note of a pass that found no gated FFN to work on
NO_GATED_FFN_NOTE = "not applied: no gated FFN (gate/up projections → SiLU · up → down projection, constant weights)"


def find(model: ir.Model) -> list[GatedFFN]:
    """Every SwiGLU block of the main graph, in graph order."""
    out = []
    for sig in model.graph:
        if sig.op_type != "Sigmoid" or node_domain(sig) != "":
            continue
        g = sig.inputs[0]
        uses = [u for u, _ in g.uses()]
        silu = next((u for u in uses if u.op_type == "Mul" and set(u.inputs) == {g, sig.outputs[0]}), None)
        if silu is None or len(uses) != 2 or _only_reader(sig.outputs[0]) is not silu:
            continue
        mul = _only_reader(silu.outputs[0])
        if mul is None or mul.op_type != "Mul":
            continue
        u = mul.inputs[1] if mul.inputs[0] is silu.outputs[0] else mul.inputs[0]
        down = _down(mul.outputs[0])
        gate, up = projection(g), projection(u)
        if gate is None or up is None or down is None or gate.x is not up.x or _only_reader(u) is not mul:
            continue
        if gate.N != up.N or down.K != gate.N or down.x is not mul.outputs[0] or gate.kind != up.kind:
            continue
        f = GatedFFN(gate, up, down, (sig, silu, mul))
        if f.closed():
            out.append(f)
    return out


def _down(a: ir.Value) -> Projection | None:
    """The projection reading ``a`` and nothing else reading it (MatMul, MatMulNBits, or its exact form)."""
    readers = [u for u, _ in a.uses()]
    if a.is_graph_output() or not readers:
        return None
    nb = [r for r in readers if r.op_type == "MatMulNBits"]
    if len(readers) == 1 and readers[0].op_type == "MatMul":
        return projection(readers[0].outputs[0])
    if len(nb) != 1:
        return None
    nxt = _only_reader(nb[0].outputs[0])
    p = projection(nxt.outputs[0]) if nxt is not None and nxt.op_type == "Add" else None
    if p is None:
        p = projection(nb[0].outputs[0])
    if p is None or {id(r) for r in readers} - {id(n) for n in p.nodes}:
        return None
    return p
