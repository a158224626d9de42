"""Rough FLOP estimates: 2 per multiply-accumulate of MatMul/Gemm/Conv and attention ops.

Symbolic input dimensions are fixed (names with "batch" get ``batch``, the rest ``seq``) and shapes
come from ONNX shape inference; where a shape stays unknown, weights' shapes and the batch×seq
assumption fill in. Used by ``graphopt inspect`` and ``graphopt diff``.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, node_domain, op_key

logger = logging.getLogger(__name__)

#: FLOP estimates are made at this batch size and sequence length by default
FLOP_BATCH = 1
FLOP_SEQ = 128


def _concrete_shapes(model: ir.Model, batch: int, seq: int) -> dict[str, list[int]]:
    """Value name -> shape with the symbolic input dims fixed: ONNX Runtime's symbolic shape
    inference (it knows the contrib ops and sizes attention MatMuls), else ONNX's."""
    import onnx

    from graphopt.analysis.shapes import symbolic_infer

    try:
        proto = ir.serde.serialize_model(model) if _small(model) else _proto_without_big_data(model)
        for vi in proto.graph.input:
            for d in vi.type.tensor_type.shape.dim:
                if not d.HasField("dim_value"):
                    name = d.dim_param.lower()
                    d.dim_value = batch if ("batch" in name or name in ("n", "b")) else seq
        del proto.graph.value_info[:]
    except Exception as e:  # noqa: BLE001 - FLOPs are best effort
        logger.info("cannot prepare shapes for FLOPs: %s", e)
        return {}
    try:
        inferred = symbolic_infer(proto, auto_merge=True, guess_output_rank=True)
    except Exception as e:  # noqa: BLE001
        logger.info("symbolic shape inference failed (%s); using ONNX shape inference", e)
        try:
            inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
        except Exception as e2:  # noqa: BLE001
            logger.info("shape inference for FLOPs failed: %s", e2)
            return {}
    shapes = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shapes[vi.name] = [d.dim_value for d in tt.shape.dim]
    return shapes


def _small(model: ir.Model) -> bool:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None) < 64 * 2**20


def _proto_without_big_data(model: ir.Model):
    """A ModelProto whose large initializers are graph inputs (shape only): cheap to infer."""
    import onnx

    big = {n for n, v in model.graph.initializers.items() if v.const_value is not None and v.const_value.size > 4096}
    g = model.graph
    saved = {n: g.initializers[n] for n in big}
    try:
        for n in big:
            g.initializers.pop(n)
        proto = ir.serde.serialize_model(model)
    finally:
        for n, v in saved.items():
            g.initializers[n] = v
    for n, v in saved.items():
        t = v.const_value
        elem = ir.DataType(t.dtype).value
        proto.graph.input.append(onnx.helper.make_tensor_value_info(n, elem, list(t.shape)))
    return proto


def _shape(v: ir.Value | None, shapes: dict[str, list[int]]) -> list[int] | None:
    if v is None:
        return None
    if v.const_value is not None:
        return [int(d) for d in v.const_value.shape]
    if v.name in shapes:
        return shapes[v.name]
    if v.shape is not None and all(isinstance(d, int) for d in v.shape):
        return [int(d) for d in v.shape]
    return None


def estimate_flops(model: ir.Model, batch: int = FLOP_BATCH, seq: int = FLOP_SEQ) -> dict:
    """Rough multiply-add FLOPs (2 per MAC) of MatMul/Gemm/Conv/Attention-like ops, main graph."""
    shapes = _concrete_shapes(model, batch, seq)
    total = 0
    by_op: collections.Counter = collections.Counter()
    unknown = 0
    for node in model.graph:
        f = _node_flops(node, shapes, batch, seq)
        if f is None:
            if node.op_type in ("MatMul", "Gemm", "Conv", "Attention", "MultiHeadAttention", "MatMulNBits",
                                "FusedMatMul", "MatMulInteger", "QLinearMatMul"):
                unknown += 1
            continue
        total += f
        by_op[op_key(node)] += f
    return {"total": int(total), "by_op": dict(by_op), "unknown_nodes": unknown, "batch": batch, "seq": seq}


def _node_flops(node: ir.Node, shapes, batch: int, seq: int) -> int | None:
    op = node.op_type
    ins = node.inputs
    if op in ("MatMul", "FusedMatMul", "MatMulInteger") and len(ins) >= 2:
        sa, sb = _shape(ins[0], shapes), _shape(ins[1], shapes)
        if sb is None or len(sb) < 2:
            return None
        k, n = sb[-2], sb[-1]
        so = _shape(node.outputs[0], shapes) if node.outputs else None
        if so is not None and len(so) >= 1:
            return 2 * int(np.prod(so)) * k
        if sa is not None and len(sa) >= 1:
            return 2 * int(np.prod(sa[:-1])) * k * n
        return 2 * batch * seq * k * n
    if op == "Gemm" and len(ins) >= 2:
        sa, sb = _shape(ins[0], shapes), _shape(ins[1], shapes)
        if sa is None or sb is None:
            return None
        ta = node.attributes.get("transA")
        m_ = sa[1] if ta is not None and ta.value else sa[0]
        k = sa[0] if ta is not None and ta.value else sa[1]
        tb = node.attributes.get("transB")
        n = sb[0] if tb is not None and tb.value else sb[1]
        return 2 * m_ * k * n
    if op == "Conv" and len(ins) >= 2:
        sw = _shape(ins[1], shapes)
        so = _shape(node.outputs[0], shapes) if node.outputs else None
        if sw is None or so is None:
            return None
        return 2 * int(np.prod(so)) * int(np.prod(sw[1:]))
    if op in ("Attention", "MultiHeadAttention") and node_domain(node) == MS_DOMAIN:
        sx = _shape(ins[0], shapes)
        if op == "Attention":
            sw = _shape(ins[1], shapes) if len(ins) > 1 else None
            if sw is None:
                return None
            b_, s_ = (sx[0], sx[1]) if sx is not None and len(sx) == 3 else (batch, seq)
            hidden, out3 = sw[0], sw[1]
            return 2 * b_ * s_ * hidden * out3 + 4 * b_ * s_ * s_ * (out3 // 3)
        if sx is None or len(sx) != 3:
            return None
        b_, s_, h = sx
        return 4 * b_ * s_ * s_ * h
    return None
