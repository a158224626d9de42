"""Parameter count of a graph: the elements of its weights, float or quantized.

Float initializers count element by element. Integer initializers count where they are weights:
8- and 4-bit tensors (quantized weights, embedding tables, zero points), and wider integers where a
quantization op reads them (an int32 bias of ``DequantizeLinear`` or ``QLinearConv``). A packed
weight counts the elements of the logical weight, not its bytes: ``MatMulNBits``' ``B`` is ``K×N``,
``GatherBlockQuantized``' 4-bit table twice its bytes. Shape and index constants (int64) are not
parameters; nor is a zero-point tensor whose elements are all one value (a symmetric quantizer's zero points stored
per channel, e.g. 128 for u8 weights): it holds one number however many times it is written.
``graphopt inspect`` and ``graphopt diff`` both count with :func:`parameter_count`.
"""

from __future__ import annotations

import onnx_ir as ir

#: integer dtypes that hold quantized weights (never shapes or indices)
QUANT_DTYPES = {
    ir.DataType.INT8, ir.DataType.UINT8, ir.DataType.INT4, ir.DataType.UINT4,
}
for _name in ("INT2", "UINT2", "FLOAT4E2M1"):
    if hasattr(ir.DataType, _name):
        QUANT_DTYPES.add(getattr(ir.DataType, _name))

#: ops whose integer inputs (any width) are quantized parameters
_QUANT_OPS = {
    "DequantizeLinear", "QuantizeLinear", "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv",
    "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulNBits", "QAttention", "QGemm", "QOrderedMatMul",
    "GatherBlockQuantized", "DynamicQuantizeLSTM",
}


#: op -> input positions that are zero points
_ZERO_POINTS = {
    "DequantizeLinear": {2}, "QuantizeLinear": {2}, "MatMulInteger": {2, 3}, "ConvInteger": {2, 3},
    "DynamicQuantizeMatMul": {3}, "MatMulIntegerToFloat": {4, 5}, "QAttention": {6, 7}, "QLinearMatMul": {2, 5, 7},
    "QLinearConv": {2, 5, 7}, "MatMulNBits": {3}, "QGemm": {2, 5, 8},
}


def _uniform_zero_point(value: ir.Value, uses) -> bool:
    if not uses or not all(idx in _ZERO_POINTS.get(node.op_type, ()) for node, idx in uses):
        return False
    arr = value.const_value.numpy()
    return arr.size > 1 and bool((arr == arr.flat[0]).all())


def _elements(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def weight_elements(value: ir.Value) -> int | None:
    """Elements of the logical weight ``value`` (an initializer) holds; None when it is no parameter."""
    t = value.const_value
    if t is None:
        return None
    dtype = t.dtype
    uses = list(value.uses())
    if dtype.is_integer() and _uniform_zero_point(value, uses):
        return 0
    for node, idx in uses:
        if node.op_type == "MatMulNBits" and idx == 1:
            k, n = node.attributes.get("K"), node.attributes.get("N")
            if k is not None and n is not None:
                return int(k.value) * int(n.value)
        if node.op_type == "GatherBlockQuantized" and idx == 0 and dtype == ir.DataType.UINT8:
            bits = node.attributes.get("bits")
            return _elements(t) * (8 // int(bits.value) if bits is not None else 2)
    if dtype.is_floating_point() or dtype in QUANT_DTYPES:
        return _elements(t)
    if dtype.is_integer() and any(node.op_type in _QUANT_OPS for node, _ in uses):
        return _elements(t)
    return None


def parameter_count(graph: ir.Graph) -> int:
    """Parameters of ``graph``'s initializers (see the module docstring)."""
    total = 0
    for v in graph.initializers.values():
        n = weight_elements(v)
        if n is not None:
            total += n
    return total
