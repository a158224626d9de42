"""Attention layers of unfused graphs (the exporters' MatMul/Softmax attention), for ``prune-heads``.

The matched subgraph (TorchScript and dynamo exports, eager and sdpa)::

    x --MatMul(W_q|W_k|W_v [D,H])--Add(b [H])--Reshape([B,S,-1 or n,d])--Transpose-- ... --Softmax-- ...
      --MatMul(probs, V)--Transpose(0,2,1,3)--Reshape([B,S,-1 or H])--> MatMul(ctx, W_o [H,D])

The Q, K, V projections are the MatMuls with a constant ``[D, H]`` weight found walking back from the
``probs @ V`` MatMul (not through ``Shape`` nor a Reshape's shape input). Removing heads slices the same
columns out of all three (and their biases): which is Q, K or V does not matter. Head count in the
shapes: a ``-1`` or a computed entry needs nothing; a constant ``n`` / ``H`` in a constant shape is
rewritten; a constant ``n`` / ``H`` inside a computed (Concat) shape is refused.
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.rewrites.prune_heads.attention import Layer, Refusal, const_array

_STD = ("", "ai.onnx")
#: between probs @ V and the output projection
_MERGE = ("Transpose", "Reshape", "Identity", "Cast")


def _entries(shape_value: ir.Value) -> list[int | None] | None:
    """A Reshape shape as entries (None: computed), or None where its length is unknown."""
    c = const_array(shape_value)
    if c is not None:
        return [int(x) for x in c.reshape(-1)]
    p = shape_value.producer()
    if p is None or p.op_type != "Concat":
        return None
    out: list[int | None] = []
    for v in p.inputs:
        c = const_array(v)
        if c is not None:
            out.extend(int(x) for x in c.reshape(-1))
        elif v.shape is not None and v.shape.rank() == 1 and isinstance(v.shape[0], int):
            out.extend([None] * v.shape[0])
        elif _is_scalar_unsqueezed(v):
            out.append(None)
        elif _slice_length(v) is not None:
            out.extend([None] * _slice_length(v))
        else:
            return None
    return out


def _slice_length(v: ir.Value) -> int | None:
    """Length of ``Slice(Shape(x), [a], [b])`` with constant ``0 <= a <= b`` (the computed leading dims)."""
    p = v.producer()
    if p is None or p.op_type != "Slice" or len(p.inputs) != 3 or p.inputs[0].producer() is None \
            or p.inputs[0].producer().op_type != "Shape":
        return None
    a, b = const_array(p.inputs[1]), const_array(p.inputs[2])
    if a is None or b is None or a.size != 1 or b.size != 1 or not 0 <= int(a[0]) <= int(b[0]) < 2 ** 31:
        return None
    return int(b[0]) - int(a[0])


def _is_scalar_unsqueezed(v: ir.Value) -> bool:
    """``Unsqueeze(Gather(shape, scalar index), [0])``: one entry (TorchScript's computed dimensions)."""
    p = v.producer()
    if p is None or p.op_type != "Unsqueeze":
        return False
    axes = const_array(p.inputs[1]) if len(p.inputs) > 1 else None
    if axes is None or axes.size != 1:
        return False
    x = p.inputs[0]
    if x.shape is not None and x.shape.rank() == 0:
        return True
    g = x.producer()
    idx = None if g is None or g.op_type != "Gather" else const_array(g.inputs[1])
    return idx is not None and idx.ndim == 0


def _ctx_matmuls(graph: ir.Graph) -> list[ir.Node]:
    """``probs @ V`` MatMuls: input 0 comes from a Softmax (through Where/IsNaN masking, Cast, Dropout)."""
    out = []
    for n in graph:
        if n.op_type != "MatMul" or n.domain not in _STD or const_array(n.inputs[1]) is not None:
            continue
        v = n.inputs[0]
        while v is not None and v.producer() is not None:
            p = v.producer()
            if p.op_type == "Softmax":
                out.append(n)
                break
            if p.op_type == "Where":
                v = p.inputs[2]
            elif p.op_type in ("Cast", "Dropout", "Identity"):
                v = p.inputs[0]
            else:
                break
    return out


def _out_projection(mm: ir.Node) -> tuple[ir.Node, list[ir.Node]]:
    v, reshapes = mm.outputs[0], []
    while True:
        uses = [(u, i) for u, i in v.uses() if u.op_type not in ("Shape", "Size")]
        if len(uses) != 1 or v.is_graph_output():
            raise Refusal(f"the attention context of MatMul {mm.name!r} has {len(uses)} uses (not one output "
                          "projection)")
        user, idx = uses[0]
        if user.op_type == "MatMul" and user.domain in _STD and idx == 0:
            w = const_array(user.inputs[1])
            if w is None or w.ndim != 2:
                raise Refusal(f"the context of MatMul {mm.name!r} reaches MatMul {user.name!r} without a constant "
                              "weight")
            return user, reshapes
        if user.op_type not in _MERGE or user.domain not in _STD or idx != 0:
            raise Refusal(f"the context of MatMul {mm.name!r} reaches {user.op_type} {user.name!r}, not an output "
                          "projection (only Transpose/Reshape on the way)")
        if user.op_type == "Reshape":
            reshapes.append(user)
        v = user.outputs[0]


def _projections(mm: ir.Node, where: str) -> list[ir.Node]:
    """The constant-weight MatMuls the attention of ``mm`` reads."""
    stack, seen, projs = [mm], {id(mm)}, []
    while stack:
        node = stack.pop()
        ins = node.inputs[:1] if node.op_type in ("Reshape", "Expand", "Tile") else node.inputs
        for v in ins:
            p = None if v is None else v.producer()
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.op_type in ("Shape", "Size", "Constant"):
                continue
            if p.op_type == "MatMul" and const_array(p.inputs[1]) is not None:
                projs.append(p)
                continue
            if p.op_type in ("LayerNormalization", "SkipLayerNormalization", "Gelu"):
                raise Refusal(f"{where}: walking back to Q/K/V reached {p.op_type} {p.name!r}")
            stack.append(p)
    if len(projs) != 3:
        raise Refusal(f"{where}: found {len(projs)} constant-weight Q/K/V projections, not 3")
    return projs


def _bias(mm: ir.Node, hidden: int) -> tuple[ir.Node, int] | None:
    uses = mm.outputs[0].uses()
    if len(uses) != 1:
        raise Refusal(f"Q/K/V projection {mm.name!r} has {len(uses)} uses")
    user, idx = uses[0]
    if user.op_type == "Add":
        other = 1 - idx
        c = const_array(user.inputs[other])
        if c is not None and c.shape == (hidden,):
            return user, other
    return None


def find_layers(model: ir.Model) -> list[Layer]:
    """The unfused attention layers of ``model``'s main graph (Refusal when one cannot be pruned safely)."""
    graph = model.graph
    layers: list[Layer] = []
    for mm in _ctx_matmuls(graph):
        where = f"attention MatMul {mm.name!r}"
        out, merge = _out_projection(mm)
        hidden = int(const_array(out.inputs[1]).shape[0])
        projs = _projections(mm, where)
        region = _region(projs, out)
        if any(v.is_graph_output() for v in region):
            raise Refusal(f"{where}: a value between its Q/K/V projections and the output projection is a graph "
                          "output (key/value cache?): not pruned")
        ids = {id(v) for v in region}
        split = [u for v in region for u, i in v.uses() if u.op_type == "Reshape" and i == 0]
        split = [r for k, r in enumerate(split) if r not in split[:k] and r not in merge]
        if any(id(r.inputs[0]) not in ids for r in split):
            raise Refusal(f"{where}: unexpected Reshape")
        for p in projs:
            w = const_array(p.inputs[1])
            if w.ndim != 2 or w.shape[1] != hidden:
                raise Refusal(f"{where}: projection {p.name!r} has weight shape {list(w.shape)}, not [D, {hidden}]")
        d = None
        for r in split:
            e = _entries(r.inputs[1])
            if e is not None and len(e) == 4 and e[3] is not None and e[3] > 0:
                d = e[3]
                break
            if e is not None and len(e) == 4 and e[2] is not None and e[2] > 0:
                d = hidden // e[2]
                break
        if not d or hidden % d:
            raise Refusal(f"{where}: no [B, S, n, d] head-split Reshape found")
        n = hidden // d
        rewrite = []
        for r in split + merge:
            e = _entries(r.inputs[1])
            if e is None:
                raise Refusal(f"{where}: Reshape {r.name!r} has a shape of unknown length")
            bad = [i for i, x in enumerate(e) if x is not None and (x == hidden or (x == n and not (
                x == d and i == len(e) - 1)))]
            if bad and const_array(r.inputs[1]) is None:
                raise Refusal(f"{where}: Reshape {r.name!r} computes its shape with the head count {n} or width "
                              f"{hidden} as a constant ({e}): not rewritten")
            if bad:
                rewrite.append(r)
        biases = [_bias(p, hidden) for p in projs]
        layer = Layer(len(layers), [mm], n, d, out, proj=tuple(projs))
        layer.reshapes = rewrite
        layer.proj_biases = [b for b in biases if b is not None]
        layer.region = region
        layers.append(layer)
    if not layers:
        raise Refusal("no attention found (neither fused com.microsoft Attention / MultiHeadAttention nor "
                      "MatMul-Softmax-MatMul attention with constant Q/K/V/output projections)")
    return layers


def _region(projs, out: ir.Node) -> list[ir.Value]:
    """Values between the projections and the output projection (their shapes change with the head count)."""
    stack, seen, vals = [p.outputs[0] for p in projs], set(), []
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        vals.append(v)
        for user, _ in v.uses():
            if user is out:
                continue
            stack.extend(user.outputs)
    return vals


def rewrite_shapes(graph: ir.Graph, layer: Layer, kept: int, set_const) -> None:
    """Constant Reshape shapes of ``layer`` with its head count / width; shapes of the values in between dropped."""
    n, hid, width = layer.num_heads, layer.hidden, kept * layer.head_size
    for r in layer.reshapes:
        e = const_array(r.inputs[1]).copy()
        for i, x in enumerate(e):
            if x == hid:
                e[i] = width
            elif x == n and not (x == layer.head_size and i == len(e) - 1):
                e[i] = kept
        set_const(graph, [(r, 1)], r.inputs[1], e, f"h{kept}")
    for v in layer.region:
        if not v.is_graph_output():
            v.shape = None
