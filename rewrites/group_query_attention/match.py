"""Matching one layer's attention of a fused causal-LM-with-past graph (what ``fuse`` leaves).

Per layer (names as in a Llama export after ``fuse``)::

    q3d ─RotaryEmbedding(pos, cos, sin)──────────────────────────────────────────▶ query ┐
    k3d ─Reshape[B,S,Hkv,D]─Transpose(0,2,1,3)─RotaryEmbedding(pos, cos, sin)─┐         │
    past_key ───────────────────────────────────────────────────Concat(axis 2)─┴▶ present_key (graph output)
                                                [Unsqueeze(2)─Expand─Reshape] ──▶ key   ├─ MultiHeadAttention
    v3d ─Reshape[B,S,Hkv,D]─Transpose(0,2,1,3)─┐                                         │     (attention_bias)
    past_value ──────────────────Concat(axis 2)─┴▶ present_value ─[expand]──────▶ value ┘

The key's rotary may also sit on ``k3d`` before the Reshape. ``pos`` must be the past length
(``Shape(past_key_values.N.key)[2]``): every row's positions start at the past length.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from graphopt.onnxscript_compat import get_numpy_value
from graphopt.opsets import MS_DOMAIN

#: followed when tracing a scalar/1-element value back to its source
_PASS_THROUGH = ("Reshape", "Squeeze", "Unsqueeze", "Cast", "Identity")


@dataclasses.dataclass
class Layer:
    """One matched attention: what GroupQueryAttention takes, and what it replaces."""

    mha: ir.Node
    q3d: ir.Value
    k3d: ir.Value
    v3d: ir.Value
    past_key: ir.Value
    past_value: ir.Value
    present_key: ir.Value
    present_value: ir.Value
    num_heads: int
    kv_heads: int
    head_dim: int
    interleaved: int
    cos: ir.Value
    sin: ir.Value
    bias: ir.Value
    scale: float | None


class Refusal(Exception):
    """Why a layer does not fit GroupQueryAttention (the value it failed at, for --explain)."""

    def __init__(self, reason: str, where: ir.Value | ir.Node | None = None):
        name = getattr(where, "name", None)
        super().__init__(f"{reason}" + (f" (at {name!r})" if name else ""))


def _producer(v: ir.Value | None, op: str, domain: str = "") -> ir.Node | None:
    node = v.producer() if v is not None else None
    if node is not None and node.op_type == op and node.domain in ((domain,) if domain else ("", "ai.onnx")):
        return node
    return None


def _ints(v: ir.Value | None) -> list[int] | None:
    arr = get_numpy_value(v) if v is not None else None
    return None if arr is None else [int(x) for x in arr.reshape(-1)]


def _static(shape: ir.Shape | None, rank: int) -> list | None:
    if shape is None or shape.rank() != rank:
        return None
    return list(shape)


def is_past_length(v: ir.Value, past_inputs: set[str]) -> bool:
    """Whether ``v`` (a scalar or 1-element tensor) is ``Shape(past)[2]`` of a past input."""
    seen = 0
    while v is not None and seen < 8:
        node = v.producer()
        if node is None:
            return False
        if node.op_type == "Shape":
            src = node.inputs[0]
            start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", None)
            return src.name in past_inputs and start == 2 and end == 3
        if node.op_type == "Gather" and node.inputs[0].producer() is not None \
                and node.inputs[0].producer().op_type == "Shape":
            shape_node = node.inputs[0].producer()
            return (shape_node.inputs[0].name in past_inputs and _ints(node.inputs[1]) == [2]
                    and shape_node.attributes.get_int("start", 0) == 0)
        if node.op_type not in _PASS_THROUGH:
            return False
        v = node.inputs[0]
        seen += 1
    return False


def _rotary(node: ir.Node) -> tuple[int, tuple]:
    """(interleaved, (pos, cos, sin)) of a full rotary; Refusal for a partial or scaled one."""
    if node.attributes.get_int("rotary_embedding_dim", 0):
        raise Refusal("partial rotary (rotary_embedding_dim): GroupQueryAttention rotates whole heads", node)
    if node.attributes.get_int("is_packed_batching", 0):
        raise Refusal("packed-batching rotary", node)
    if node.attributes.get_float("scale", 1.0) != 1.0:
        raise Refusal("rotary with a scale", node)
    if len(node.inputs) != 4 or any(x is None for x in node.inputs):
        raise Refusal("rotary without position, cos and sin inputs", node)
    return node.attributes.get_int("interleaved", 0), tuple(node.inputs[1:4])


def _unexpand(v: ir.Value) -> ir.Value:
    """``x`` when ``v = Reshape(Expand(Unsqueeze(x, [2])))`` (head expansion of grouped KV), else ``v``."""
    rs = _producer(v, "Reshape")
    ex = _producer(rs.inputs[0], "Expand") if rs is not None else None
    un = _producer(ex.inputs[0], "Unsqueeze") if ex is not None else None
    if un is None or _ints(un.inputs[1]) != [2]:
        return v
    return un.inputs[0]


def _heads_3d(bhsd: ir.Value) -> tuple[ir.Value, int, int]:
    """``x3d`` and (heads, head_dim) when ``bhsd = Transpose(Reshape(x3d, [B, S, H, D]), (0, 2, 1, 3))``."""
    tr = _producer(bhsd, "Transpose")
    if tr is None or tuple(tr.attributes.get_ints("perm", ())) != (0, 2, 1, 3):
        raise Refusal("key/value is not Transpose(0,2,1,3) of a [B, S, H, D] reshape", bhsd)
    rs = _producer(tr.inputs[0], "Reshape")
    dims = _static(rs.outputs[0].shape, 4) if rs is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims[2:]):
        raise Refusal("key/value heads are not a [B, S, H, D] reshape with static H and D", bhsd)
    x3d = rs.inputs[0]
    if x3d.shape is None or x3d.shape.rank() != 3:
        raise Refusal("key/value projection is not [B, S, H*D]", x3d)
    return x3d, dims[2], dims[3]


def _cache_side(kv: ir.Value, what: str) -> tuple[ir.Node, ir.Value, ir.Value]:
    """(Concat, past input, new part) of the present ``kv`` feeds the attention."""
    present = _unexpand(kv)
    cat = _producer(present, "Concat")
    if cat is None or len(cat.inputs) != 2:
        raise Refusal(f"{what} is not a Concat of the past and the new positions (no KV cache)", kv)
    past, new = cat.inputs
    if cat.attributes.get_int("axis", 0) not in (2, -2):
        raise Refusal(f"{what} past is not concatenated on the sequence axis", present)
    if not past.is_graph_input():
        raise Refusal(f"{what} past {past.name!r} is not a graph input", past)
    if not present.is_graph_output():
        raise Refusal(f"{what} present is not a graph output", present)
    if len(present.uses()) != 1:  # the attention (through the head expansion) and nothing else
        raise Refusal(f"{what} present is used outside the attention", present)
    return cat, past, new


def match_layer(mha: ir.Node, past_inputs: set[str]) -> Layer:
    """The Layer of ``mha`` (a com.microsoft MultiHeadAttention), or Refusal."""
    ins = list(mha.inputs) + [None] * (8 - len(mha.inputs))
    query, key, value, bias, kpm, attn_bias, past_k, past_v = ins[:8]
    q_rot = _producer(query, "RotaryEmbedding", MS_DOMAIN)
    if q_rot is None:
        raise Refusal("query has no RotaryEmbedding before the attention (no rotary, or not fused)", query)
    if bias is not None or kpm is not None or past_k is not None or past_v is not None or len(mha.inputs) > 8:
        raise Refusal("MultiHeadAttention with a bias, key padding mask or past inputs", mha)
    if key is None or value is None:
        raise Refusal("packed MultiHeadAttention (no separate key and value)", mha)
    if attn_bias is None:
        raise Refusal("MultiHeadAttention without an attention bias (not causal)", mha)
    if any(o.uses() or o.is_graph_output() for o in mha.outputs[1:]):
        raise Refusal("MultiHeadAttention presents are used", mha)
    heads = mha.attributes.get_int("num_heads", 0)
    if mha.attributes.get_int("unidirectional", 0):
        raise Refusal("unidirectional MultiHeadAttention", mha)
    scale = mha.attributes.get_float("scale", 0.0) or None
    interleaved, rot_in = _rotary(q_rot)
    q3d = q_rot.inputs[0]
    if q3d.shape is None or q3d.shape.rank() != 3:
        raise Refusal("query rotary is not on the [B, S, H*D] projection", q3d)
    cat_k, past_key, k_new = _cache_side(key, "key")
    cat_v, past_value, v_new = _cache_side(value, "value")
    k_rot = _producer(k_new, "RotaryEmbedding", MS_DOMAIN)
    if k_rot is not None:  # rotary on [B, Hkv, S, D]
        k_int, k_in = _rotary(k_rot)
        k3d, kv_heads, head_dim = _heads_3d(k_rot.inputs[0])
    else:  # rotary on [B, S, Hkv*D] before the reshape
        k3d, kv_heads, head_dim = _heads_3d(k_new)
        k_rot = _producer(k3d, "RotaryEmbedding", MS_DOMAIN)
        if k_rot is None:
            raise Refusal("key has no RotaryEmbedding", k_new)
        k_int, k_in = _rotary(k_rot)
        k3d = k_rot.inputs[0]
    if k_int != interleaved:
        raise Refusal("query and key rotaries differ in interleaving", k_rot)
    if any(a is not b for a, b in zip(rot_in, k_in)):
        raise Refusal("query and key rotaries use different positions or caches", k_rot)
    v3d, v_heads, v_dim = _heads_3d(v_new)
    if (v_heads, v_dim) != (kv_heads, head_dim):
        raise Refusal(f"value heads {v_heads}x{v_dim} differ from key heads {kv_heads}x{head_dim}", v_new)
    if heads <= 0 or heads % kv_heads:
        raise Refusal(f"{heads} query heads are not a multiple of {kv_heads} key/value heads", mha)
    for v, h in ((q3d, heads), (k3d, kv_heads), (v3d, kv_heads)):
        last = v.shape[2] if v.shape is not None and v.shape.rank() == 3 else None
        if isinstance(last, int) and last != h * head_dim:
            raise Refusal(f"projection width {last} is not {h} heads x {head_dim}", v)
    for p in (past_key, past_value):
        dims = _static(p.shape, 4)
        if dims is None or dims[1] != kv_heads or dims[3] != head_dim:
            raise Refusal(f"past {p.name!r} is not [B, {kv_heads}, P, {head_dim}]", p)
    pos, cos, sin = rot_in
    if not is_past_length(pos, past_inputs):
        raise Refusal("rotary positions do not start at the past length (Shape(past)[2])", pos)
    return Layer(mha, q3d, k3d, v3d, past_key, past_value, cat_k.outputs[0], cat_v.outputs[0], heads, kv_heads,
                 head_dim, interleaved, cos, sin, attn_bias, scale)
