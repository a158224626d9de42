"""Graph side of ``layer-skip-draft``: find the residual stream entering layer L, by what it depends on.

Each value's depth is the highest layer index of the ``past_key_values.N`` inputs it depends on (-1: none). The
hidden state entering layer L (L >= 1) has depth L - 1 and is read by a node of depth >= L (layer L's residual
Add, or its SkipSimplifiedLayerNormalization); so are that layer's query (a GroupQueryAttention input), the
mask and the rotary tables. Among those values, the float ones of shape [batch, sequence, hidden] (hidden: the
width the LM head reads) are candidates; the residual stream is the candidate every other one descends from::

    h_L ──┬── norm ── q/k/v ── attention(past_L) ──┐
          └────────────────────────────────────── Add ── ... layer L+1
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.analysis import lm_head

_PAST = "past_key_values."


def _depths(graph: ir.Graph) -> dict[ir.Value, int]:
    depth: dict[ir.Value, int] = {}
    for v in graph.inputs:
        depth[v] = int(v.name.split(".")[1]) if v.name.startswith(_PAST) else -1
    for node in graph:
        d = max((depth.get(v, -1) for v in node.inputs if v is not None), default=-1)
        for o in node.outputs:
            depth[o] = d
    return depth


def _ancestors(value: ir.Value) -> set[ir.Value]:
    seen: set[ir.Value] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None:
            continue
        for i in node.inputs:
            if i is not None and i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def layer_count(graph: ir.Graph) -> int:
    return 1 + max((int(v.name.split(".")[1]) for v in graph.inputs if v.name.startswith(_PAST)), default=-1)


def hidden_width(graph: ir.Graph) -> int | str:
    """The width of the LM head's input (the hidden size), or why it is not known."""
    final = lm_head.head_input(graph)
    if isinstance(final, str):
        return final
    shape = final.shape
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int):
        return f"the LM head's input '{final.name}' is not a [batch, sequence, hidden] value"
    return int(shape[2])


def find_hidden(graph: ir.Graph, layer: int, hidden: int) -> ir.Value | str:
    """The residual stream entering ``layer`` (1 .. layers - 1), or why it was not found."""
    depth = _depths(graph)
    cands = []
    for node in graph:
        for v in node.outputs:
            if depth.get(v) != layer - 1 or v.type is None or v.type.dtype != ir.DataType.FLOAT:
                continue
            if v.shape is None or len(v.shape) != 3 or v.shape[2] != hidden:
                continue
            if any(depth.get(o, -1) >= layer for use in v.uses() for o in use.node.outputs):
                cands.append(v)
    if not cands:
        return f"no [batch, sequence, {hidden}] float value enters layer {layer}"
    for v in cands:
        if all(v is w or v in _ancestors(w) for w in cands):
            return v
    return f"{len(cands)} values enter layer {layer} and none is the source of the others: " + \
        ", ".join(f"'{v.name}'" for v in cands[:4])
