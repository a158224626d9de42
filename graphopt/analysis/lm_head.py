"""Where a decoder's LM head is: the kernel(s) that make ``logits`` and the hidden state they read.

The head is one kernel (``MatMul`` / ``MatMulNBits``) or the ``Add`` of two kernels over one input, each read
only by that ``Add`` (``q8-tables``' tied head: its high and low nibbles). ``logits-to-keep`` slices that input;
the layer-skip draft replaces it with its exit head's output.
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN

KERNELS = {("", "MatMul"), ("ai.onnx", "MatMul"), (MS_DOMAIN, "MatMulNBits")}


def is_kernel(node: ir.Node | None) -> bool:
    return node is not None and (node.domain, node.op_type) in KERNELS


def summed_kernels(node: ir.Node) -> list[ir.Node] | None:
    """The two head kernels an ``Add`` sums, both reading one input and read by nothing else, or None."""
    if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    prods = [i.producer() if i is not None else None for i in node.inputs]
    if not all(is_kernel(p) for p in prods) or prods[0] is prods[1]:
        return None
    if prods[0].inputs[0] is not prods[1].inputs[0] or any(len(i.uses()) != 1 for i in node.inputs):
        return None
    return prods


def head_input(graph: ir.Graph) -> ir.Value | str:
    """The hidden state the LM head that makes ``logits`` reads, or why it is not found."""
    outs = {o.name: o for o in graph.outputs}
    node = outs["logits"].producer() if "logits" in outs else None
    if node is None:
        return "'logits' is not made by a node (the LM head)"
    heads = [node] if is_kernel(node) else summed_kernels(node)
    if not heads or heads[0].inputs[0] is None:
        return f"'logits' is made by {node.op_type} '{node.name}', not an LM head reading one hidden state"
    return heads[0].inputs[0]
