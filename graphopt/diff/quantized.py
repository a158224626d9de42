"""Pairing through quantization: a float weight op of A with the integer op of B that replaced it.

Quantization renames weights and changes op types, so the structural matching of
:mod:`graphopt.diff.matching` finds nothing to anchor on: ``MatMul(x, W)`` of A became
``QuantizeLinear → MatMulIntegerToFloat(xq, W_q, ...)``, ``DynamicQuantizeLinear → MatMulInteger →
Cast → Mul``, ``DequantizeLinear(W_q) → MatMul``, ``MatMulNBits``, ``QAttention``, or a ``Gather`` of
an int8 table. Each weight op's weight is traced to its initializer (through ``DequantizeLinear``,
``Transpose``, ``Cast``, ``Reshape``); a B op whose weight is integer (or dequantized) is paired with an
unmatched A op of the same kind, in this order of evidence:

1. provenance: B's node lists an A op's output among the names it kept (``graphopt.kept``);
2. weight lineage: the name of B's node or weight continues the name of A's node or weight at a
   separator (``node_MatMul_3_packed_w_q`` continues ``node_MatMul_3``; ORT's quantizer writes
   ``W_quantized`` for ``W``), the longest such name wins, and the logical weight shapes agree;
3. shape: the ops still unpaired with the same logical weight shape (``K×N``; ``MatMulNBits``' from its
   attributes), in graph order, where both sides have as many.

The paired B op's float result (after the ``Cast``/``Mul`` that rescale an integer product) continues
A's output, or the output of the bias ``Add`` that follows A's op when B's op took the bias in.
"""

from __future__ import annotations

import collections

import onnx_ir as ir

from graphopt.analysis.params import QUANT_DTYPES
from graphopt.engine import provenance
from graphopt.opsets import MS_DOMAIN, node_domain

#: op -> input index of its weight
_WEIGHT_INPUT = {
    "MatMul": 1, "FusedMatMul": 1, "Gemm": 1, "MatMulInteger": 1, "MatMulIntegerToFloat": 1,
    "DynamicQuantizeMatMul": 1, "MatMulNBits": 1, "QLinearMatMul": 3, "QGemm": 3, "QAttention": 1,
    "Attention": 1, "Gather": 0, "GatherBlockQuantized": 0,
}
#: op -> the kind of weight op it is (pairs form within a kind)
_KIND = {"Attention": "attention", "QAttention": "attention", "Gather": "gather", "GatherBlockQuantized": "gather"}
_INTEGER_OPS = {"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulNBits", "QLinearMatMul",
                "QGemm", "QAttention", "GatherBlockQuantized"}
#: ops between a weight initializer and the op reading it
_SEE_THROUGH = {"DequantizeLinear", "Transpose", "Cast", "Identity", "Reshape"}
#: ops that rescale an integer product to float (MatMulInteger -> Cast -> Mul)
_RESCALE = {"Cast", "Mul"}
_SEPARATORS = "_./:"


class _Weight:
    """A weight op's weight: the initializer it comes from, its logical shape, whether it is quantized."""

    def __init__(self, init: ir.Value, shape: tuple[int, ...] | None, quantized: bool, names: list[str]):
        self.init, self.shape, self.quantized, self.names = init, shape, quantized, names


def _trace(node: ir.Node) -> _Weight | None:
    idx = _WEIGHT_INPUT.get(node.op_type)
    if idx is None or len(node.inputs) <= idx or node.inputs[idx] is None:
        return None
    if node.op_type == "Attention" and node_domain(node) != MS_DOMAIN:
        return None
    v = node.inputs[idx]
    quantized = node.op_type in _INTEGER_OPS
    names = [node.name] if node.name else []
    perm: list[int] | None = None
    for _ in range(8):
        if v.const_value is not None or v.is_initializer():
            break
        p = v.producer()
        if p is None or p.op_type not in _SEE_THROUGH or not p.inputs or p.inputs[0] is None:
            return None
        if p.op_type == "DequantizeLinear":
            quantized = True
        if p.op_type == "Transpose":
            a = p.attributes.get("perm")
            perm = list(a.value) if a is not None else "reverse"  # type: ignore[assignment]
        if p.name:
            names.append(p.name)
        v = p.inputs[0]
    t = v.const_value
    if t is None:
        return None
    if t.dtype in QUANT_DTYPES:
        quantized = True
    elif not t.dtype.is_floating_point() and not quantized:
        return None  # a shape or index table, no weight
    shape: tuple[int, ...] | None = tuple(int(d) for d in t.shape)
    if perm == "reverse":
        shape = shape[::-1]
    elif perm is not None and len(perm) == len(shape):
        shape = tuple(shape[i] for i in perm)
    if node.op_type == "MatMulNBits":
        k, n = node.attributes.get("K"), node.attributes.get("N")
        shape = (int(k.value), int(n.value)) if k is not None and n is not None else None
    elif node.op_type in ("Gemm", "QGemm") and shape is not None and len(shape) == 2:
        tb = node.attributes.get("transB")
        if tb is not None and tb.value:
            shape = shape[::-1]
    names.append(v.name or "")
    return _Weight(v, shape, quantized, [n for n in names if n])


def _kind(node: ir.Node) -> str:
    return _KIND.get(node.op_type, "matmul")


def _continues(b_name: str, a_name: str) -> bool:
    return b_name == a_name or (b_name.startswith(a_name) and b_name[len(a_name)] in _SEPARATORS)


def pair_quantized(a_nodes: list[ir.Node], b_nodes: list[ir.Node]) -> dict[int, int]:
    """B index -> A index of the quantized B weight ops and the float A ops they replaced (module doc).

    A ops whose float weight B still has (kept float: the structural matching pairs them) take no part.
    """
    a_all = {i: w for i, n in enumerate(a_nodes) if (w := _trace(n)) is not None and not w.quantized}
    b_all = {j: w for j, n in enumerate(b_nodes) if (w := _trace(n)) is not None}
    a_names = {w.init.name for w in a_all.values()}
    b_names = {w.init.name for w in b_all.values()}
    # B ops on a weight A does not have (quantized, or folded into a new float tensor), and A ops
    # whose weight B no longer has; the rest pair structurally
    a_w = {i: w for i, w in a_all.items() if w.init.name not in b_names}
    b_w = {j: w for j, w in b_all.items() if w.init.name not in a_names}
    if not a_w or not b_w:
        return {}
    free = set(a_w)
    out: dict[int, int] = {}

    def fits(j: int, i: int) -> bool:
        wa, wb = a_w[i], b_w[j]
        return (i in free and _kind(a_nodes[i]) == _kind(b_nodes[j])
                and (wa.shape is None or wb.shape is None or wa.shape[-2:] == wb.shape[-2:]))

    def take(j: int, i: int) -> None:
        out[j] = i
        free.discard(i)

    # 1. provenance: the A outputs B's node says it continues
    a_by_out = {v.name: i for i, n in enumerate(a_nodes) if i in a_w for v in n.outputs if v.name}
    for j in b_w:
        for name in provenance.kept_names(b_nodes[j]) or ():
            i = a_by_out.get(name)
            if i is not None and fits(j, i):
                take(j, i)
                break
    # 2. weight lineage by name
    a_by_name: dict[str, list[int]] = collections.defaultdict(list)
    for i, w in a_w.items():
        for name in dict.fromkeys([*w.names, a_nodes[i].name or ""]):
            if name:
                a_by_name[name].append(i)
    for j, w in b_w.items():
        if j in out:
            continue
        best: tuple[int, int] | None = None
        for b_name in w.names:
            for k in range(len(b_name), 0, -1):
                if k < len(b_name) and b_name[k] not in _SEPARATORS:
                    continue
                hits = [i for i in a_by_name.get(b_name[:k], ()) if fits(j, i)]
                if hits and (best is None or k > best[0]):
                    best = (k, hits[0])
                if hits:
                    break
        if best is not None:
            take(j, best[1])
    # 3. shape, in graph order, where the counts agree
    by_shape_a: dict[tuple, list[int]] = collections.defaultdict(list)
    by_shape_b: dict[tuple, list[int]] = collections.defaultdict(list)
    for i in sorted(free):
        if a_w[i].shape is not None:
            by_shape_a[(_kind(a_nodes[i]), a_w[i].shape[-2:])].append(i)
    for j in sorted(b_w):
        if j not in out and b_w[j].shape is not None:
            by_shape_b[(_kind(b_nodes[j]), b_w[j].shape[-2:])].append(j)
    for key, js in by_shape_b.items():
        if len(by_shape_a.get(key, ())) == len(js):
            for j, i in zip(js, by_shape_a[key], strict=True):
                take(j, i)
    return out


def describe(na: ir.Node, nb: ir.Node) -> list[str]:
    """What changed between A's float op and the quantized B op paired with it."""
    wa, wb = _trace(na), _trace(nb)
    out = []
    if na.op_type != nb.op_type or node_domain(na) != node_domain(nb):
        out.append(f"{na.op_type} became {nb.op_type}")
    if wa is not None and wb is not None:
        how = f"quantized to {wb.init.const_value.dtype.name}" if wb.quantized else "became"
        out.append(f"weight {wa.init.name!r} {how} {wb.init.name!r}")
    return out


def result_pairs(na: ir.Node, nb: ir.Node) -> list[tuple[ir.Value, ir.Value]]:
    """(B value, A value) pairs the quantized op continues: its float result and A's output (module doc)."""
    if not na.outputs or not nb.outputs:
        return []
    vb = nb.outputs[0]
    for _ in range(3):  # an integer product rescaled to float: MatMulInteger -> Cast -> Mul
        if vb.dtype is None or vb.dtype.is_floating_point():
            break
        users = [u for u, _ in vb.uses()]
        if len(users) != 1 or users[0].op_type not in _RESCALE:
            return []
        vb = users[0].outputs[0]
        if users[0].op_type == "Mul":
            break
    va = na.outputs[0]
    bias_in = {"MatMulIntegerToFloat": 6, "QAttention": 2, "MatMulNBits": 5, "QGemm": 6}.get(nb.op_type)
    if bias_in is not None and len(nb.inputs) > bias_in and nb.inputs[bias_in] is not None and na.op_type != "Attention":
        users = [u for u, _ in va.uses()]
        if len(users) == 1 and users[0].op_type == "Add":
            other = [x for x in users[0].inputs if x is not va]
            if other and other[0] is not None and (other[0].const_value is not None or other[0].is_initializer()):
                va = users[0].outputs[0]
    return [(vb, va)]


def _float_source(v: ir.Value | None) -> ir.Value | None:
    """The float tensor a quantized activation was made from: through QuantizeLinear and a
    SmoothQuant scaling (a ``Mul`` by a constant that a quantize pass made)."""
    for _ in range(3):
        p = v.producer() if v is not None else None
        if p is None or not p.inputs:
            return v
        if p.op_type in ("QuantizeLinear", "DynamicQuantizeLinear"):
            v = p.inputs[0]
        elif (p.op_type == "Mul" and any("quantize" in c for c in provenance.chain_of(p))
              and any(x is not None and x.const_value is not None for x in p.inputs)):
            v = next(x for x in p.inputs if x is not None and x.const_value is None)
        else:
            return v
    return v


def input_pairs(na: ir.Node, nb: ir.Node) -> list[tuple[ir.Value, ir.Value]]:
    """(B value, A value): the float activation B's op quantized, and A's op's activation input."""
    if _kind(na) == "gather" or not na.inputs or not nb.inputs:
        return []
    vb = _float_source(nb.inputs[0])
    va = na.inputs[0]
    if vb is None or va is None or (vb.dtype is not None and not vb.dtype.is_floating_point()):
        return []
    return [(vb, va)]
