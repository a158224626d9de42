"""``logits-to-keep``: an optional input that says how many last positions get logits (exact).

A decoder's prefill runs the LM head on every prompt position (``logits`` [batch, sequence, vocab]), yet
generation samples from the last one only: on SmolLM2 the head is 49,152 x 576, so a 128-token prompt spends
about a sixth of its prefill there. The pass adds the scalar int64 input ``logits_to_keep`` (the name
transformers uses) with the default 0, an initializer that a caller may override, and slices the head's input::

    h [B, S, H] ── LM head ──▶ logits [B, S, V]
                        ==>
    h ── Slice(axis 1, from -logits_to_keep) ── LM head ──▶ logits [B, logits_positions, V]

0 (the default, and what every caller that does not know the input gets) keeps all positions, so the graph's
contract is unchanged; ``k`` keeps the last ``k`` (all when ``k`` >= the sequence length). The kept rows are
the same arithmetic as before. graphopt's runtime (``generate.loop.Decoder.step``) feeds 1 to a prefill, the
distance from the shortest row's end to a right-padded batch's end, and 0 where all positions are asked for
(speculative verification, perplexity).

The head is the node that makes ``logits``: a ``MatMul`` or ``MatMulNBits``, or one reached from ``logits``
through position-wise ``Cast`` / ``Add`` / ``Mul`` / ``Div`` / ``Tanh`` with constant operands that do not
span the sequence axis (a bias, a logit scale or soft cap); or the ``Add`` of two such kernels reading the same
hidden state (``q8-tables``' tied head: its high and low nibbles), both then reading the sliced input. Declined (graph unchanged, a note) where the graph
has no past_key_values inputs, no [batch, sequence, vocab] ``logits``, a head in another form, or the input
already.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.analysis import lm_head
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register

INPUT = "logits_to_keep"
#: the symbolic length of the sequence axis of ``logits`` once sliced
DIM = "logits_positions"
_WISE = {"Cast", "Add", "Mul", "Div", "Tanh", "Sub"}


def _spans_sequence(v: ir.Value) -> bool:
    """Whether a constant operand of a position-wise op has more than one entry on the sequence axis."""
    c = v.const_value
    if c is None:
        return True
    shape = list(c.shape)
    return len(shape) >= 2 and shape[-2] != 1


def find_head(graph: ir.Graph) -> tuple[list[ir.Node], list[ir.Node]] | str:
    """(the LM head node(s): one, or two summed; the position-wise nodes between them and ``logits``) or why
    there is none."""
    outs = {o.name: o for o in graph.outputs}
    logits = outs.get("logits")
    if logits is None:
        return "the graph has no 'logits' output"
    if logits.shape is None or len(logits.shape) != 3:
        return "'logits' is not [batch, sequence, vocab]"
    between: list[ir.Node] = []
    v = logits
    while True:
        node = v.producer()
        if node is None:
            return "'logits' is a graph input"
        if lm_head.is_kernel(node):
            heads = [node]
            break
        pair = lm_head.summed_kernels(node)
        if pair is not None:
            if len(v.uses()) != (0 if v is logits else 1):
                return f"'{v.name}' is read by more than the path to 'logits'"
            between.append(node)
            heads = pair
            break
        if node.domain not in ("", "ai.onnx") or node.op_type not in _WISE or len(between) >= 4:
            return f"'logits' is made by {node.op_type} '{node.name}', not an LM head MatMul / MatMulNBits"
        flow = [i for i in node.inputs if i is not None and i.const_value is None]
        if len(flow) != 1 or any(_spans_sequence(i) for i in node.inputs if i is not None and i is not flow[0]):
            return f"'{node.name}' ({node.op_type}) before 'logits' is not position-wise with constant operands"
        if len(v.uses()) != (0 if v is logits else 1):
            return f"'{v.name}' is read by more than the path to 'logits'"
        between.append(node)
        v = flow[0]
    if len(heads) == 1 and len(v.uses()) != (0 if v is logits else 1):
        return f"'{v.name}' is read by more than the path to 'logits'"
    h = heads[0].inputs[0]
    if h is None or h.shape is None or len(h.shape) != 3:
        return f"the LM head '{heads[0].name}' does not read a [batch, sequence, hidden] value"
    return heads, between


class LogitsToKeepPass(GraphoptPass):
    """Add the optional input logits_to_keep (default 0: all positions) that slices the LM head's input."""

    name = "logits-to-keep"
    exact = True
    emits = ()
    in_default_recipe = False

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        g = model.graph
        names = {v.name for v in g.inputs}
        if not any(n.startswith("past_key_values.") for n in names):
            return PassResult(model, False, notes=["not applied: no past_key_values inputs (not a decoder with past)"])
        if INPUT in names or INPUT in g.initializers:
            return PassResult(model, False, notes=[f"not applied: the graph already has '{INPUT}'"])
        found = find_head(g)
        if isinstance(found, str):
            return PassResult(model, False, notes=[f"not applied: {found}"])
        heads, between = found
        h = heads[0].inputs[0]
        keep = ir.Value(name=INPUT, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]),
                        const_value=ir.tensor(np.array(0, np.int64), name=INPUT))
        g.inputs.append(keep)
        g.register_initializer(keep)

        def const(name: str, arr) -> ir.Value:
            v = ir.Value(name=name, const_value=ir.tensor(np.asarray(arr, np.int64), name=name))
            g.register_initializer(v)
            return v

        axes = const("logits_to_keep.axes", [0])
        seq_axis = const("logits_to_keep.axis", [1])
        end = const("logits_to_keep.end", [np.iinfo(np.int64).max])
        unsq = ir.node("Unsqueeze", [keep, axes], name="logits_to_keep/Unsqueeze",
                       outputs=[ir.Value(name="logits_to_keep.1d")])
        neg = ir.node("Neg", [unsq.outputs[0]], name="logits_to_keep/Neg",
                      outputs=[ir.Value(name="logits_to_keep.start")])
        sliced = ir.Value(name=f"{h.name}.kept", type=h.type, shape=ir.Shape([h.shape[0], DIM, h.shape[2]]))
        cut = ir.node("Slice", [h, neg.outputs[0], end, seq_axis], name="logits_to_keep/Slice", outputs=[sliced])
        g.insert_before(next(n for n in g if any(n is x for x in heads)), [unsq, neg, cut])  # the first in order
        for head in heads:
            head.replace_input_with(0, sliced)
        for node in [*heads, *reversed(between)]:
            for out in node.outputs:
                if out.shape is not None and len(out.shape) == 3:
                    out.shape = ir.Shape([out.shape[0], DIM, out.shape[2]])
        return PassResult(model, True, notes=[f"'{INPUT}' (default 0: all positions) slices the input of the LM "
                                              f"head {' + '.join(f'{n.op_type} {n.name!r}' for n in heads)}"],
                          rule_counts={"logits-to-keep": 1})


register(LogitsToKeepPass)
