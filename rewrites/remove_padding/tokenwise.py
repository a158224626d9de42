"""Which ops of ``remove-padding`` are token-wise: the output at a token depends only on that token's inputs.

A token-wise op runs on packed rows in one of two layouts (``lead``: how many leading dimensions
index tokens):

- ``lead=2``: ``[B, S, ...]`` values, packed as ``[1, N+1, ...]`` (the usual transformer layout);
- ``lead=1``: ``[B*S, ...]`` values whose rows are the (batch, position) pairs in row-major order
  (``Reshape [B, S, H] -> [B*S, H]``, as GPT-2's Conv1D and other ``Gemm`` exports do), packed as
  ``[N+1, ...]``. A ``Gemm`` or ``MatMul`` over these rows mixes nothing: each row is one token.

``input_modes`` says how each input of a token-wise op is treated, or None when the op (with its
attributes, e.g. a norm or reduction over a token axis) is not token-wise. ``first_token_pool`` tells
a sequence classifier's pooling of position 0, the one selection of positions the pass runs on packed
rows (one row per sequence).
"""

from __future__ import annotations

import enum

import onnx_ir as ir

from graphopt.opsets import MS_DOMAIN, node_domain

from .probe import TOKEN_DIMS, Dim, DimLabels

#: standard ops whose output at a position depends only on the inputs at that position
ELEMENTWISE = frozenset(
    "Add Sub Mul Div Pow Sqrt Erf Tanh Relu Sigmoid Gelu Cast Where Neg Reciprocal Exp Log Abs Identity "
    "Clip Max Min Equal Less Greater LessOrEqual GreaterOrEqual Not And Or Xor IsNaN IsInf Softplus "
    "Softsign HardSigmoid HardSwish LeakyRelu Elu Selu Mish Floor Ceil Round Sign Sin Cos Sum".split()
)
_MS_ELEMENTWISE = frozenset("BiasGelu FastGelu Gelu QuickGelu BiasAdd".split())
_REDUCE = frozenset("ReduceMean ReduceSum ReduceMax ReduceMin ReduceSumSquare ReduceL2".split())
_NORMS = frozenset(("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"))
_MS_NORMS = frozenset(("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"))


class Mode(enum.Enum):
    """How an input of a token-wise op is treated."""

    BCAST = "bcast"  # broadcast against the output rank: packed, packed on entry, or as is (no batch/seq dims)
    OWN = "own"  # a token input of its own rank and layout (e.g. Gather indices, a Reshape's data)
    PARAM = "param"  # must have no batch/sequence dims
    SKIP = "skip"  # left as it is (the masks of attention ops, a Reshape's target shape)


def norm_axis(axis: int, rank: int) -> int:
    """``axis`` made non-negative for a rank-``rank`` tensor."""
    return axis + rank if axis < 0 else axis


def input_modes(node: ir.Node, lab: DimLabels, r: int, lead: int) -> list[Mode] | None:
    """Input modes of ``node`` as a token-wise op with rank-``r`` outputs in layout ``lead``, else None.

    Every axis an op works along (a norm, softmax, concat, split, reduction) must be one of the
    fixed dimensions after the ``lead`` token dimensions.
    """
    op, dom, n = node.op_type, node_domain(node), len(node.inputs)
    a = node.attributes
    bcast, param = Mode.BCAST, Mode.PARAM
    if dom == MS_DOMAIN:
        if op in _MS_ELEMENTWISE:
            return [bcast] * n
        if op in _MS_NORMS:
            return [bcast, bcast] + [param] * (n - 2)
        return None
    if dom != "":
        return None
    if op in ELEMENTWISE:
        return [bcast] * n
    if op == "MatMul":
        w, x = lab(node.inputs[1]), lab(node.inputs[0])
        if w is None or x is None or len(w) > 2 or len(x) != r:
            return None
        return [bcast, param]
    if op == "Gemm":  # rows of A are the tokens: A [B*S, K] (not transposed), B and C parameters
        if lead != 1 or a.get_int("transA", 0) != 0:
            return None
        return [bcast] + [param] * (n - 1)
    if op in _NORMS:
        return [bcast] + [param] * (n - 1) if norm_axis(a.get_int("axis", -1), r) >= lead else None
    if op in ("Softmax", "LogSoftmax"):
        return [bcast] if norm_axis(a.get_int("axis", -1), r) >= lead else None
    if op == "Gather":
        idx = lab(node.inputs[1])
        if a.get_int("axis", 0) != 0 or idx is None or len(idx) < lead:
            return None
        return [param, Mode.OWN]
    if op == "Transpose":
        perm = a.get_ints("perm")
        return [bcast] if perm is not None and list(perm[:lead]) == list(range(lead)) else None
    if op == "Concat":
        return [bcast] * n if norm_axis(a.get_int("axis"), r) >= lead else None
    if op == "Split":
        return [bcast] + [param] * (n - 1) if norm_axis(a.get_int("axis", 0), r) >= lead else None
    if op in _REDUCE:
        axes = a.get_ints("axes")
        if axes is None and n > 1 and node.inputs[1] is not None:
            c = node.inputs[1].const_value
            axes = None if c is None else [int(x) for x in c.numpy().reshape(-1)]
        if not axes or lab.rank(node.inputs[0]) != r or any(norm_axis(int(x), r) < lead for x in axes):
            return None
        return [bcast] + [param] * (n - 1)
    return None


def first_token_pool(node: ir.Node, lab: DimLabels) -> int | None:
    """The output rank when ``node`` pools position 0 of a ``[B, S, *rest]`` value, else None.

    ``Gather(x, 0, axis=1)`` -> ``[B, *rest]``; ``Gather(x, [0], axis=1)`` or ``Slice(x, [0], [1], [1])``
    -> ``[B, 1, *rest]``.
    """
    if node_domain(node) != "" or node.op_type not in ("Gather", "Slice") or not node.inputs:
        return None
    labs, out = lab(node.inputs[0]), lab(node.outputs[0])
    if labs is None or labs[:2] != (Dim.B, Dim.S) or out is None or not out or out[0] != Dim.B:
        return None
    if any(d in TOKEN_DIMS for d in out[1:]):
        return None
    if node.op_type == "Gather":
        index = _ints(node.inputs[1])
        if norm_axis(node.attributes.get_int("axis", 0), len(labs)) != 1 or index not in (([0], 0), ([0], 1)):
            return None
        return len(out) if out == (Dim.B, *(1,) * index[1], *labs[2:]) else None
    starts, ends, axes, steps = (_ints(x) for x in list(node.inputs[1:]) + [None] * (5 - len(node.inputs)))
    if starts is None or ends is None or starts[0] != [0] or ends[0] != [1]:
        return None
    if axes is None or len(axes[0]) != 1 or norm_axis(axes[0][0], len(labs)) != 1:
        return None
    if steps is not None and steps[0] != [1]:
        return None
    return len(out) if out == (Dim.B, 1, *labs[2:]) else None


def _ints(v: ir.Value | None) -> tuple[list[int], int] | None:
    """The values and rank of a constant int tensor, else None."""
    if v is None:
        return None
    tensor = v.const_value
    p = v.producer()
    if tensor is None and p is not None and node_domain(p) == "" and p.op_type == "Constant" and "value" in p.attributes:
        tensor = p.attributes["value"].value
    if tensor is None:
        return None
    arr = tensor.numpy()
    if arr.dtype.kind not in "iu":
        return None
    return [int(x) for x in arr.reshape(-1)], arr.ndim
