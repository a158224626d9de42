"""Is a model fully fused? Counts attention blocks, LayerNorms and GELUs, fused and not.

Used by ``graphopt inspect``. A site counts as *fused* when it is one ONNX Runtime kernel, or, for a
residual LayerNorm on CPU, ``Sum`` + ``LayerNormalization`` (two kernels, but 4x faster there than ORT's
scalar CPU ``SkipLayerNormalization``; ORT's own optimizer does not turn a ``Sum`` back into it):

=========== ======================================================= ==========================================
kind        fused                                                   left unfused
=========== ======================================================= ==========================================
attention   Attention, MultiHeadAttention, GroupQueryAttention,     every Softmax fed (through scale/mask
            PackedAttention, PackedMultiHeadAttention,               ops) by a MatMul; an onnxscript SDPA
            SparseAttention, DecoderMaskedMultiHeadAttention        placeholder
layer_norm  (Skip)(Simplified)LayerNormalization contrib ops,       ONNX LayerNormalization (or ORT's
            EmbedLayerNormalization, ONNX LayerNormalization (or     SimplifiedLayerNormalization) fed by
            ORT's SimplifiedLayerNormalization, which ORT puts in    an Add (a residual that SkipLayerNorm
            the ONNX domain) not fed by an Add: in particular fed    would absorb); ReduceMean of a
            by a Sum, ``fuse``'s CPU form of a residual LayerNorm    square/Pow (decomposed LayerNorm or
            (see rewrites/fuse_residual_norm.py)                     RMSNorm)
gelu        Gelu, FastGelu, BiasGelu, QuickGelu (contrib or ONNX)   Erf, Tanh (the decomposed forms)
rotary      com.microsoft RotaryEmbedding                           onnxscript's RotaryEmbedding placeholder
                                                                    (domain ``ai.onnxruntime._fusion``, a
                                                                    function ORT inlines: cos/sin cache
                                                                    not recognised)
=========== ======================================================= ==========================================

Any other op left in onnxscript's placeholder domain ``ai.onnxruntime._fusion`` counts as unfused
attention (``SDPA``) or rotary.

``fully_fused`` is true when nothing is left unfused in any kind (a model without attention counts as
fully fused in that kind).
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.opsets import FUSION_PLACEHOLDER_DOMAIN, MS_DOMAIN

_ATTENTION_OPS = {
    "Attention",
    "MultiHeadAttention",
    "GroupQueryAttention",
    "PackedAttention",
    "PackedMultiHeadAttention",
    "SparseAttention",
    "DecoderMaskedMultiHeadAttention",
    "DecoderMaskedSelfAttention",
}
_NORM_OPS = {
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "SimplifiedLayerNormalization",
    "EmbedLayerNormalization",
    "SkipGroupNorm",
}
_GELU_OPS = {"Gelu", "FastGelu", "BiasGelu", "QuickGelu"}
_SCORE_OPS = {"Add", "Mul", "Div", "Where", "Cast", "Sub"}


def _label(node: ir.Node) -> str:
    return f"{node.op_type} {node.name!r}"


def _fed_by_matmul(value: ir.Value | None, depth: int = 4) -> bool:
    node = value.producer() if value is not None else None
    while node is not None and depth > 0:
        if node.op_type in ("MatMul", "FusedMatMul"):
            return True
        if node.op_type not in _SCORE_OPS or not node.inputs:
            return False
        # follow the first input that is computed (the scores, not the mask/scale)
        nxt = None
        for inp in node.inputs:
            if inp is not None and inp.producer() is not None and inp.const_value is None:
                p = inp.producer()
                if p.op_type in ("MatMul", "FusedMatMul") or p.op_type in _SCORE_OPS:
                    nxt = p
                    break
        node = nxt
        depth -= 1
    return False


def _is_square(value: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    if node is None:
        return False
    if node.op_type == "Pow":
        return True
    return node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]


def fusion_status(model: ir.Model) -> dict:
    """Counts of fused and unfused attention / LayerNorm / GELU sites and ``fully_fused``.

    Returns ``{"attention": {"fused", "unfused", "unfused_nodes"}, "layer_norm": {...},
    "gelu": {...}, "ops": {contrib op: count}, "fully_fused": bool}``.
    """
    kinds = {k: {"fused": 0, "unfused": 0, "unfused_nodes": []} for k in ("attention", "layer_norm", "gelu", "rotary")}
    ops: dict[str, int] = {}

    def unfused(kind: str, node: ir.Node) -> None:
        kinds[kind]["unfused"] += 1
        kinds[kind]["unfused_nodes"].append(_label(node))

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        op = node.op_type
        contrib = node.domain in (MS_DOMAIN, "")
        if node.domain == FUSION_PLACEHOLDER_DOMAIN:
            unfused("rotary" if op == "RotaryEmbedding" else "attention", node)
            continue
        if op == "RotaryEmbedding" and node.domain == MS_DOMAIN:
            kinds["rotary"]["fused"] += 1
        elif op in _ATTENTION_OPS and node.domain == MS_DOMAIN:
            kinds["attention"]["fused"] += 1
        elif op == "Attention" and node.domain == "":  # ONNX opset 23 Attention
            kinds["attention"]["fused"] += 1
        elif op == "SDPA":
            unfused("attention", node)
        elif op == "Softmax" and node.domain == "" and _fed_by_matmul(node.inputs[0]):
            unfused("attention", node)
        elif op in _NORM_OPS and node.domain == MS_DOMAIN:
            kinds["layer_norm"]["fused"] += 1
        elif op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization") and node.domain == "":
            src = node.inputs[0].producer() if node.inputs[0] is not None else None
            if src is not None and src.op_type == "Add" and src.domain == "":
                unfused("layer_norm", node)
            else:
                kinds["layer_norm"]["fused"] += 1
        elif op == "ReduceMean" and node.domain == "" and _is_square(node.inputs[0]):
            unfused("layer_norm", node)
        elif op in _GELU_OPS and contrib:
            kinds["gelu"]["fused"] += 1
        elif op in ("Erf", "Tanh") and node.domain == "":
            unfused("gelu", node)
        else:
            continue
        if node.domain == MS_DOMAIN:
            ops[op] = ops.get(op, 0) + 1
    out: dict = dict(kinds)
    out["ops"] = dict(sorted(ops.items()))
    out["fully_fused"] = all(k["unfused"] == 0 for k in kinds.values())
    return out
