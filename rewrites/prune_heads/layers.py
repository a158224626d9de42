"""Find the attention layers of a fused graph and slice heads out of them.

A layer is the set of com.microsoft attention nodes whose context reaches one output-projection
MatMul (one node after ``fuse``; one per length group after ``remove-padding``, all changed together)::

    Attention(x, W_qkv [D,3H], b_qkv [3H])                       num_heads = n, H = n*d
      or MultiHeadAttention(q, k, v, bias [3H]) with q|k|v <--(Gather/Squeeze/...)-- MatMul(x, W_q|W_k|W_v [D,H])
        --(Reshape [-1,H] / Concat / Gather ...)--> MatMul(ctx, W_o [H,D]) --> (+ bias, residual)

Removing heads slices the kept heads' columns out of the Q, K and V weights and biases, their rows
out of ``W_o``, sets ``num_heads`` (and ``qkv_hidden_sizes``) on every copy, and rewrites constant
Reshape shapes on the context path whose last entry is ``H``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.rewrites.prune_heads import unfused
from graphopt.rewrites.prune_heads.attention import Layer, Refusal, const_array
from graphopt.runtime.contrib import attention_attributes, attention_inputs, is_attention

#: fused attention ops whose heads this pass can slice
OPS = ("Attention", "MultiHeadAttention", "PackedMultiHeadAttention")
#: ops a context or a projection passes through unchanged in its last (hidden) axis
_THROUGH = ("Identity", "Cast", "Squeeze", "Unsqueeze", "Gather", "Concat", "Reshape")


_QUANTIZED = ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger", "QLinearMatMul", "MatMulNBits",
              "DequantizeLinear")


def _through_forward(node: ir.Node) -> bool:
    if node.op_type not in _THROUGH or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Gather":
        return node.attributes.get_int("axis", 0) == 0
    if node.op_type == "Concat":
        return node.attributes.get_int("axis", 0) >= 0
    return True


def _find_out_projection(attn: ir.Node, hidden: int) -> tuple[ir.Node, list[ir.Node]]:
    """The output-projection MatMul the context of ``attn`` reaches, and the Reshapes on the way."""
    stack, seen, found, reshapes = [attn.outputs[0]], set(), set(), []
    while stack:
        v = stack.pop()
        if v.is_graph_output():
            raise Refusal(f"the context of {attn.op_type} {attn.name!r} is a graph output")
        for user, idx in v.uses():
            if id(user) in seen:
                continue
            if user.op_type == "MatMul" and user.domain in ("", "ai.onnx") and idx == 0:
                w = const_array(user.inputs[1])
                if w is None or w.ndim != 2 or w.shape[0] != hidden:
                    raise Refusal(f"the context of {attn.op_type} {attn.name!r} reaches MatMul {user.name!r} "
                                  f"without a constant [{hidden}, D] weight")
                found.add(user)
                seen.add(id(user))
                continue
            if (idx != 0 and user.op_type != "Concat") or not _through_forward(user):
                raise Refusal(f"the context of {attn.op_type} {attn.name!r} reaches {user.op_type} {user.name!r}, "
                              "not an output projection (only Reshape/Concat/Gather/Squeeze on the way)")
            if user.op_type == "Reshape":
                shape = const_array(user.inputs[1])
                if shape is None or shape[-1] != hidden or hidden in shape[:-1]:
                    raise Refusal(f"Reshape {user.name!r} on the context path of {attn.name!r} has shape "
                                  f"{None if shape is None else shape.tolist()}, not [..., {hidden}]")
                reshapes.append(user)
            seen.add(id(user))
            stack.extend(user.outputs)
    if len(found) != 1:
        raise Refusal(f"the context of {attn.op_type} {attn.name!r} reaches {len(found)} output projections")
    return found.pop(), reshapes


def _find_projection(v: ir.Value | None, hidden: int | None, where: str) -> ir.Node:
    """The MatMul with a constant [D, H] weight that ``v`` (an MHA query/key/value) comes from."""
    while v is not None and v.producer() is not None:
        p = v.producer()
        if p.op_type == "MatMul" and p.domain in ("", "ai.onnx"):
            w = const_array(p.inputs[1])
            if w is None or w.ndim != 2 or (hidden is not None and w.shape[1] != hidden):
                break
            return p
        if p.op_type in _QUANTIZED:
            raise Refusal(f"{where}: its query/key/value comes from {p.op_type} {p.name!r} (quantized): "
                          "run prune-heads before quantize")
        if p.op_type in ("Identity", "Cast", "Squeeze", "Unsqueeze") or (
                p.op_type == "Gather" and p.attributes.get_int("axis", 0) == 0 and p.inputs[0] is not None):
            v = p.inputs[0]
            continue
        break
    raise Refusal(f"{where}: its query/key/value does not come from a MatMul with a constant [D, H] weight")


def find_layers(model: ir.Model) -> list[Layer]:
    """The attention layers of ``model``'s main graph in graph order (Refusal when one is unsupported)."""
    attns = [n for n in model.graph if is_attention(n, *OPS)]
    if not attns:
        quant = [n for n in model.graph if is_attention(n, "QAttention")]
        if quant:
            raise Refusal("the attention is quantized (QAttention): run prune-heads before quantize")
        if any(n.op_type in _QUANTIZED for n in model.graph):
            raise Refusal("the graph has quantized MatMuls: run prune-heads before quantize")
        return unfused.find_layers(model)
    by_out: dict[int, Layer] = {}
    order: list[Layer] = []
    for node in attns:
        attrs = attention_attributes(node)
        a = attention_inputs(node)
        where = f"{node.op_type} {node.name!r}"
        if not attrs.stateless_bidirectional or a.past_state or attrs.num_heads is None:
            raise Refusal(f"{where} is causal, rotary, has past state or no num_heads: not pruned")
        n = int(attrs.num_heads)
        if node.op_type == "Attention":
            w, b = const_array(a.weights), const_array(a.bias)
            if w is None or w.ndim != 2 or (a.bias is not None and b is None):
                raise Refusal(f"{where} has no constant packed QKV weight/bias")
            sizes = attrs.qkv_sizes(int(w.shape[1]))
            if len(set(sizes)) != 1 or sizes[0] % n:
                raise Refusal(f"{where} has qkv_hidden_sizes {sizes}: unequal Q/K/V widths are not pruned")
            hidden = sizes[0]
        else:
            if a.query is None or a.key is None or a.value is None:
                raise Refusal(f"{where} takes packed QKV in one input: not pruned")
            b = const_array(a.bias)
            if a.bias is not None and b is None:
                raise Refusal(f"{where} has a non-constant bias")
            hidden = None
        proj = None
        if hidden is None:  # MHA: the width is the Q projection's
            proj = tuple(_find_projection(x, None, where) for x in (a.query, a.key, a.value))
            widths = {int(const_array(mm.inputs[1]).shape[1]) for mm in proj}
            if len(widths) != 1:
                raise Refusal(f"{where}: Q/K/V projections of unequal widths {sorted(widths)}")
            hidden = widths.pop()
        if hidden % n:
            raise Refusal(f"{where}: width {hidden} is not a multiple of num_heads {n}")
        out, reshapes = _find_out_projection(node, hidden)
        layer = by_out.get(id(out))
        if layer is None:
            layer = Layer(len(order), [], n, hidden // n, out,
                          qkv_weight=a.weights if proj is None else None, qkv_bias=a.bias, proj=proj)
            by_out[id(out)] = layer
            order.append(layer)
        else:
            same = (layer.num_heads == n and layer.proj == proj and layer.qkv_bias is a.bias
                    and layer.qkv_weight is (a.weights if proj is None else None))
            if not same:
                raise Refusal(f"{where} and {layer.copies[0].name!r} share an output projection but not "
                              "their Q/K/V projections or head count")
        layer.copies.append(node)
        layer.reshapes.extend(r for r in reshapes if r not in layer.reshapes)
    return order


# ---------------------------------------------------------------- physical removal

def _set_const(graph: ir.Graph, users: Sequence[tuple[ir.Node, int]], old: ir.Value, array: np.ndarray,
               suffix: str) -> ir.Value:
    """A new initializer ``array`` in place of ``old`` for ``users`` (``old`` dropped once unused)."""
    name = base = f"{old.name or 'prune_heads'}_{suffix}"
    k = 1
    while name in graph.initializers:
        k += 1
        name = f"{base}_{k}"
    new = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                   const_value=ir.tensor(array, name=name))
    graph.register_initializer(new)
    for node, idx in users:
        node.replace_input_with(idx, new)
    if not old.uses() and old.name in graph.initializers and old not in graph.outputs:
        del graph.initializers[old.name]
    return new


def _uses_in(v: ir.Value, nodes: Iterable[ir.Node]) -> list[tuple[ir.Node, int]]:
    ids = {id(n) for n in nodes}
    return [(u, i) for u, i in v.uses() if id(u) in ids]


def prune_layer(graph: ir.Graph, layer: Layer, keep: Sequence[int], out_weight: np.ndarray,
                out_bias_delta: np.ndarray | None) -> None:
    """Keep heads ``keep`` of ``layer``: slice Q/K/V and ``W_o`` (set to ``out_weight`` [kept*d, D])."""
    keep = sorted(keep)
    ch = layer.channels(keep)
    hid, tag = layer.hidden, f"h{len(keep)}"
    if layer.proj is None:  # Attention: packed [D, 3H] weight, [3H] bias
        cols = np.concatenate([ch, hid + ch, 2 * hid + ch])
        w = const_array(layer.qkv_weight)
        _set_const(graph, _uses_in(layer.qkv_weight, layer.copies), layer.qkv_weight, np.ascontiguousarray(w[:, cols]),
                   tag)
    else:
        cols = np.concatenate([ch, hid + ch, 2 * hid + ch])
        for mm in layer.proj:
            w = const_array(mm.inputs[1])
            _set_const(graph, [(mm, 1)], mm.inputs[1], np.ascontiguousarray(w[:, ch]), tag)
    for add, idx in layer.proj_biases:
        b = const_array(add.inputs[idx])
        _set_const(graph, [(add, idx)], add.inputs[idx], np.ascontiguousarray(b[ch]), tag)
    if layer.qkv_bias is not None:
        b = const_array(layer.qkv_bias)
        _set_const(graph, _uses_in(layer.qkv_bias, layer.copies), layer.qkv_bias, np.ascontiguousarray(b[cols]), tag)
    width = len(ch)
    if layer.region is not None:  # unfused
        unfused.rewrite_shapes(graph, layer, len(keep), _set_const)
    for node in (n for n in layer.copies if n.op_type in OPS):
        node.attributes["num_heads"] = ir.AttrInt64("num_heads", len(keep))
        if "qkv_hidden_sizes" in node.attributes:
            node.attributes["qkv_hidden_sizes"] = ir.AttrInt64s("qkv_hidden_sizes", [width] * 3)
    for r in layer.reshapes if layer.region is None else ():
        shape = const_array(r.inputs[1]).copy()
        shape[-1] = width
        _set_const(graph, [(r, 1)], r.inputs[1], shape, tag)
    mm = layer.out_matmul
    _set_const(graph, [(mm, 1)], mm.inputs[1], np.ascontiguousarray(out_weight.astype(np.float32)), tag)
    if out_bias_delta is not None and np.any(out_bias_delta):
        _add_bias(graph, mm, out_bias_delta.astype(np.float32), tag)


def _add_bias(graph: ir.Graph, mm: ir.Node, delta: np.ndarray, tag: str) -> None:
    """Add ``delta`` to the output projection's bias (folded into its constant [D] bias when it has one)."""
    out = mm.outputs[0]
    users = out.uses()
    if len(users) == 1:
        user, _ = users[0]
        if user.op_type in ("Add", "Sum") and user.domain in ("", "ai.onnx"):
            for i, v in enumerate(user.inputs):
                c = const_array(v)
                if c is not None and c.shape == delta.shape and c.dtype == np.float32:
                    _set_const(graph, [(user, i)], v, c + delta, tag)
                    return
    name = f"{mm.name}_bias_{tag}"
    while name in graph.initializers:
        name += "_"
    bias = ir.Value(name=name, shape=ir.Shape(delta.shape), type=ir.TensorType(ir.DataType.FLOAT),
                    const_value=ir.tensor(delta, name=name))
    graph.register_initializer(bias)
    add = ir.node("Add", [out, bias], name=f"{mm.name}_bias_add")
    new_out = add.outputs[0]
    new_out.shape, new_out.type = out.shape, out.type
    out.replace_all_uses_with(new_out)
    add.replace_input_with(0, out)
    graph.insert_after(mm, add)
    if out in graph.outputs:
        graph.outputs[graph.outputs.index(out)] = new_out
