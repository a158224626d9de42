"""The ``ai.graphopt`` custom ops: ONNX functions with standard-op bodies, attached to the model that uses them.

A stock ONNX Runtime (any build, any provider) runs them with nothing to register: the function body is
inlined at load. Each op is defined once here; :func:`attach` adds the functions a model uses and the
``ai.graphopt`` opset import.

``BlockSparseMatMul(X, W_blocks, block_index; block_size)`` — ``X @ W`` for a weight ``W[K, N]`` pruned to
balanced ``b x bn`` blocks (``b = block_size`` rows of K; ``bn``, the width of an output block column, is
``W_blocks``'s last dimension: square blocks or wider ones): every output block column ``j`` keeps the same
number ``kb`` of input blocks, ``block_index[j, :]`` (int64, ``[N/bn, kb]``), whose values are ``W_blocks[j]``
(``[N/bn, kb*b, bn]``)::

    X [.., K] ─Flatten─▶ [M, K] ─Reshape─▶ [M, K/b, b] ─Gather(axis 1, block_index)─▶ [M, N/bn, kb, b]
      ─Reshape─▶ [M, N/bn, kb*b] ─Transpose─▶ [N/bn, M, kb*b] ─MatMul(W_blocks)─▶ [N/bn, M, bn]
      ─Transpose─▶ [M, N/bn, bn] ─Reshape─▶ [.., N]

The reshape targets are constants (ORT folds them at load) but the last, which needs X's leading shape:
per call the body runs 7 kernels besides two small shape ops. Wider blocks mean fewer, larger GEMMs in the
batched MatMul: at 75% on MiniLM's FFN shapes, 32x128 blocks are ~2x dense at M = 1..128 where 32x32
blocks are 1.5-1.8x (docs/benchmarks.md).

``NMSparseMatMul(X, values, positions; n, m)`` — ``X @ W`` for ``W[K, N]`` with ``n`` of every ``m``
consecutive weights along K kept (2:4): ``values[K/m, n, N]`` (float) and ``positions[K/m, n, N]`` (uint8,
0..m-1). The body rebuilds the dense weight (OneHot · values, summed: exact, each slot gets one value plus
zeros) and runs one MatMul: a compact *storage* form, computed dense (no CPU kernel here skips the zeros).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

DOMAIN = "ai.graphopt"
VERSION = 1
#: the oldest standard opset the function bodies are valid in (Shape start/end); a body imports the model's own
#: default opset, as the ONNX checker requires
BODY_OPSET = 15


def _ints(t: ir.tape.Tape, values: list[int]) -> ir.Value:
    return t.op("Constant", [], attributes={"value": ir.tensor(np.asarray(values, np.int64))})


def _ref_int(t: ir.tape.Tape, attr: str) -> ir.Value:
    """A 1-D int64 tensor ``[attr]`` read from the calling node's attribute ``attr``."""
    scalar = t.op("Constant", [], attributes={"value_int": ir.RefAttr("value_int", attr, ir.AttributeType.INT)})
    return t.op("Unsqueeze", [scalar, _ints(t, [0])])


def block_sparse_matmul(opset: int = BODY_OPSET) -> ir.Function:
    """The function ``ai.graphopt::BlockSparseMatMul`` (see the module docstring)."""
    x = ir.Value(name="X")
    wb = ir.Value(name="W_blocks")
    idx = ir.Value(name="block_index")
    t = ir.tape.Tape()
    b = _ref_int(t, "block_size")
    x2 = t.op("Flatten", [x], attributes={"axis": -1})                          # [M, K]
    x3 = t.op("Reshape", [x2, t.op("Concat", [_ints(t, [0, -1]), b], attributes={"axis": 0})])  # [M, K/b, b]
    g = t.op("Gather", [x3, idx], attributes={"axis": 1})                       # [M, N/bn, kb, b]
    g2 = t.op("Reshape", [g, _ints(t, [0, 0, -1])])                              # [M, N/bn, kb*b]
    g3 = t.op("Transpose", [g2], attributes={"perm": [1, 0, 2]})                # [N/bn, M, kb*b]
    y3 = t.op("MatMul", [g3, wb])                                               # [N/bn, M, bn]
    y4 = t.op("Transpose", [y3], attributes={"perm": [1, 0, 2]})                # [M, N/bn, bn]
    lead = t.op("Shape", [x], attributes={"end": -1})
    y = t.op("Reshape", [y4, t.op("Concat", [lead, _ints(t, [-1])], attributes={"axis": 0})])
    y.name = "Y"
    graph = ir.Graph([x, wb, idx], [y], nodes=t.nodes, opset_imports={"": opset}, name="BlockSparseMatMul")
    return ir.Function(DOMAIN, "BlockSparseMatMul", graph=graph,
                       attributes=[ir.Attr("block_size", ir.AttributeType.INT, 32)])


def nm_sparse_matmul(opset: int = BODY_OPSET) -> ir.Function:
    """The function ``ai.graphopt::NMSparseMatMul`` (see the module docstring)."""
    x = ir.Value(name="X")
    vals = ir.Value(name="values")
    pos = ir.Value(name="positions")
    t = ir.tape.Tape()
    m = _ref_int(t, "m")
    p = t.op("Cast", [pos], attributes={"to": ir.DataType.INT64})
    onoff = t.op("Cast", [_ints(t, [0, 1])], attributes={"to": ir.DataType.FLOAT})
    oh = t.op("OneHot", [p, m, onoff], attributes={"axis": -1})                # [K/m, n, N, m]
    v = t.op("Unsqueeze", [vals, _ints(t, [-1])])                              # [K/m, n, N, 1]
    d = t.op("ReduceSum", [t.op("Mul", [oh, v]), _ints(t, [1])], attributes={"keepdims": 0})  # [K/m, N, m]
    d2 = t.op("Transpose", [d], attributes={"perm": [0, 2, 1]})                # [K/m, m, N]
    n_out = t.op("Shape", [vals], attributes={"start": 2})
    w = t.op("Reshape", [d2, t.op("Concat", [_ints(t, [-1]), n_out], attributes={"axis": 0})])
    y = t.op("MatMul", [x, w])
    y.name = "Y"
    graph = ir.Graph([x, vals, pos], [y], nodes=t.nodes, opset_imports={"": opset}, name="NMSparseMatMul")
    return ir.Function(DOMAIN, "NMSparseMatMul", graph=graph,
                       attributes=[ir.Attr("n", ir.AttributeType.INT, 2), ir.Attr("m", ir.AttributeType.INT, 4)])


#: op name -> the function that defines it
FUNCTIONS = {"BlockSparseMatMul": block_sparse_matmul, "NMSparseMatMul": nm_sparse_matmul}


def attach(model: ir.Model, ops: Iterable[str] | None = None) -> list[str]:
    """Add the functions of ``ops`` (default: the ``ai.graphopt`` ops the graph uses) and the opset import.

    Returns the op names attached (already-present functions are kept as they are).
    """
    if ops is None:
        ops = sorted({n.op_type for n in model.graph.all_nodes() if n.domain == DOMAIN})
    ops = list(ops)
    added = []
    opset = model.opset_imports.get("", BODY_OPSET)
    if opset < BODY_OPSET:
        raise ValueError(f"{DOMAIN} function bodies need opset >= {BODY_OPSET}; the model imports {opset}")
    for op in ops:
        if op not in FUNCTIONS:
            raise KeyError(f"unknown {DOMAIN} op {op!r}; known: {', '.join(FUNCTIONS)}")
        if (DOMAIN, op, "") in model.functions:
            continue
        fn = FUNCTIONS[op](opset)
        model.functions[fn.identifier()] = fn
        added.append(op)
    if ops:
        model.opset_imports.setdefault(DOMAIN, VERSION)
        model.graph.opset_imports.setdefault(DOMAIN, VERSION)
    return added


# ------------------------------------------------------------------ packing (numpy): weights -> op inputs


def pack_blocks(w: np.ndarray, keep: np.ndarray, block: int, block_cols: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """``W[K, N]`` and a balanced block mask ``keep[K/b, N/bn]`` -> ``(W_blocks, block_index)``.

    ``block`` is ``b``, the rows of a block; ``block_cols`` its columns ``bn`` (default: square blocks).
    """
    bn = block if block_cols is None else block_cols
    kb_n, nb = keep.shape
    counts = keep.sum(axis=0)
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"block mask is not balanced: kept blocks per column block {sorted(set(counts.tolist()))}")
    kb = int(counts[0])
    idx = np.stack([np.flatnonzero(keep[:, j]) for j in range(nb)]).astype(np.int64).reshape(nb, kb)
    w4 = w.reshape(kb_n, block, nb, bn).transpose(2, 0, 1, 3)               # [NB, KB, b, bn]
    wb = np.take_along_axis(w4, idx[:, :, None, None], axis=1)               # [NB, kb, b, bn]
    return np.ascontiguousarray(wb.reshape(nb, kb * block, bn), dtype=w.dtype), idx


def pack_nm(w: np.ndarray, keep: np.ndarray, n: int = 2, m: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """``W[K, N]`` and an n:m mask along K -> ``(values[K/m, n, N], positions[K/m, n, N] uint8)``."""
    k, cols = w.shape
    g = keep.reshape(k // m, m, cols)
    if not np.all(g.sum(axis=1) == n):
        raise ValueError(f"mask is not {n}:{m} along K")
    pos = np.argsort(~g, axis=1, kind="stable")[:, :n, :]                    # kept slots, ascending
    vals = np.take_along_axis(w.reshape(k // m, m, cols), pos, axis=1)
    return np.ascontiguousarray(vals, dtype=w.dtype), pos.astype(np.uint8)
