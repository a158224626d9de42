"""On CPU, express a residual LayerNorm as ``Sum`` + ``LayerNormalization`` instead of ``SkipLayerNormalization``.

``fuse`` first fuses ``LayerNorm(x + skip [+ bias])`` into ORT's ``SkipLayerNormalization`` (the
onnxscript rule, which handles every way exporters write the sum). For the CPU provider that node is
then rewritten to two kernels::

    SkipLayerNormalization(x, skip, gamma[, beta[, bias]])
        ──▶ Sum(x, skip[, bias]) ──▶ LayerNormalization(gamma[, beta], axis=-1)
    SkipSimplifiedLayerNormalization(x, skip, gamma[, bias])
        ──▶ Sum(x, skip[, bias]) ──▶ RMSNormalization(gamma, axis=-1)        (ONNX opset >= 23)

Why: ONNX Runtime's CPU ``SkipLayerNormalization`` kernel (float) is a scalar loop, while its
``LayerNormalization`` kernel is vectorised. Measured on this project's VM with
``tools/bench_norms.py`` (ORT 1.32, 1 thread, 12 chained residual norms at hidden 384, interleaved,
thread CPU time; table in docs/benchmarks.md): SkipLayerNormalization 4.4 ms against 1.0 ms for
Sum + LayerNormalization at 1x128, 71 ms against 20 ms at 32x68; for the simplified (RMSNorm) pair
the two forms are within ~20% either way.
``Sum`` and not ``Add``: ORT's own level-2 ``SkipLayerNormFusion`` turns ``Add [+ Add] ->
LayerNormalization`` back into the slow kernel whenever shapes are known; it does not look at ``Sum``.
The arithmetic is the same (one sum, then the normalisation), so the rewrite is exact up to float
rounding order. ``Sum`` broadcasts like the fused op's skip and bias.

The sum output of the fused op (output 3, used by pre-LN models as the next residual) becomes the
``Sum`` output. Refuses (node kept) when: the node's mean or inverse-std output (1, 2) is used; the
model's ONNX opset is below 17 (no ``LayerNormalization``), or, for the simplified form, below 23 (no
``RMSNormalization``; ORT's ``SimplifiedLayerNormalization`` sits in the ONNX domain without being an
ONNX op, so the ONNX checker rejects it); the node lacks gamma or has an ``epsilon`` that is not a float. With the CUDA provider the fused ops are kept (ORT's CUDA kernels
for them are fused and vectorised; not measured here).
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, default_opset
from graphopt.rewrites.fuse.steps import ReasonedStep

_SKIP_OPS = {"SkipLayerNormalization": "LayerNormalization", "SkipSimplifiedLayerNormalization": "RMSNormalization"}
#: LayerNormalization is an ONNX op from opset 17, RMSNormalization from opset 23
MIN_OPSET = {"SkipLayerNormalization": 17, "SkipSimplifiedLayerNormalization": 23}


def _refusal(node: ir.Node, graph: ir.Graph) -> str | None:
    label = f"{node.op_type} {node.name!r}"
    for i, out in enumerate(node.outputs[1:3], start=1):
        if out is not None and (out.uses() or out in graph.outputs):
            return f"{label}: its output {i} ({'mean' if i == 1 else 'inverse std'}) is used"
    if len(node.inputs) < 3 or any(v is None for v in node.inputs[:3]):
        return f"{label}: input, skip or gamma is missing"
    eps = node.attributes.get("epsilon")
    if eps is not None and eps.type != ir.AttributeType.FLOAT:
        return f"{label}: epsilon is not a float"
    return None


def _take_name(old: ir.Value, new: ir.Value) -> None:
    """``new`` takes over ``old``'s uses, graph-output slot and name."""
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = f"{name}_skipnorm_unused" if name else None
    new.name = name


class ResidualNormStep(ReasonedStep):
    """Fusion step: Skip(Simplified)LayerNormalization -> Sum + (Simplified)LayerNormalization (CPU)."""

    def apply_to_model(self, model: ir.Model, **_) -> int:
        self.reasons = []
        graph = model.graph
        sites = [n for n in graph if n.domain == MS_DOMAIN and n.op_type in _SKIP_OPS]
        if not sites:
            return 0
        opset = default_opset(model)
        done = 0
        for node in sites:
            why = _refusal(node, graph)
            if opset < MIN_OPSET[node.op_type]:
                why = f"{node.op_type} {node.name!r}: opset {opset} < {MIN_OPSET[node.op_type]} has no {_SKIP_OPS[node.op_type]}"
            if why:
                self.reasons.append(f"fuse: residual_norm: {why}")
                continue
            simplified = node.op_type == "SkipSimplifiedLayerNormalization"
            ins = list(node.inputs)
            x, skip, gamma = ins[:3]
            beta = None if simplified else (ins[3] if len(ins) > 3 else None)
            bias = ins[3 if simplified else 4] if len(ins) > (3 if simplified else 4) else None
            addends = [x, skip] + ([bias] if bias is not None else [])
            total = ir.node("Sum", addends, name=f"{node.name}_sum")
            total.outputs[0].dtype = x.dtype
            total.outputs[0].shape = x.shape
            attrs: dict = {"axis": -1}
            eps = node.attributes.get("epsilon")
            if eps is not None:
                attrs["epsilon"] = eps.as_float()
            norm_ins = [total.outputs[0], gamma] + ([beta] if beta is not None else [])
            norm = ir.node(_SKIP_OPS[node.op_type], norm_ins, attributes=attrs, name=f"{node.name}_norm")
            norm.outputs[0].dtype = x.dtype
            norm.outputs[0].shape = node.outputs[0].shape or x.shape
            graph.insert_before(node, [total, norm])
            _take_name(node.outputs[0], norm.outputs[0])
            if len(node.outputs) > 3 and node.outputs[3] is not None:
                s = node.outputs[3]
                if s.uses() or s in graph.outputs:
                    _take_name(s, total.outputs[0])
            graph.remove(node, safe=True)
            done += 1
        return done
