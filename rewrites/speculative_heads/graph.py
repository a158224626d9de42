"""Graph side of ``speculative-heads``: find the LM head, add the Medusa heads after it.

The LM head is the ``MatMul(h, W)`` (W a constant ``[hidden, vocab]``, or the Transpose of a tied embedding) whose output is the graph output
``logits``; ``h`` [batch, sequence, hidden] is the decoder's last hidden state. The heads read ``h`` and share W::

    h ── MatMul(W_lm) ──▶ logits                                     (unchanged)
    h ── MatMul([W_1|..|W_K]) ── Add(b) ── SiLU ── Reshape [B, S, K, H] ── Add(Unsqueeze(h, 2))
      ── Reshape [B, S·K, H] ── MatMul(W_lm) ── Reshape [B, S, K, V] ──▶ medusa_logits

All K heads of every position go through one MatMul with the LM head's weight (read once per forward).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

OUTPUT = "medusa_logits"


def find_lm_head(model: ir.Model) -> tuple[ir.Node, ir.Value, np.ndarray] | str:
    """(the LM head node, the hidden state it reads, its weight [hidden, vocab]) or why not found."""
    outs = {o.name: o for o in model.graph.outputs}
    if "logits" not in outs:
        return "the graph has no 'logits' output"
    if OUTPUT in outs:
        return f"the graph already has a '{OUTPUT}' output"
    node = outs["logits"].producer()
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        kind = "a graph input" if node is None else f"{node.op_type} '{node.name}'"
        return f"'logits' is made by {kind}, not a MatMul with a constant weight (the LM head)"
    h, w = node.inputs
    weight = _constant_2d(w)
    if weight is None:
        return f"the LM head MatMul '{node.name}' has no constant 2-D weight"
    if h is None or h.shape is None or len(h.shape) != 3:
        return f"the LM head MatMul '{node.name}' does not read a [batch, sequence, hidden] value"
    if weight.dtype != np.float32:
        return f"the LM head weight is {weight.dtype}, not float32"
    return node, h, weight


def _constant_2d(w: ir.Value | None) -> np.ndarray | None:
    """A constant 2-D weight, or ``Transpose(perm=[1, 0])`` of one (a weight tied to the embedding)."""
    if w is None:
        return None
    if w.const_value is not None:
        return w.const_value.numpy() if len(w.const_value.shape) == 2 else None
    t = w.producer()
    if t is None or t.op_type != "Transpose" or t.domain not in ("", "ai.onnx") or t.inputs[0] is None:
        return None
    perm = t.attributes.get("perm")
    src = t.inputs[0].const_value
    if src is None or len(src.shape) != 2 or perm is None or list(perm.as_ints()) != [1, 0]:
        return None
    return src.numpy().T


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    v.shape, v.type = ir.Shape(array.shape), ir.TensorType(ir.DataType.from_numpy(array.dtype))
    graph.register_initializer(v)
    return v


def add_heads(model: ir.Model, head: ir.Node, h: ir.Value, w: np.ndarray, b: np.ndarray) -> ir.Value:
    """Add the Medusa heads (``w`` [K, hidden, hidden], ``b`` [K, hidden]) and the ``medusa_logits`` output."""
    graph = model.graph
    k, hidden, _ = w.shape
    vocab = int(head.outputs[0].shape[-1]) if head.outputs[0].shape is not None and \
        isinstance(head.outputs[0].shape[-1], int) else int(_constant_2d(head.inputs[1]).shape[1])
    wcat = _const(graph, "medusa.weight", np.ascontiguousarray(w.transpose(1, 0, 2).reshape(hidden, k * hidden)))
    bcat = _const(graph, "medusa.bias", np.ascontiguousarray(b.reshape(k * hidden), np.float32))
    split = _const(graph, "medusa.shape_bskh", np.array([0, 0, k, hidden], np.int64))
    flat = _const(graph, "medusa.shape_bxh", np.array([0, -1, hidden], np.int64))
    back = _const(graph, "medusa.shape_bskv", np.array([0, -1, k, vocab], np.int64))
    axis = _const(graph, "medusa.axis2", np.array([2], np.int64))
    nodes: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value, name: str) -> ir.Value:
        node = ir.Node("", op_type, inputs, name=f"medusa/{name}", num_outputs=1)
        node.outputs[0].name = f"medusa/{name}_out"
        nodes.append(node)
        return node.outputs[0]

    z = op("Add", op("MatMul", h, wcat, name="proj"), bcat, name="bias")
    act = op("Mul", z, op("Sigmoid", z, name="sigmoid"), name="silu")
    res = op("Add", op("Reshape", act, split, name="split_heads"), op("Unsqueeze", h, axis, name="unsqueeze_h"),
             name="residual")
    logits = op("MatMul", op("Reshape", res, flat, name="flatten"), head.inputs[1], name="lm_head")
    out = op("Reshape", logits, back, name="unflatten")
    graph.extend(nodes)
    out.name = OUTPUT
    dims = head.outputs[0].shape
    batch, seq = (dims[0], dims[1]) if dims is not None and len(dims) == 3 else ("batch", "sequence")
    out.shape = ir.Shape([batch, seq, k, vocab])
    out.type = ir.TensorType(ir.DataType.FLOAT)
    graph.outputs.append(out)
    return out
