"""Model summary: opsets, IO signature, op histogram, parameters, FLOPs estimate, domains, subgraphs."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphopt import io
from graphopt.report import op_histogram

logger = logging.getLogger(__name__)


def _sig(values) -> list[dict]:
    out = []
    for v in values:
        shape = None if v.shape is None else [d if isinstance(d, int) else str(d) for d in v.shape]
        out.append({"name": v.name, "dtype": str(v.dtype.name) if v.dtype is not None else None, "shape": shape})
    return out


def _concrete_proto(model: ir.Model, batch: int, seq: int) -> onnx.ModelProto:
    """A copy whose symbolic input dims are set to batch/seq, with shapes inferred."""
    from graphopt.feeds import _dim_value

    proto = io.to_proto(model)
    sizes: dict[str, int] = {}
    defaults = {"batch": batch, "seq": seq, "past": 0, "other": 1}
    inits = {i.name for i in proto.graph.initializer}
    for inp in proto.graph.input:
        if inp.name in inits or not inp.type.HasField("tensor_type"):
            continue
        for d in inp.type.tensor_type.shape.dim:
            if d.HasField("dim_param") or not d.HasField("dim_value"):
                name = d.dim_param
                val = _dim_value(ir.SymbolicDim(name) if name else None, sizes, defaults)
                d.Clear()
                d.dim_value = max(val, 1)
    del proto.graph.value_info[:]
    try:
        from graphopt.shapes import symbolic_infer

        return symbolic_infer(proto, auto_merge=True, guess_output_rank=True)
    except Exception as e:  # fall back to ONNX's inference (does not know contrib ops)
        logger.info("symbolic shape inference failed (%s); using onnx shape inference", e)
        return onnx.shape_inference.infer_shapes(proto, data_prop=True)


def _shape_map(proto: onnx.ModelProto) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    for vi in list(proto.graph.value_info) + list(proto.graph.input) + list(proto.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    for init in proto.graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _prod(xs) -> int | None:
    if xs is None or any(x is None for x in xs):
        return None
    return int(np.prod(xs, dtype=np.int64)) if xs else 1


def estimate_flops(model: ir.Model, batch: int = 1, seq: int = 128) -> dict[str, Any]:
    """Multiply-add FLOPs (2 per MAC) of MatMul/Gemm/Conv/attention ops at ``batch``×``seq``.

    Subgraphs are not counted. ``unknown`` counts ops whose shapes could not be inferred.
    """
    # Shape inference may treat a batch of 1 as broadcastable and lose it; infer at batch >= 2 and
    # scale (every counted op is linear in the batch size).
    b_used = max(batch, 2)
    try:
        proto = _concrete_proto(model, b_used, seq)
    except Exception as e:
        return {"total": None, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    shapes = _shape_map(proto)
    total = 0
    by_op: dict[str, int] = {}
    unknown = 0
    for n in proto.graph.node:
        f = None
        ins = [shapes.get(i) if i else None for i in n.input]
        outs = [shapes.get(o) for o in n.output]
        try:
            if n.op_type in ("MatMul", "MatMulInteger", "FusedMatMul", "MatMulNBits", "MatMulIntegerToFloat", "Gemm"):
                a = ins[0]
                o = outs[0]
                if a and o and _prod(o) is not None and a[-1] is not None:
                    k = a[-1] if not (n.op_type == "Gemm" and any(at.name == "transA" and at.i for at in n.attribute)) else a[0]
                    f = 2 * _prod(o) * k
            elif n.op_type in ("Conv", "ConvInteger", "QLinearConv"):
                w = ins[1] if n.op_type != "QLinearConv" else ins[3]
                o = outs[0]
                if w and o and _prod(o) is not None and _prod(w[1:]) is not None:
                    f = 2 * _prod(o) * _prod(w[1:])
            elif n.domain == "com.microsoft" and n.op_type == "Attention":
                x, w = ins[0], ins[1]
                if x and w and _prod(x) is not None and w[-1] is not None:
                    b, s, h = x
                    f = 2 * b * s * h * w[-1] + 4 * b * s * s * h
            elif n.domain == "com.microsoft" and n.op_type in ("MultiHeadAttention", "GroupQueryAttention", "PackedAttention", "PackedMultiHeadAttention"):
                q = ins[0]
                if q and _prod(q) is not None and len(q) == 3:
                    b, s, h = q
                    f = 4 * b * s * s * h
        except (TypeError, ValueError, IndexError):
            f = None
        if f is None:
            if n.op_type in ("MatMul", "Gemm", "Conv", "Attention", "MultiHeadAttention"):
                unknown += 1
            continue
        total += f
        by_op[n.op_type] = by_op.get(n.op_type, 0) + f
    scale = batch / b_used
    by_op = {k: int(v * scale) for k, v in by_op.items()}
    return {"total": int(total * scale), "by_op": by_op, "unknown": unknown, "batch": batch, "seq": seq}


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
    params = 0
    nbytes = 0
    dtypes: dict[str, int] = {}
    for v in g.initializers.values():
        t = v.const_value
        if t is None:
            continue
        params += int(np.prod(t.shape.numpy(), dtype=np.int64)) if t.shape is not None else 0
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
        "parameters": params,
        "parameter_bytes": nbytes,
        "initializer_dtypes": dtypes,
        "functions": [f"{f.domain}::{f.name}" for f in model.functions.values()],
        "subgraphs": _subgraphs(g),
        "metadata": dict(model.metadata_props),
    }
    try:
        from graphopt.fusion_status import fusion_status

        info["fusion"] = fusion_status(model)
    except ImportError:
        pass
    except Exception as e:  # analysis is best effort; say why it is missing
        info["fusion"] = {"error": f"{type(e).__name__}: {e}"}
    if flops:
        info["flops"] = estimate_flops(model, batch, seq)
    return info
