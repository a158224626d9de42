"""``early-exit``: the pooling the model's own head applies, read from the graph.

Between the last layer output ``h`` ``[batch, seq, hidden]`` and the logits the classifier pools the
sequence axis; exit heads pool the same way. Recognised (the first match in topological order among the
nodes that read ``h``'s descendants and feed the logits):

- ``cls``: ``Gather`` of index 0 on axis 1, or ``Slice`` of ``[0, 1)`` on axis 1 (BERT pooler, ``h[:, 0]``);
- ``last``: ``Gather`` of index -1 / ``Slice`` of ``[-1, ...)`` on axis 1, or a ``Gather`` / ``GatherND`` /
  ``GatherElements`` whose indices are computed (the last real token from the mask sum);
- ``mean``: ``ReduceSum`` / ``ReduceMean`` over axis 1 (masked: the sum of ``h * mask`` divided by the
  mask sum, as sentence-transformers / HF export it; unmasked: a plain mean);
- ``max``: ``ReduceMax`` over axis 1 (masked or not).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

#: poolings the graph can tell (the ``pool`` option also takes ``cls+mean``)
READ = ("cls", "mean", "max", "last")


def _const(v: ir.Value | None) -> np.ndarray | None:
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    prod = v.producer()
    if prod is not None and prod.op_type == "Constant" and "value" in prod.attributes:
        return prod.attributes["value"].as_tensor().numpy()
    return None


def _axes(n: ir.Node) -> list[int] | None:
    if "axes" in n.attributes:
        return list(n.attributes["axes"].as_ints())
    a = _const(n.inputs[1]) if len(n.inputs) > 1 else None
    return None if a is None else [int(x) for x in np.ravel(a)]


def _seq_axis(v: ir.Value, axes: list[int] | None) -> bool:
    """``axes`` is exactly the sequence axis (1) of the rank-3 value ``v``."""
    rank = len(v.shape) if v.shape is not None else 3
    return axes is not None and len(axes) == 1 and axes[0] % rank == 1 and rank == 3


def _classify(n: ir.Node) -> str | None:
    x = n.inputs[0] if n.inputs else None
    if x is None:
        return None
    if n.op_type == "Gather" and n.attributes.get_int("axis", 0) in (1, -2):
        idx = _const(n.inputs[1])
        if idx is None:
            return "last"
        if idx.size == 1:
            return "cls" if int(idx.ravel()[0]) == 0 else "last" if int(idx.ravel()[0]) == -1 else None
        return None
    if n.op_type in ("GatherND", "GatherElements"):
        return "last" if _const(n.inputs[1]) is None else None
    if n.op_type == "Slice":
        starts, ends = _const(n.inputs[1]), _const(n.inputs[2])
        axes = _const(n.inputs[3]) if len(n.inputs) > 3 else np.array([0])
        if starts is None or ends is None or axes is None or not _seq_axis(x, [int(a) for a in np.ravel(axes)]):
            return None
        s, e = int(np.ravel(starts)[0]), int(np.ravel(ends)[0])
        return "cls" if (s, e) == (0, 1) else "last" if s == -1 else None
    if n.op_type in ("ReduceSum", "ReduceMean", "ReduceMax") and _seq_axis(x, _axes(n)):
        return "max" if n.op_type == "ReduceMax" else "mean"
    return None


def read_pooling(graph: ir.Graph, last: ir.Value, out: ir.Value) -> tuple[str | None, str]:
    """(pooling, the node that shows it) between the last layer output ``last`` and ``out``; (None, why)."""
    ancestors: set[int] = set()
    stack = [out]
    while stack:
        v = stack.pop()
        p = v.producer()
        if p is None or id(p) in ancestors:
            continue
        ancestors.add(id(p))
        stack.extend(x for x in p.inputs if x is not None)
    reach = {id(last)}
    for n in graph:  # topological order
        if id(n) not in ancestors or not any(x is not None and id(x) in reach for x in n.inputs):
            continue
        first = n.inputs[0]
        if first is not None and id(first) in reach and first.shape is not None and len(first.shape) == 3:
            kind = _classify(n)
            if kind is not None:
                return kind, f"{n.op_type} '{n.name}'"
        reach.update(id(o) for o in n.outputs)
    return None, f"no first-token, mean, max or last-token pooling between '{last.name}' and '{out.name}'"
