"""The probe model: one ONNX Runtime session that evaluates any set of removed heads, with or without
compensation, by changing feeds only.

Each layer's output projection ``MatMul(ctx, W_o)`` becomes::

    ctx --Mul(mask_l [H])--> MatMul(., weight_l [H,D]) --Add(bias_l [D])--> (the projection's users)
     \\__ graph output (the layer's context, for compensation fits)

``mask_l`` is 1 per channel of a kept head and 0 for a removed one (zeroing the head's context, exactly
what slicing it out does); ``weight_l`` is ``W_o`` or its least-squares re-fit (rows of removed heads
zero), ``bias_l`` the re-fit's bias change (0 without compensation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.runtime import session as runtime

PREFIX = "prune_heads"


@dataclasses.dataclass
class Probe:
    """A session over the probe model and the names of its extra inputs/outputs per layer."""

    session: object
    contexts: list[str]
    out_weights: list[np.ndarray]

    def feeds(self, feed: Mapping[str, np.ndarray], masks: Sequence[np.ndarray],
              weights: Sequence[np.ndarray] | None = None, biases: Sequence[np.ndarray] | None = None) -> dict:
        f = dict(feed)
        for i, m in enumerate(masks):
            f[f"{PREFIX}.mask.{i}"] = m.astype(np.float32)
            f[f"{PREFIX}.weight.{i}"] = (self.out_weights[i] if weights is None or weights[i] is None
                                         else weights[i]).astype(np.float32)
            d = self.out_weights[i].shape[1]
            b = None if biases is None else biases[i]
            f[f"{PREFIX}.bias.{i}"] = np.zeros(d, np.float32) if b is None else b.astype(np.float32)
        return f

    def run(self, feeds: Sequence[Mapping[str, np.ndarray]], masks, weights=None, biases=None,
            contexts: bool = False) -> list[dict[str, np.ndarray]]:
        outs = [o.name for o in self.session.get_outputs()]
        if not contexts:
            outs = [o for o in outs if o not in self.contexts]
        return runtime.run(self.session, [self.feeds(f, masks, weights, biases) for f in feeds], outputs=outs)


def build(model: ir.Model, out_matmuls: Sequence[str]) -> Probe:
    """The probe of ``model`` (a copy is changed) for the output projections named ``out_matmuls``."""
    probe = model.clone()
    graph = probe.graph
    by_name = {n.name: n for n in graph if n.op_type == "MatMul"}
    contexts, weights = [], []
    for i, name in enumerate(out_matmuls):
        mm = by_name[name]
        ctx, w = mm.inputs[0], mm.inputs[1]
        wa = w.const_value.numpy()
        hidden, d = wa.shape
        weights.append(np.asarray(wa, np.float32))
        if not ctx.name:
            ctx.name = f"{PREFIX}.context.{i}"
        mask = ir.Value(name=f"{PREFIX}.mask.{i}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([hidden]))
        weight = ir.Value(name=f"{PREFIX}.weight.{i}", type=ir.TensorType(ir.DataType.FLOAT),
                          shape=ir.Shape([hidden, d]))
        bias = ir.Value(name=f"{PREFIX}.bias.{i}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([d]))
        graph.inputs.extend([mask, weight, bias])
        mul = ir.node("Mul", [ctx, mask], name=f"{PREFIX}_mask_{i}")
        graph.insert_before(mm, mul)
        mm.replace_input_with(0, mul.outputs[0])
        mm.replace_input_with(1, weight)
        out = mm.outputs[0]
        add = ir.node("Add", [out, bias], name=f"{PREFIX}_bias_{i}")
        graph.insert_after(mm, add)
        new = add.outputs[0]
        new.name = f"{PREFIX}.projected.{i}"
        for user, idx in list(out.uses()):
            if user is not add:
                user.replace_input_with(idx, new)
        if out.is_graph_output():
            graph.outputs[graph.outputs.index(out)] = new
        graph.outputs.append(ctx)
        contexts.append(ctx.name)
    sess = runtime.make_session(probe, threads=None)
    return Probe(sess, contexts, weights)
