"""Graph surgery of ``decode-sparsity``: one gated FFN into router-picked neuron groups.

Real form (``simulate=False``)::

    x ─MatMul(R)─Add(rb)─▶ scores [.., G] ─Reshape[-1, G]─TopK(k)─▶ idx ─ScatterElements(zeros[G])─▶ hit
    on = Greater(hit, 0) Or Not(Size(x) == H)          (every group on unless one token: prefill stays dense)
    a  = Concat_g If(on[g]) then silu(gate_g(x)) · up_g(x) else 0      (gate_g/up_g: one projection + Split)
    y  = down(a)                 (down's rows in the groups' order: whole 4-bit blocks, so exact)

Each group is a fixed set of neurons with its own constant gate/up projection inside its ``If`` branch (ORT
prepacks it like any initializer), so only the branches taken run: at batch 1 one token computes ``k`` of
``G`` groups of gate/up; the down projection stays one dense kernel over the concatenated activations (the
zeros of the groups not run included): one kernel instead of ``k`` small ones, whose per-node cost at
batch 1 measured more than their saving.

Simulation form (``simulate=True``, for teacher-forced perplexity in one forward): every group runs and
is multiplied by a per-token 0/1 mask from the same TopK, so each position sees exactly what a decode step
of that token would compute. ``oracle=True`` (simulation only) ranks the groups by the norms of their true
outputs instead of the router's scores: the quality bound of any router over these groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from graphopt.rewrites.common.gated_ffn import GatedFFN, init_value
from graphopt.rewrites.common.names import unique_name

#: the name stem of every value the rewrite makes for one block
STEM = "decode_sparsity"


class _Nodes:
    """New nodes in order (``op`` like ``ir.tape.Tape.op``; any node may be appended)."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, inputs, attributes=None) -> ir.Value:
        return self.op_multi_out(op_type, inputs, 1, attributes)[0]

    def op_multi_out(self, op_type: str, inputs, num_outputs: int, attributes=None) -> list[ir.Value]:
        node = ir.node(op_type, list(inputs), attributes or {}, num_outputs=num_outputs)
        self.nodes.append(node)
        return list(node.outputs)


def _name_values(nodes: Sequence[ir.Node], base: str) -> None:
    """Give every output (subgraphs included) a name unique in the model: each graph numbers its unnamed
    values from 0, and ORT needs SSA names across scopes."""
    i = 0
    stack = list(nodes)
    while stack:
        node = stack.pop()
        for o in node.outputs:
            o.name, i = f"{base}_v{i}", i + 1
        if not node.name:
            node.name = f"{base}_n{i}"
            i += 1
        for a in node.attributes.values():
            if a.type == ir.AttributeType.GRAPH:
                stack.extend(a.value)


def group_act(f: GatedFFN, rows: np.ndarray, x: ir.Value, graph: ir.Graph, prefix: str,
              sums: ir.Value | None = None) -> tuple[list[ir.Node], ir.Value]:
    """Nodes of ``silu(gate(x)) * up(x)`` over the neurons ``rows`` (constants in ``graph``): gate and up as
    one projection then a Split; ``sums``: the block sums of ``x`` computed once outside."""
    nodes, gu = f.gate.cut(cols=rows).concat(f.up.cut(cols=rows)).emit(x, graph, f"{prefix}_gate_up", sums)
    sizes = init_value(graph, f"{prefix}_split", np.array([len(rows), len(rows)], np.int64))
    split = ir.node("Split", [gu, sizes], {"axis": -1}, num_outputs=2, name=f"{prefix}_split")
    g, u = split.outputs
    sig = ir.node("Sigmoid", [g], name=f"{prefix}_sigmoid")
    silu = ir.node("Mul", [g, sig.outputs[0]], name=f"{prefix}_silu")
    a = ir.node("Mul", [silu.outputs[0], u], name=f"{prefix}_act")
    return nodes + [split, sig, silu, a], a.outputs[0]


def rewrite(model: ir.Model, f: GatedFFN, groups: Sequence[np.ndarray], router: tuple[np.ndarray, np.ndarray],
            k: int, *, simulate: bool = False, oracle: bool = False) -> str:
    """Replace ``f`` in ``model`` by its grouped form keeping ``k`` of ``len(groups)`` groups per token;
    returns the name of the rewritten output."""
    graph = model.graph
    base = unique_name(graph, f"{STEM}_{f.gate.nodes[0].name or f.y.name}")
    x, n_groups = f.x, len(groups)

    def c(arr, suffix: str) -> ir.Value:
        return init_value(graph, f"{base}_{suffix}", np.asarray(arr))

    t = _Nodes()
    r, rb = router
    scores = t.op("Add", [t.op("MatMul", [x, c(r.astype(np.float32), "router")]), c(rb.astype(np.float32), "rb")])
    kk = c(np.array([k], np.int64), "k")
    one = c(np.ones(1, np.float32), "one")
    outs: list[ir.Value] = []
    sums = None
    if f.gate.kind == "nbits+mins":  # the gate/up correction's block sums of x: once, outside the groups
        pre, sums = f.gate.block_sums(x, graph, f"{base}_x")
        t.nodes.extend(pre)
    if simulate:
        ys = []
        for gi, rows in enumerate(groups):
            body, a = group_act(f, rows, x, graph, f"{base}_g{gi}", sums)
            more, y = f.down.cut(rows=rows).emit(a, graph, f"{base}_g{gi}_down")
            t.nodes.extend(body + more)
            ys.append(y)
        if oracle:  # each token's true top groups: the norms of the groups' outputs
            last = c(np.array([-1], np.int64), "last")
            scores = t.op("Concat", [t.op("ReduceL2", [y, last]) for y in ys], attributes={"axis": -1})
        _, idx = t.op_multi_out("TopK", [scores, kk], 2, {"axis": -1})
        zeros = t.op("Mul", [scores, c(np.zeros(1, np.float32), "zero")])
        mask = t.op("ScatterElements", [zeros, idx, t.op("Expand", [one, t.op("Shape", [idx])])],
                    attributes={"axis": -1})
        for gi, y in enumerate(ys):
            m = t.op("Gather", [mask, c(np.array([gi], np.int64), f"g{gi}_index")], attributes={"axis": -1})
            outs.append(t.op("Mul", [y, m]))
    else:
        flat = t.op("Reshape", [scores, c(np.array([-1, n_groups], np.int64), "flat_shape")])
        _, idx = t.op_multi_out("TopK", [flat, kk], 2, {"axis": -1})
        idx = t.op("Reshape", [idx, c(np.array([-1], np.int64), "flat")])
        hit = t.op("ScatterElements", [c(np.zeros(n_groups, np.float32), "zeros"), idx,
                                       t.op("Expand", [one, t.op("Shape", [idx])])])
        one_token = t.op("Equal", [t.op("Size", [x]), c(np.array(f.hidden, np.int64), "hidden")])
        on = t.op("Or", [t.op("Greater", [hit, c(np.zeros(1, np.float32), "zero")]), t.op("Not", [one_token])])
        rank = len(x.shape) if x.shape is not None else 3
        for gi, rows in enumerate(groups):
            cond = t.op("Gather", [on, c(np.array(gi, np.int64), f"g{gi}_index")], attributes={"axis": 0})
            then = ir.Graph([], [], nodes=[], name=f"{base}_g{gi}_then")
            body, a = group_act(f, rows, x, then, f"{base}_g{gi}", sums)
            then.extend(body)
            then.outputs.append(a)
            a.type = f.y.type
            zero = ir.node("Identity", [c(np.zeros([1] * (rank - 1) + [len(rows)], np.float32), f"g{gi}_zero")],
                           name=f"{base}_g{gi}_off")
            zero.outputs[0].type = f.y.type
            other = ir.Graph([], [zero.outputs[0]], nodes=[zero], name=f"{base}_g{gi}_else")
            node = ir.Node("", "If", [cond], attributes=[ir.AttrGraph("then_branch", then),
                                                         ir.AttrGraph("else_branch", other)],
                           num_outputs=1, name=f"{base}_g{gi}_if")
            node.outputs[0].type = f.y.type
            t.nodes.append(node)
            outs.append(node.outputs[0])
        # the groups' activations side by side, then one down projection over its rows in that order
        act = t.op("Concat", outs, attributes={"axis": -1})
        more, y_down = f.down.cut(rows=np.concatenate(list(groups))).emit(act, graph, f"{base}_down")
        t.nodes.extend(more)
        outs = [y_down]
    y = outs[0] if len(outs) == 1 else t.op("Sum", outs)
    y.shape, y.type = f.y.shape, f.y.type
    _name_values(t.nodes, base)
    first = f.gate.nodes[0]
    for node in t.nodes:
        graph.insert_before(first, node)
    old = f.y
    old.replace_all_uses_with(y)
    name = old.name
    graph.remove(list(f.nodes), safe=True)
    y.name = name
    for n in list(graph.initializers):
        v = graph.initializers[n]
        if not list(v.uses()) and not v.is_graph_output():
            graph.initializers.pop(n)
    return name
