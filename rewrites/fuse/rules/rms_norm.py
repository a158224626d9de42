"""RMSNorm as an op the model's opset has: ONNX ``RMSNormalization`` (opset >= 23), else standard ops.

onnxscript's RMSNorm rule writes ORT's ``SimplifiedLayerNormalization``, which ORT registers in the
*ONNX* domain. No ONNX opset defines that op, so the ONNX checker rejects the model ("No Op
registered for SimplifiedLayerNormalization with domain_version of 20"), and there is no
``com.microsoft`` form of it. ``fuse`` still lets the rule run, because the residual rule
(``SkipSimplifiedLayerNormalization``, a genuine ``com.microsoft`` contrib op) matches on its output;
this step, run last, then turns each ``SimplifiedLayerNormalization`` left over into::

    opset >= 23:  SimplifiedLayerNormalization(x, scale)  ──▶ RMSNormalization(x, scale)    (same attributes)
    opset <  23:  SimplifiedLayerNormalization(x, scale)  ──▶ [Cast] Pow(·, 2) ReduceMean Add(eps) Sqrt
                                                              Reciprocal Mul(x) [Cast] Mul(scale)

The second form is the RMSNorm the exporters write (and the rule matched), so below opset 23 an RMSNorm
that is not a residual one stays unfused: a missed pattern, reported by ``--explain``. ONNX Runtime
1.32's own optimizer does not fuse this form either (checked on a Qwen2 export at
``ORT_ENABLE_EXTENDED``). Both rewrites are exact: the same arithmetic in the same order.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.opsets import default_opset
from graphopt.rewrites.fuse.steps import ReasonedStep

#: first ONNX opset with RMSNormalization
RMS_OPSET = 23
_SLN = "SimplifiedLayerNormalization"


def _const(name: str, array: np.ndarray) -> ir.Node:
    return ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)}, name=name)


def _reduce_axes(node: ir.Node, x: ir.Value) -> list[int] | None:
    axis = node.attributes.get_int("axis", -1)
    if axis < 0:
        return list(range(axis, 0))
    if x.shape is None:
        return None
    return list(range(axis, x.shape.rank()))


def _expand(node: ir.Node, opset: int) -> tuple[list[ir.Node], ir.Value, ir.Value] | str:
    """(nodes, y, inverse rms) of the standard-op RMSNorm equal to ``node``, or why it cannot be written."""
    x, scale = (list(node.inputs) + [None, None])[:2]
    if x is None or scale is None:
        return "input or scale missing"
    axes = _reduce_axes(node, x)
    if axes is None:
        return "positive axis on an input of unknown rank"
    stash = ir.DataType(node.attributes.get_int("stash_type", ir.DataType.FLOAT))
    out_type = node.outputs[0].dtype or x.dtype
    eps = node.attributes.get_float("epsilon", 1e-5)
    base = node.name or "rms"
    nodes: list[ir.Node] = []

    def add(op: str, inputs, dtype, **attrs) -> ir.Value:
        n = ir.node(op, list(inputs), attributes=attrs, name=f"{base}_{op.lower()}_{len(nodes)}")
        n.outputs[0].dtype = dtype
        nodes.append(n)
        return n.outputs[0]

    def const(suffix: str, array: np.ndarray) -> ir.Value:
        n = _const(f"{base}_{suffix}", array)
        nodes.append(n)
        return n.outputs[0]

    np_stash = stash.numpy()
    xc = add("Cast", [x], stash, to=stash) if x.dtype != stash else x
    square = add("Pow", [xc, const("two", np.array(2.0, dtype=np_stash))], stash)
    if opset >= 18:
        mean = add("ReduceMean", [square, const("axes", np.array(axes, dtype=np.int64))], stash, keepdims=1)
    else:
        mean = add("ReduceMean", [square], stash, axes=axes, keepdims=1)
    std = add("Sqrt", [add("Add", [mean, const("eps", np.array(eps, dtype=np_stash))], stash)], stash)
    inv = add("Reciprocal", [std], stash)
    normed = add("Mul", [xc, inv], stash)
    if out_type is not None and out_type != stash:
        normed = add("Cast", [normed], out_type, to=out_type)
    gamma = scale
    if out_type is not None and scale.dtype not in (None, out_type):
        gamma = add("Cast", [scale], out_type, to=out_type)
    y = add("Mul", [normed, gamma], out_type)
    y.shape = node.outputs[0].shape or x.shape
    return nodes, y, inv


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` takes over ``old``'s uses, graph-output slot, name, and type and shape where it has none."""
    name = old.name
    new.shape = new.shape or old.shape
    new.type = new.type or old.type
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = f"{name}_sln_unused" if name else None
    new.name = name


class RmsNormStep(ReasonedStep):
    """Fusion step: ``SimplifiedLayerNormalization`` (ONNX domain) -> ``RMSNormalization`` or standard ops."""

    def __init__(self) -> None:
        super().__init__()
        self.expanded = 0

    def apply_to_model(self, model: ir.Model, **_) -> int:
        self.reasons = []
        self.expanded = 0
        opset = default_opset(model)
        done = 0
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.op_type != _SLN or node.domain != "":
                continue
            graph = node.graph
            label = f"{_SLN} {node.name!r}"
            inv_used = any(o is not None and (o.uses() or o in graph.outputs) for o in node.outputs[1:])
            if opset >= RMS_OPSET and not inv_used:
                attrs = {k: v for k, v in node.attributes.items() if k in ("axis", "epsilon", "stash_type")}
                rms = ir.node("RMSNormalization", list(node.inputs[:2]), attributes=attrs, name=node.name)
                rms.outputs[0].dtype = node.outputs[0].dtype
                rms.outputs[0].shape = node.outputs[0].shape
                graph.insert_before(node, [rms])
                _take_over(node.outputs[0], rms.outputs[0])
                graph.remove(node, safe=True)
                done += 1
                continue
            expanded = _expand(node, opset)
            if isinstance(expanded, str):  # never for what the rules write; the node stays and the checker names it
                self.reasons.append(f"fuse: rms_normalization: {label}: {expanded}")
                continue
            nodes, y, inv = expanded
            graph.insert_before(node, nodes)
            _take_over(node.outputs[0], y)
            if inv_used:
                _take_over(node.outputs[1], inv)
            graph.remove(node, safe=True)
            self.expanded += 1
            why = "its inverse-rms output is used" if opset >= RMS_OPSET else (
                f"opset {opset} < {RMS_OPSET} has no RMSNormalization (ORT's SimplifiedLayerNormalization is not an ONNX op)")
            self.reasons.append(f"fuse: rms_normalization: {label}: {why}; left as standard ops")
        return done
