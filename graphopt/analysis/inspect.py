"""Model summary: opsets, IO signature, op histogram, parameters, FLOPs estimate, domains, subgraphs."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from graphopt import io
from graphopt.analysis.flops import estimate_flops as _estimate
from graphopt.analysis.fusion_status import fusion_status
from graphopt.analysis.params import parameter_count
from graphopt.opsets import op_histogram


def _sig(values) -> list[dict]:
    out = []
    for v in values:
        shape = None if v.shape is None else [d if isinstance(d, int) else str(d) for d in v.shape]
        out.append({"name": v.name, "dtype": str(v.dtype.name) if v.dtype is not None else None, "shape": shape})
    return out


def estimate_flops(model: ir.Model, batch: int = 1, seq: int = 128) -> dict[str, Any]:
    """FLOPs at ``batch``×``seq`` (see ``graphopt.analysis.flops``); ``unknown`` counts ops of unknown shape."""
    f = _estimate(model, batch, seq)
    return {"total": f["total"], "by_op": f["by_op"], "unknown": f["unknown_nodes"], "batch": batch, "seq": seq}


def _subgraphs(graph: ir.Graph, path: str = "") -> list[dict]:
    out = []
    for node in graph:
        for attr in node.attributes.values():
            graphs = []
            if attr.type == ir.AttributeType.GRAPH:
                graphs = [attr.value]
            elif attr.type == ir.AttributeType.GRAPHS:
                graphs = list(attr.value)
            for g in graphs:
                where = f"{path}{node.op_type} {node.name!r}.{attr.name}"
                out.append({"owner": where, "nodes": sum(1 for _ in ir.traversal.RecursiveGraphIterator(g))})
                out.extend(_subgraphs(g, where + "/"))
    return out


def inspect_model(model: ir.Model | str, *, batch: int = 1, seq: int = 128, flops: bool = True) -> dict[str, Any]:
    """Everything ``graphopt inspect`` shows, as a dict."""
    if not isinstance(model, ir.Model):
        model = io.load(model)
    g = model.graph
    hist = op_histogram(model)
    nbytes = 0
    dtypes: dict[str, int] = {}
    for v in g.initializers.values():
        t = v.const_value
        if t is None:
            continue
        nbytes += t.nbytes
        dtypes[t.dtype.name] = dtypes.get(t.dtype.name, 0) + 1
    domains = sorted({d or "ai.onnx" for d in model.opset_imports})
    info: dict[str, Any] = {
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name or ''} {model.producer_version or ''}".strip(),
        "opsets": {(k or "ai.onnx"): v for k, v in sorted(model.opset_imports.items())},
        "custom_domains": [d for d in domains if d not in ("ai.onnx", "")],
        "inputs": _sig(v for v in g.inputs if v.name not in g.initializers),
        "overridable_initializers": [v.name for v in g.inputs if v.name in g.initializers],
        "outputs": _sig(g.outputs),
        "nodes": sum(hist.values()),
        "ops": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        "parameters": parameter_count(g),
        "parameter_bytes": nbytes,
        "initializer_dtypes": dtypes,
        "functions": [f"{f.domain}::{f.name}" for f in model.functions.values()],
        "subgraphs": _subgraphs(g),
        "metadata": dict(model.metadata_props),
    }
    try:
        info["fusion"] = fusion_status(model)
    except Exception as e:  # analysis is best effort; say why it is missing
        info["fusion"] = {"error": f"{type(e).__name__}: {e}"}
    if flops:
        info["flops"] = estimate_flops(model, batch, seq)
    return info
