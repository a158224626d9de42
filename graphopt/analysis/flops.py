"""Rough FLOP estimates: 2 per multiply-accumulate of MatMul/Gemm/Conv and attention ops, their
integer and quantized forms included (MatMulInteger, MatMulIntegerToFloat, MatMulNBits, QAttention, ...).

Symbolic input dimensions are fixed (names with "batch" get ``batch``, the rest ``seq``) and shapes
come from ONNX shape inference; where a shape stays unknown, weights' shapes and the batch×seq
assumption fill in. Used by ``graphopt inspect`` and ``graphopt diff``.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import onnx
import onnx_ir as ir

from graphopt.analysis.shapes import proto_without_big_data, symbolic_infer
from graphopt.opsets import MS_DOMAIN, node_domain, op_key

logger = logging.getLogger(__name__)

#: FLOP estimates are made at this batch size and sequence length by default
FLOP_BATCH = 1
FLOP_SEQ = 128


def _concrete_shapes(model: ir.Model, batch: int, seq: int) -> dict[str, list[int]]:
    """Value name -> shape with the symbolic input dims fixed: ONNX Runtime's symbolic shape
    inference (it knows the contrib ops and sizes attention MatMuls), else ONNX's."""


    try:
        proto = ir.serde.serialize_model(model) if _small(model) else proto_without_big_data(model)
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


#: ops whose FLOPs are counted; one of these with an unknown shape is reported as unknown
COUNTED_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "Attention", "MultiHeadAttention", "MatMulNBits", "FusedMatMul", "MatMulInteger",
    "QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention", "QGemm", "QLinearConv",
    "ConvInteger",
})
#: matrix-multiply ops: (index of A, index of B); B's logical shape is ``[..., K, N]``
_MATMULS = {"MatMul": (0, 1), "FusedMatMul": (0, 1), "MatMulInteger": (0, 1), "MatMulIntegerToFloat": (0, 1),
            "DynamicQuantizeMatMul": (0, 1), "QLinearMatMul": (0, 3), "MatMulNBits": (0, 1)}
#: ops that keep the last dimension of their first input (for tracing the hidden size of a packed value)
_KEEP_LAST = {"Add", "Sub", "Mul", "Div", "Cast", "Identity", "QuantizeLinear", "DequantizeLinear", "Squeeze",
              "Unsqueeze", "Gather", "Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "LayerNormalization",
              "SkipLayerNormalization", "BiasGelu", "FastGelu", "Sum"}


def estimate_flops(model: ir.Model, batch: int = FLOP_BATCH, seq: int = FLOP_SEQ) -> dict:
    """Rough multiply-add FLOPs (2 per MAC) of MatMul/Gemm/Conv/Attention-like ops, main graph.

    Integer and quantized ops count like their float counterparts. Attention in length groups
    (remove-padding: several Attention nodes reading groups of one packed value, shapes known only
    at run time) counts the batch x seq tokens once per layer, shared among the groups.
    """
    shapes = _concrete_shapes(model, batch, seq)
    groups = _length_groups(model.graph)
    total = 0
    by_op: collections.Counter = collections.Counter()
    unknown = 0
    for node in model.graph:
        f = _node_flops(node, shapes, batch, seq)
        if f is None and node in groups:
            f = _group_attention_flops(node, groups[node], shapes, batch, seq)
        if f is None:
            if node.op_type in COUNTED_OPS:
                unknown += 1
            continue
        total += f
        by_op[op_key(node)] += f
    return {"total": int(total), "by_op": dict(by_op), "unknown_nodes": unknown, "batch": batch, "seq": seq}


def _weight_shape(v: ir.Value | None, shapes) -> list[int] | None:
    """Shape of a weight: its own, else that of the constant a DequantizeLinear/Transpose/Cast reads."""
    s = _shape(v, shapes)
    if s is not None or v is None:
        return s
    p = v.producer()
    if p is not None and p.op_type in ("DequantizeLinear", "Cast", "Identity") and p.inputs:
        return _weight_shape(p.inputs[0], shapes)
    if p is not None and p.op_type == "Transpose" and p.inputs:
        s = _weight_shape(p.inputs[0], shapes)
        perm = p.attributes.get("perm")
        if s is not None:
            return [s[i] for i in perm.value] if perm is not None else s[::-1]
    return None


def _matmul_flops(node: ir.Node, shapes, batch: int, seq: int) -> int | None:
    ia, ib = _MATMULS[node.op_type]
    ins = node.inputs
    if len(ins) <= ib:
        return None
    if node.op_type == "MatMulNBits":
        k_attr, n_attr = node.attributes.get("K"), node.attributes.get("N")
        if k_attr is None or n_attr is None:
            return None
        sb = [int(k_attr.value), int(n_attr.value)]
    else:
        sb = _weight_shape(ins[ib], shapes)
    if sb is None or len(sb) < 2:
        return None
    k, n = sb[-2], sb[-1]
    so = _shape(node.outputs[0], shapes) if node.outputs else None
    if so is not None and len(so) >= 1:
        return 2 * int(np.prod(so)) * k
    sa = _shape(ins[ia], shapes)
    if sa is not None and len(sa) >= 1:
        return 2 * int(np.prod(sa[:-1])) * k * n
    return 2 * batch * seq * k * n


def _node_flops(node: ir.Node, shapes, batch: int, seq: int) -> int | None:
    op = node.op_type
    ins = node.inputs
    if op in _MATMULS:
        return _matmul_flops(node, shapes, batch, seq)
    if op in ("Gemm", "QGemm") and len(ins) >= 2:
        sa, sb = _shape(ins[0], shapes), _weight_shape(ins[1 if op == "Gemm" else 3], shapes)
        if sa is None or sb is None:
            return None
        ta = node.attributes.get("transA")
        m_ = sa[1] if ta is not None and ta.value else sa[0]
        k = sa[0] if ta is not None and ta.value else sa[1]
        tb = node.attributes.get("transB")
        n = sb[0] if tb is not None and tb.value else sb[1]
        return 2 * m_ * k * n
    if op in ("Conv", "ConvInteger", "QLinearConv") and len(ins) >= 2:
        sw = _weight_shape(ins[3 if op == "QLinearConv" else 1], shapes)
        so = _shape(node.outputs[0], shapes) if node.outputs else None
        if sw is None or so is None:
            return None
        return 2 * int(np.prod(so)) * int(np.prod(sw[1:]))
    if op in ("Attention", "QAttention") and node_domain(node) == MS_DOMAIN:
        sx = _shape(ins[0], shapes)
        sw = _weight_shape(ins[1], shapes) if len(ins) > 1 else None
        if sw is None:
            return None
        b_, s_ = (sx[0], sx[1]) if sx is not None and len(sx) == 3 else (batch, seq)
        hidden, out3 = sw[0], sw[1]
        return 2 * b_ * s_ * hidden * out3 + 4 * b_ * s_ * s_ * (out3 // 3)
    if op == "MultiHeadAttention" and node_domain(node) == MS_DOMAIN:
        sx = _shape(ins[0], shapes)
        if sx is None or len(sx) != 3:
            return None
        b_, s_, h = sx
        return 4 * b_ * s_ * s_ * h
    if op == "Attention" and node_domain(node) == "":  # ONNX Attention (opset 23): Q [B, S, hidden] or [B, H, S, D]
        sq = _shape(ins[0], shapes)
        if sq is None or len(sq) not in (3, 4):
            return None
        sk = _shape(ins[1], shapes) if len(ins) > 1 else None
        b_, s_ = sq[0], (sq[1] if len(sq) == 3 else sq[2])
        s_kv = s_ if sk is None else (sk[1] if len(sk) == 3 else sk[2])
        h = sq[2] if len(sq) == 3 else sq[1] * sq[3]
        return 4 * b_ * s_ * s_kv * h
    return None


def _length_groups(graph: ir.Graph) -> dict[ir.Node, int]:
    """Attention nodes of length groups -> the number of groups of their layer: attention nodes whose
    query is a ``Gather`` of the same packed value (remove-padding's group layouts)."""
    by_source: dict[ir.Value, list[ir.Node]] = collections.defaultdict(list)
    for node in graph:
        if node.op_type in ("Attention", "MultiHeadAttention") and node.inputs and node.inputs[0] is not None:
            p = node.inputs[0].producer()
            if p is not None and p.op_type == "Gather" and p.inputs and p.inputs[0] is not None:
                by_source[p.inputs[0]].append(node)
    return {n: len(nodes) for nodes in by_source.values() if len(nodes) > 1 for n in nodes}


def _last_dim(v: ir.Value | None, shapes, depth: int = 0) -> int | None:
    """The last dimension of ``v``: known, else traced back to the matrix multiply that made it."""
    s = _shape(v, shapes)
    if s:
        return s[-1]
    if v is None or depth > 12:
        return None
    p = v.producer()
    if p is None or not p.inputs:
        return None
    if p.op_type in _MATMULS:
        sb = ([0, int(p.attributes["N"].value)] if p.op_type == "MatMulNBits" and "N" in p.attributes
              else _weight_shape(p.inputs[_MATMULS[p.op_type][1]], shapes))
        return sb[-1] if sb else None
    if p.op_type in _KEEP_LAST:
        for x in p.inputs[:2]:
            d = _last_dim(x, shapes, depth + 1)
            if d is not None:
                return d
    return None


def _group_attention_flops(node: ir.Node, n_groups: int, shapes, batch: int, seq: int) -> int | None:
    """One length group's share of a layer's attention FLOPs: 4·batch·seq²·hidden / groups."""
    hidden = _last_dim(node.inputs[0], shapes)
    if hidden is None:
        return None
    return 4 * batch * seq * seq * hidden // n_groups
