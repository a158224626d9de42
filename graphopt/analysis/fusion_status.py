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
layer_norm  (Skip)(Simplified)LayerNormalization contrib ops,       ReduceMean of a square/Pow (decomposed
            EmbedLayerNormalization, ONNX LayerNormalization,        LayerNorm or RMSNorm)
            RMSNormalization (or ORT's SimplifiedLayerNormalization,
            which ORT puts in the ONNX domain): each is one ORT
            kernel, also when fed by an Add or by a Sum (``fuse``'s
            CPU form of a residual LayerNorm, see
            rewrites/fuse/rules/residual_norm.py); one fed by an Add is
            also counted in ``layer_norm_after_add`` (on CUDA,
            SkipLayerNormalization would absorb the Add)
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

``fused_ops`` counts the fused ops of each kind; ``attention_layers`` says how many attention layers the
fused attention kernels make: remove-padding runs each layer's attention as one kernel per length group
(the kernels of a layer feed one ``Concat``), so 48 kernels can be 6 layers x 8 length groups.
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
#: ops between a grouped attention kernel and the Concat that joins a layer's groups
_LAYOUT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


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


def _attention_layer(node: ir.Node) -> int:
    """The id of the attention layer of a fused attention kernel: the ``Concat`` its output reaches
    through layout ops when remove-padding split the layer into length groups, else the node itself."""
    value = node.outputs[0] if node.outputs else None
    for _ in range(4):
        uses = list(value.uses()) if value is not None else []
        if len(uses) != 1:
            break
        user = uses[0].node
        if user.op_type == "Concat" and user.domain == "":
            return id(user)
        if user.op_type not in _LAYOUT_OPS or not user.outputs:
            break
        value = user.outputs[0]
    return id(node)


def _attention_layers(kernels: list[ir.Node]) -> dict | None:
    """``{"layers", "kernels", "groups_per_layer"}`` of the fused attention kernels, or None without any.

    ``groups_per_layer`` is an int when every layer has the same number of length groups (1: one
    kernel per layer), else the sorted distinct counts."""
    if not kernels:
        return None
    per_layer: dict[int, int] = {}
    for n in kernels:
        key = _attention_layer(n)
        per_layer[key] = per_layer.get(key, 0) + 1
    counts = sorted(set(per_layer.values()))
    return {"layers": len(per_layer), "kernels": len(kernels),
            "groups_per_layer": counts[0] if len(counts) == 1 else counts}


def fusion_status(model: ir.Model) -> dict:
    """Counts of fused and unfused attention / LayerNorm / GELU sites and ``fully_fused``.

    Returns ``{"attention": {"fused", "unfused", "unfused_nodes"}, "layer_norm": {...},
    "gelu": {...}, "rotary": {...}, "ops": {contrib op: count}, "fused_ops": {kind: {op: count}},
    "attention_layers": {"layers", "kernels", "groups_per_layer"} | None, "layer_norm_after_add": int,
    "fully_fused": bool}``.
    """
    kinds = {k: {"fused": 0, "unfused": 0, "unfused_nodes": []} for k in ("attention", "layer_norm", "gelu", "rotary")}
    ops: dict[str, int] = {}
    fused_ops: dict[str, dict[str, int]] = {k: {} for k in kinds}
    kernels: list[ir.Node] = []
    after_add = 0

    def fused(kind: str, node: ir.Node) -> None:
        kinds[kind]["fused"] += 1
        fused_ops[kind][node.op_type] = fused_ops[kind].get(node.op_type, 0) + 1
        if kind == "attention":
            kernels.append(node)

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
            fused("rotary", node)
        elif op in _ATTENTION_OPS and node.domain == MS_DOMAIN:
            fused("attention", node)
        elif op == "Attention" and node.domain == "":  # ONNX opset 23 Attention
            fused("attention", node)
        elif op == "SDPA":
            unfused("attention", node)
        elif op == "Softmax" and node.domain == "" and _fed_by_matmul(node.inputs[0]):
            unfused("attention", node)
        elif op in _NORM_OPS and node.domain == MS_DOMAIN:
            fused("layer_norm", node)
        elif op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization") and node.domain == "":
            fused("layer_norm", node)  # ORT's own kernel, whatever feeds it
            src = node.inputs[0].producer() if node.inputs[0] is not None else None
            after_add += src is not None and src.op_type == "Add" and src.domain == ""
        elif op == "ReduceMean" and node.domain == "" and _is_square(node.inputs[0]):
            unfused("layer_norm", node)
        elif op in _GELU_OPS and contrib:
            fused("gelu", node)
        elif op in ("Erf", "Tanh") and node.domain == "":
            unfused("gelu", node)
        else:
            continue
        if node.domain == MS_DOMAIN:
            ops[op] = ops.get(op, 0) + 1
    out: dict = dict(kinds)
    out["ops"] = dict(sorted(ops.items()))
    out["fused_ops"] = {k: dict(sorted(v.items())) for k, v in fused_ops.items()}
    out["attention_layers"] = _attention_layers(kernels)
    out["layer_norm_after_add"] = after_add
    out["fully_fused"] = all(k["unfused"] == 0 for k in kinds.values())
    return out


def describe(status: dict) -> list[dict]:
    """One row per kind for display: ``{"kind", "fused", "unfused", "detail"}``; ``detail`` names the fused
    ops and, for attention, the layers (``6 layers x 8 length groups`` after remove-padding)."""
    rows = []
    for kind in ("attention", "layer_norm", "gelu", "rotary"):
        s = status[kind]
        parts = [", ".join(f"{op} {n}" for op, n in status.get("fused_ops", {}).get(kind, {}).items())]
        layers = status.get("attention_layers")
        if kind == "attention" and layers:
            groups = layers["groups_per_layer"]
            if groups != 1:
                g = groups if isinstance(groups, int) else "/".join(map(str, groups))
                parts.append(f"{layers['layers']} layers x {g} length groups (remove-padding: one kernel per "
                             "group of similar lengths)")
        if kind == "layer_norm" and status.get("layer_norm_after_add"):
            parts.append(f"{status['layer_norm_after_add']} after an Add (SkipLayerNormalization on CUDA)")
        if s["unfused"]:
            more = f" +{s['unfused'] - 3}" if s["unfused"] > 3 else ""
            parts.append("unfused: " + ", ".join(s["unfused_nodes"][:3]) + more)
        rows.append({"kind": kind, "fused": s["fused"], "unfused": s["unfused"],
                     "detail": "; ".join(p for p in parts if p) or "-"})
    return rows
