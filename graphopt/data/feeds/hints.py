"""What a graph says about the values its inputs accept, read from how each input is consumed.

Used by ``graphopt.data.feeds`` to build feeds that make the model run:

- **roles** of integer inputs that are shapes or positions: an ``Expand``/``Tile`` shape (ones
  broadcast with anything), a ``Reshape`` shape (the data's own shape, or ``[1, ..., -1]``), a
  ``Split``/``SplitToSequence`` split (parts summing to the split axis), a ``Gather``/``SequenceAt``
  position (0), ``Slice`` starts/ends/axes/steps;
- **sizes** for symbolic dims: constants the input's shape is compared with, reshaped to, or sliced
  at, and the cumulative stride of the spatial chain (``Conv``/pooling strides) that image sizes
  must be a multiple of;
- **values** of scalar integer inputs: the constants the graph compares them with (a sample rate
  that selects an ``If`` branch: ``Equal(sr, 16000)``).

Everything here is a hint: ``graphopt.data.feeds`` confirms candidates by running the model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

#: ops that carry a value's elements through (their first input): followed to find how it is consumed
_PASS_THROUGH = frozenset({"Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Reshape", "CastLike", "Gather",
                           "Slice", "Expand"})
#: ops that keep a tensor's shape: followed to find what its dims are tied to
_SAME_SHAPE = frozenset({"Cast", "Identity", "CastLike"})
_COMPARE = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
_STRIDED = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool", "ConvInteger", "QLinearConv"})
_SPATIAL = _STRIDED | {"ConvTranspose", "Resize", "Upsample", "GlobalAveragePool", "GlobalMaxPool", "Pad", "STFT", "DFT"}
#: typical sizes tried for spatial dims (rounded up to the stride) and for audio sample dims
IMAGE_SIZES = (224, 320, 640)
AUDIO_SIZES = (512, 1024, 16000)
_MAX_SIZE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Role:
    """How an integer input is consumed: ``kind`` and the tensor it applies to."""

    kind: str  # ones | zeros | big | arange | reshape | split
    data: ir.Value | None = None
    axis: int = 0


def _is_default_domain(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _uses(value: ir.Value, depth: int = 6, through: frozenset[str] = _PASS_THROUGH):
    """(node, input index) consuming ``value``, looking through the ops in ``through``."""
    frontier = [(value, 0)]
    seen = set()
    while frontier:
        v, d = frontier.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        for node, idx in v.uses():
            if _is_default_domain(node) and node.op_type in through and idx == 0 and d < depth and node.outputs:
                frontier.append((node.outputs[0], d + 1))
            else:
                yield node, idx


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    if a is None:
        return default
    try:
        return int(a.as_int())
    except Exception:
        return default


def role(value: ir.Value) -> Role | None:
    """The role of integer input ``value``, from the first consumer that gives it one."""
    for node, idx in _uses(value):
        if not _is_default_domain(node):
            continue
        op = node.op_type
        data = node.inputs[0] if node.inputs else None
        if (op, idx) in (("Expand", 1), ("Tile", 1)):
            return Role("ones", data)
        if (op, idx) == ("ConstantOfShape", 0):
            return Role("ones")
        if (op, idx) == ("Reshape", 1):
            return Role("reshape", data)
        if (op, idx) in (("Split", 1), ("SplitToSequence", 1)):
            return Role("split", data, _int_attr(node, "axis", 0))
        if (op, idx) in (("SequenceAt", 1), ("SequenceErase", 1), ("SequenceInsert", 2), ("Gather", 1),
                         ("GatherElements", 1), ("GatherND", 1), ("Pad", 1), ("CumSum", 1)):
            return Role("zeros", data)
        if op == "Slice" and idx >= 1:
            return Role({1: "zeros", 2: "big", 3: "arange", 4: "ones"}.get(idx, "zeros"), data)
        if (op, idx) in (("TopK", 1), ("OneHot", 1), ("Loop", 0)):
            return Role("ones", data)
    return None


def _const_ints(v: ir.Value | None) -> list[int]:
    if v is None:
        return []
    t = v.const_value
    if t is None and v.producer() is not None and v.producer().op_type == "Constant":
        attr = v.producer().attributes.get("value")
        t = attr.as_tensor() if attr is not None else None
    if t is None:
        return []
    try:
        arr = t.numpy()
    except Exception:
        return []
    if arr.dtype.kind not in "iuf" or arr.size > 16:
        return []
    return [int(x) for x in arr.reshape(-1)]


def compared_values(value: ir.Value) -> list[int]:
    """Integer constants the graph compares ``value`` with (``Equal(sr, 16000)`` -> [16000])."""
    out: list[int] = []
    for node, idx in _uses(value):
        if not _is_default_domain(node) or node.op_type not in _COMPARE or len(node.inputs) != 2:
            continue
        for c in _const_ints(node.inputs[1 - idx]):
            out.append(c)
            if node.op_type == ("Greater" if idx == 0 else "Less"):
                out.append(c + 1)
            elif node.op_type == ("Less" if idx == 0 else "Greater"):
                out.append(c - 1)
    return list(dict.fromkeys(out))


def dim_sizes(value: ir.Value) -> dict[int, list[int]]:
    """axis -> sizes the graph ties that dim of input ``value`` to (positive, deduplicated).

    Read from ``Shape(x)[k]`` compared with (or a multiple of, via ``Mod``/``Div``) a constant, a
    ``Reshape`` of ``x`` to a constant shape of the same rank, and ``Slice`` ends/starts on ``x``.
    """
    out: dict[int, list[int]] = {}
    rank = len(value.shape) if value.shape is not None else None

    def add(axis: int, size: int) -> None:
        if rank is not None and axis < 0:
            axis += rank
        if 0 < size <= _MAX_SIZE:
            out.setdefault(axis, []).append(size)

    for node, idx in _uses(value, through=_SAME_SHAPE):
        if not _is_default_domain(node):
            continue
        if node.op_type == "Shape" and idx == 0 and node.outputs:
            start = _int_attr(node, "start", 0)
            for axis, c in _shape_element_constants(node.outputs[0]):
                add(start + axis, c)
        elif node.op_type == "Reshape" and idx == 0 and len(node.inputs) > 1:
            target = _const_ints(node.inputs[1])
            if rank is not None and len(target) == rank:
                for axis, c in enumerate(target):
                    if c > 1:
                        add(axis, c)
        elif node.op_type == "Slice" and idx == 0 and len(node.inputs) > 2:
            starts, ends = _const_ints(node.inputs[1]), _const_ints(node.inputs[2])
            axes = _const_ints(node.inputs[3]) if len(node.inputs) > 3 else list(range(len(starts)))
            for axis, s, e in zip(axes, starts, ends):
                need = max(s + 1 if s >= 0 else -s, e if 0 < e < _MAX_SIZE else 0, -e + 1 if e < 0 else 0)
                if need > 1:
                    add(axis, need)
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def _shape_element_constants(shape_out: ir.Value) -> list[tuple[int, int]]:
    """(axis, constant) pairs for ``Gather(Shape(x), k)`` compared with / divided by a constant."""
    pairs = []
    for node, idx in _uses(shape_out, through=_SAME_SHAPE):
        if not _is_default_domain(node) or idx != 0 or not node.outputs:
            continue
        if node.op_type == "Gather":
            ks = _const_ints(node.inputs[1])
            if len(ks) == 1:
                for c in _element_constants(node.outputs[0]):
                    pairs.append((ks[0], c))
        elif node.op_type == "Slice":
            starts, ends = _const_ints(node.inputs[1]), _const_ints(node.inputs[2])
            if len(starts) == 1 and len(ends) == 1 and ends[0] == starts[0] + 1:
                for c in _element_constants(node.outputs[0]):
                    pairs.append((starts[0], c))
    return pairs


def _element_constants(v: ir.Value) -> list[int]:
    out = compared_values(v)
    for node, idx in _uses(v):
        if _is_default_domain(node) and node.op_type in ("Mod", "Div") and idx == 0 and len(node.inputs) == 2:
            out += [c for c in _const_ints(node.inputs[1]) if c > 1]
    return out


def spatial_stride(model: ir.Model, value: ir.Value) -> int:
    """The largest cumulative stride of strided ops (Conv, pooling) downstream of ``value``;
    0 when no spatial op (convolution, pooling, resize, pad, STFT) is downstream at all."""
    stride = {id(value): 1}
    best, reached = 1, False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):  # topological, subgraphs after their node
        ins = [stride[id(v)] for v in node.inputs if v is not None and id(v) in stride]
        if not ins:
            continue
        s = max(ins)
        if _is_default_domain(node) and node.op_type in _SPATIAL:
            reached = True
            a = node.attributes.get("strides") if node.op_type in _STRIDED else None
            if a is not None:
                try:
                    s *= max([int(x) for x in a.as_ints()] or [1])
                except Exception:
                    pass
        s = min(s, 1024)
        best = max(best, s)
        for o in node.outputs:
            stride[id(o)] = s
    return best if reached else 0


def spatial_axes(value: ir.Value) -> list[int]:
    """Axes of a float input that are image or audio extents (NCHW, NHWC, NCL, or [batch, samples])."""
    if value.shape is None or value.dtype is None or value.dtype.numpy().kind != "f":
        return []
    shape = list(value.shape)
    r = len(shape)
    if r == 2:
        return [1]
    if r < 3:
        return []
    if isinstance(shape[-1], int) and shape[-1] in (1, 3, 4) and not isinstance(shape[1], int):
        return list(range(1, r - 1))  # channels last
    return list(range(2, r))


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def split_parts(total: int, n: int) -> np.ndarray:
    """``n`` non-negative parts summing to ``total``, as even as possible."""
    n = max(1, n)
    base, extra = divmod(max(0, total), n)
    return np.array([base + (1 if i < extra else 0) for i in range(n)])
