"""A GGUF Q8_0 table in a graph, and the initializer bookkeeping of the passes that read it in blocks.

``exporters.gguf_blocks`` writes a Q8_0 tensor (blocks of 32 int8 codes, one scale each: ``w = d·q``) as
``Reshape(Mul(Cast(int8 codes [V, blocks, 32]), Cast(scales [V, blocks, 1])))``, which ONNX Runtime folds into
a float table at load. :func:`q8_codes` reads the codes and scales back; :func:`add_initializer` and
:func:`prune_unread` are the graph edits around replacing a reader of such a table.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def const(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``v`` as numpy, or None."""
    return None if v is None or v.const_value is None else np.asarray(v.const_value.numpy())


def q8_codes(table: ir.Value) -> tuple[np.ndarray, np.ndarray] | None:
    """(int8 codes [V, blocks, 32], float32 scales [V, blocks]) of ``Reshape(Mul(Cast(codes), Cast(scales)))``,
    or None when ``table`` is not made that way."""
    rh = table.producer()
    mul = rh.inputs[0].producer() if rh is not None and rh.op_type == "Reshape" else None
    if mul is None or mul.op_type != "Mul":
        return None
    parts = []
    for v in mul.inputs:
        p = v.producer() if v is not None else None
        src = p.inputs[0] if p is not None and p.op_type == "Cast" else v
        parts.append(const(src))
    if any(x is None for x in parts):
        return None
    codes, scales = sorted(parts, key=lambda x: x.dtype != np.int8)
    if codes.dtype != np.int8 or codes.ndim != 3 or scales.shape != codes.shape[:2] + (1,):
        return None
    return codes, scales[..., 0].astype(np.float32)


def add_initializer(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    """Register ``arr`` as a new initializer (``name``, suffixed until unique)."""
    base, i = name, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                 const_value=ir.tensor(arr, name=name))
    graph.register_initializer(v)
    return v


def prune_unread(g: ir.Graph, values) -> None:
    """Drop what ``values`` (inputs of removed nodes) leave unread: initializers, and the constant-side
    Cast/Mul/Reshape/ReduceSum/Transpose nodes that produced them."""
    inputs = {id(v) for v in g.inputs}
    todo = [v for v in values if v is not None]
    while todo:
        v = todo.pop()
        if v.uses() or v.is_graph_output() or id(v) in inputs:
            continue
        if g.initializers.get(v.name) is v:
            del g.initializers[v.name]
            continue
        p = v.producer()
        if p is not None and p.graph is g and p.op_type in ("Cast", "Mul", "Reshape", "ReduceSum", "Transpose") \
                and not any(o.uses() or o.is_graph_output() for o in p.outputs):
            ins = list(p.inputs)
            g.remove(p, safe=True)
            todo.extend(i for i in ins if i is not None)
