"""Standard-op attention over a KIVI-form cache, in place of one ``GroupQueryAttention`` (see the package).

Per layer (q, k, v: the node's query / key / value, or its packed QKV split)::

    q, k ── RotaryEmbedding(position_ids, the node's cos / sin caches) ──▶ q', k'  (when do_rotary)
    scores = [q'·(float16 sink) | (q' * key scale)·codes + q'·key min | q'·(float16 window, k')]   position order
    out    = p·[float16 sink] + (p * value scale)·codes + p·value min + p·v'     p = Softmax(scores + mask)

(query head i reads kv head i // group). The scales are folded into the query and into the attention weights,
so no dequantized float copy of the cache is made; the codes are read one bit field at a time (``_parts``: a
scalar ``BitShift`` / ``BitwiseAnd`` each, one MatMul each, the small products interleaved). The mask (one per
graph) is 0 where a key position is both in the row's attention mask and not after the query's own position,
else -1e9.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphopt.generate.kivi import PLANES, KiviFormat, names
from graphopt.opsets import MS_DOMAIN

F32, F16, U8, I64 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.UINT8, ir.DataType.INT64


class Builder:
    """Nodes inserted before an anchor node, constants registered once in the graph."""

    def __init__(self, graph: ir.Graph, prefix: str, const_prefix: str | None = None):
        self.graph, self.prefix, self.nodes, self._n = graph, prefix, [], 0
        self.const_prefix = prefix if const_prefix is None else const_prefix

    def const(self, name: str, arr: np.ndarray) -> ir.Value:
        full = f"{self.const_prefix}{name}"
        if full in self.graph.initializers:
            return self.graph.initializers[full]
        arr = np.asarray(arr)
        v = ir.Value(name=full, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     const_value=ir.tensor(arr, name=full))
        self.graph.register_initializer(v)
        return v

    def op(self, op_type: str, inputs, *, domain: str = "", dtype=None, shape=None, **attrs) -> ir.Value:
        self._n += 1
        node = ir.node(op_type, list(inputs), attributes=attrs, domain=domain,
                       name=f"{self.prefix}{op_type}_{self._n}")
        out = node.outputs[0]
        out.name = f"{self.prefix}{op_type.lower()}_{self._n}"
        if dtype is not None:
            out.type = ir.TensorType(dtype)
        if shape is not None:
            out.shape = ir.Shape(shape)
        self.nodes.append(node)
        return out

    def flush(self, anchor: ir.Node) -> None:
        self.graph.insert_before(anchor, self.nodes)
        self.nodes = []


def mask_bias(b: Builder, attention_mask: ir.Value, input_ids: ir.Value) -> ir.Value:
    """[batch, 1, 1, n, T] float: 0 where query i (position T - n + i) may read key position j, else -1e9."""
    i64 = lambda name, v: b.const(name, np.array(v, np.int64))  # noqa: E731
    total = b.op("Shape", [attention_mask], start=1, end=2)
    new = b.op("Shape", [input_ids], start=1, end=2)
    t = b.op("Squeeze", [total, i64("axis0", [0])])
    n = b.op("Squeeze", [new, i64("axis0", [0])])
    j = b.op("Range", [i64("zero", 0), t, i64("one", 1)])
    i = b.op("Range", [b.op("Sub", [t, n]), t, i64("one", 1)])
    causal = b.op("LessOrEqual", [b.op("Unsqueeze", [j, i64("axis0", [0])]),
                                  b.op("Unsqueeze", [i, i64("axis1", [1])])])  # [n, T]
    keep = b.op("Equal", [attention_mask, i64("one", 1)])  # [batch, T]
    allowed = b.op("And", [b.op("Unsqueeze", [keep, i64("axis1", [1])]), causal])  # [batch, n, T]
    bias = b.op("Where", [allowed, b.const("zero_f", np.array(0.0, np.float32)),
                          b.const("masked", np.array(-1e9, np.float32))])
    return b.op("Unsqueeze", [bias, i64("axes12", [1, 2])], dtype=F32)


def _parts(b: Builder, planes: list[ir.Value], bits: int):
    """(weight, part index, parts per byte, float codes) of every code a byte of the bit planes of ``bits``
    holds: code = sum of weight * part, part ``i`` of a byte being its (i)th ``w``-bit field. Each part is
    used on its own (a MatMul each, interleaved on the small product): unpacking into one tensor costs ONNX
    Runtime more than the MatMuls (its broadcasting BitShift especially)."""
    shift = 0
    for w, plane in zip(PLANES[bits], planes, strict=True):
        per = 8 // w
        for i in range(per):
            x = plane
            if i:
                x = b.op("BitShift", [x, b.const(f"by{w * i}", np.array(w * i, np.uint8))], direction="RIGHT")
            if i < per - 1:
                x = b.op("BitwiseAnd", [x, b.const(f"mask{w}", np.array((1 << w) - 1, np.uint8))])
            yield float(1 << shift), i, per, x
        shift += w


def _interleave(b: Builder, products: list[tuple[float, int, int, ir.Value]], width: int, rank: int = 5) -> ir.Value:
    """Sum over planes of weight * (the parts' products interleaved along the last axis into ``width``)."""
    total, plane = None, []
    for weight, i, per, y in products:
        plane.append(b.op("Unsqueeze", [y, b.const("axis_last", np.array([-1], np.int64))]))
        if i < per - 1:
            continue
        x = b.op("Concat", plane, axis=-1) if per > 1 else plane[0]
        x = b.op("Reshape", [x, b.const(f"last{rank}_{width}", np.array([0] * (rank - 1) + [width], np.int64))])
        if weight != 1.0:
            x = b.op("Mul", [x, b.const(f"w{int(weight)}", np.array(weight, np.float32))])
        total = x if total is None else b.op("Add", [total, x])
        plane = []
    return total


def layer_inputs(layer: int, fmt: KiviFormat, kv_heads: int, d: int) -> dict[str, ir.Value]:
    """The new graph inputs of ``layer``'s cache by role (``kivi.names``)."""
    out = {}
    for role, name in names(layer, fmt).items():
        if role in ("key", "value"):
            shape, dtype = [f"{role}_float16_positions", "batch", kv_heads, d], F16
        elif role.startswith("key.codes"):
            w = int(role[len("key.codes"):])
            shape, dtype = ["key_groups", "batch", kv_heads, d, fmt.group * w // 8], U8
        elif role in ("key.scale", "key.min"):
            shape, dtype = ["key_groups", "batch", kv_heads, d], F16
        elif role.startswith("value.codes"):
            w = int(role[len("value.codes"):])
            shape, dtype = ["value_quantized_positions", "batch", kv_heads, d * w // 8], U8
        else:
            shape, dtype = ["value_quantized_positions", "batch"], F16
        out[role] = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
    return out


def attention(b: Builder, node: ir.Node, cache: dict[str, ir.Value], fmt: KiviFormat, positions: ir.Value,
              bias: ir.Value, d: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(attention output [batch, n, heads * d], new keys, new values [batch, kv_heads, n, d]) for ``node``."""
    heads, kv_heads = node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")
    group = heads // kv_heads
    i64 = lambda name, v: b.const(name, np.array(v, np.int64))  # noqa: E731
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    if k is None:
        split = ir.node("Split", [q, i64(f"qkv_split_{heads}_{kv_heads}_{d}", [heads * d, kv_heads * d, kv_heads * d])],
                        attributes={"axis": -1}, num_outputs=3, name=f"{b.prefix}Split_qkv")
        for o, part in zip(split.outputs, "qkv"):
            o.name, o.type = f"{b.prefix}{part}", ir.TensorType(F32)
        b.nodes.append(split)
        q, k, v = split.outputs
    if node.attributes.get_int("do_rotary", 0):
        cos, sin = node.inputs[7], node.inputs[8]
        inter = node.attributes.get_int("rotary_interleaved", 0)
        q = b.op("RotaryEmbedding", [q, positions, cos, sin], domain=MS_DOMAIN, interleaved=inter, num_heads=heads)
        k = b.op("RotaryEmbedding", [k, positions, cos, sin], domain=MS_DOMAIN, interleaved=inter,
                 num_heads=kv_heads)
    # the cache is read only once this layer's query exists: without the dependency ONNX Runtime may dequantize
    # every layer's cache first (they depend on graph inputs only) and hold them all at once
    after = b.op("Add", [i64("big", [np.iinfo(np.int64).max]),
                         b.op("Mul", [b.op("Shape", [q], start=0, end=1), i64("zero1", [0])])])
    cache = {role: b.op("Slice", [v, i64("zero1", [0]), after, i64("axis0", [0])], dtype=v.dtype, shape=v.shape)
             if ".codes" in role else v for role, v in cache.items()}  # the codes: the large ones
    perm = [0, 2, 1, 3]
    k_new = b.op("Transpose", [b.op("Reshape", [k, i64(f"heads{kv_heads}", [0, 0, kv_heads, d])])], perm=perm)
    v_new = b.op("Transpose", [b.op("Reshape", [v, i64(f"heads{kv_heads}", [0, 0, kv_heads, d])])], perm=perm)
    scale_attr = node.attributes.get_float("scale", 0.0) or 1.0 / np.sqrt(d)
    qh = b.op("Transpose", [b.op("Reshape", [q, i64(f"qheads{kv_heads}_{group}", [0, 0, kv_heads, group, d])])],
              perm=[0, 2, 3, 1, 4])  # [batch, h, group, n, d]
    qh = b.op("Mul", [qh, b.const(f"scale{d}", np.array(scale_attr, np.float32))])
    # scores of the float16 keys and the new ones: [sink | window | new]
    k_fp = b.op("Concat", [b.op("Cast", [cache["key"]], to=F32), b.op("Transpose", [k_new], perm=[2, 0, 1, 3])],
                axis=0)
    kt_fp = b.op("Unsqueeze", [b.op("Transpose", [k_fp], perm=[1, 2, 3, 0]), i64("axis2", [2])])
    sc_fp = b.op("MatMul", [qh, kt_fp])  # [batch, h, group, n, F + n]
    last = i64("axis_last", [-1])
    sc_sink = b.op("Slice", [sc_fp, i64("zero1", [0]), i64("sink", [fmt.sink]), last])
    sc_rest = b.op("Slice", [sc_fp, i64("sink", [fmt.sink]), i64("big", [np.iinfo(np.int64).max]), last])
    # scores of the quantized keys, the scales folded into the query: q.(c s + m) = (q s).c + q.m, per group
    k_scale = b.op("Unsqueeze", [b.op("Cast", [cache["key.scale"]], to=F32), i64("axes34", [3, 4])])  # [.., 1, 1, d]
    k_min = b.op("Unsqueeze", [b.op("Cast", [cache["key.min"]], to=F32), i64("axes35", [3, 5])])  # [.., 1, d, 1]
    q7 = b.op("Unsqueeze", [qh, i64("axis0", [0])])  # [1, batch, h, group, n, d]
    qs = b.op("Mul", [q7, k_scale])  # [groups, batch, h, group, n, d]
    products = []
    planes = [b.op("Unsqueeze", [cache[f"key.codes{w}"], i64("axis3", [3])]) for w in PLANES[fmt.key_bits]]
    for weight, i, per, part in _parts(b, planes, fmt.key_bits):
        codes = b.op("Cast", [part], to=F32)  # [groups, b, h, 1, d, G/per]
        # [groups, batch, h, group, n, G/per] -> [batch, h, group, n, groups, G/per]
        products.append((weight, i, per, b.op("Transpose", [b.op("MatMul", [qs, codes])], perm=[1, 2, 3, 4, 0, 5])))
    sc_q = _interleave(b, products, fmt.group, rank=6)
    sc_q = b.op("Add", [sc_q, b.op("Transpose", [b.op("MatMul", [q7, k_min])], perm=[1, 2, 3, 4, 0, 5])])
    sc_q = b.op("Reshape", [sc_q, i64("flat4", [0, 0, 0, 0, -1])])  # [batch, h, group, n, Qk]
    scores = b.op("Add", [b.op("Concat", [sc_sink, sc_q, sc_rest], axis=-1), bias])
    probs = b.op("Softmax", [scores], axis=-1)  # [batch, h, group, n, T]: sink | quantized | new
    # values: the float16 sink, the quantized positions (scales folded into the weights), the new ones
    sink = b.op("Shape", [cache["value"]], start=0, end=1)
    new = b.op("Neg", [b.op("Shape", [q], start=1, end=2)])
    p_sink = b.op("Slice", [probs, i64("zero1", [0]), sink, last])
    p_mid = b.op("Slice", [probs, sink, new, last])
    p_new = b.op("Slice", [probs, new, i64("big", [np.iinfo(np.int64).max]), last])
    v_sink = b.op("Unsqueeze", [b.op("Transpose", [b.op("Cast", [cache["value"]], to=F32)], perm=[1, 2, 0, 3]),
                                i64("axis2", [2])])
    ctx = b.op("Add", [b.op("MatMul", [p_sink, v_sink]),
                       b.op("MatMul", [p_new, b.op("Unsqueeze", [v_new, i64("axis2", [2])])])])
    v_scale = b.op("Unsqueeze", [b.op("Transpose", [b.op("Cast", [cache["value.scale"]], to=F32)], perm=[1, 0]),
                                 i64("axes123", [1, 2, 3])])  # [batch, 1, 1, 1, Qv]
    v_min = b.op("Unsqueeze", [b.op("Transpose", [b.op("Cast", [cache["value.min"]], to=F32)], perm=[1, 0]),
                               i64("axes124", [1, 2, 4])])  # [batch, 1, 1, Qv, 1]
    p_s = b.op("Mul", [p_mid, v_scale])
    products = []
    planes = [b.op("Unsqueeze", [b.op("Transpose", [cache[f"value.codes{w}"]], perm=[1, 2, 0, 3]), i64("axis2", [2])])
              for w in PLANES[fmt.value_bits]]  # [batch, h, 1, Qv, d * w / 8]
    for weight, i, per, part in _parts(b, planes, fmt.value_bits):
        codes = b.op("Cast", [part], to=F32)
        products.append((weight, i, per, b.op("MatMul", [p_s, codes])))  # [batch, h, group, n, d/per]
    ctx = b.op("Add", [ctx, b.op("Add", [_interleave(b, products, d), b.op("MatMul", [p_mid, v_min])])])
    out = b.op("Reshape", [b.op("Transpose", [ctx], perm=[0, 3, 1, 2, 4]), i64(f"hidden{heads * d}", [0, 0, heads * d])],
               dtype=F32)
    return out, k_new, v_new
