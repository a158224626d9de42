"""Canonical forms for the fusion rules: constants second, scalar branches, no identity reshapes.

TorchScript writes ``Add(bias, MatMul(x, W))``; dynamo writes ``Add(MatMul(x, W), bias)``. The
bias-folding rules (MultiHeadAttention bias, Attention) expect the second form, so this rule swaps
the operands of a commutative binary op whose first input is a constant and second is not::

    Add(c, x) ──▶ Add(x, c)        Mul(c, x) ──▶ Mul(x, c)

IEEE addition and multiplication are commutative, so the result is bit-identical. Refuses when the
first operand is not a constant or the second one is (nothing to gain).

A second rule writes a one-element constant ``[v]`` of ``Where`` as the scalar ``v`` (TorchScript
writes ``Where(IsNaN(p), [0.0], p)`` after softmax; the attention rules expect a scalar)::

    Where(cond, [v], x) ──▶ Where(cond, v, x)

Exact when the output has rank >= 1 (a ``[1]`` and a scalar broadcast alike there); refuses when
the rank of the other inputs is unknown or 0, or the constant has more than one element.

A third rule drops a ``Reshape`` whose input and output shapes are the same, every dimension known
(TorchScript's sdpa export reshapes the attention output ``[B, H, S, Dh]`` to ``[B, -1, S, Dh]``)::

    Reshape(x [B, H, S, Dh], s) -> [B, H, S, Dh]   ──▶   x

Exact given the symbolic shapes (see ``fuse_shapes``); refuses when a dimension is unknown.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern


class ConstantSecond(pattern.RewriteRuleClassBase):
    """``Op(c, x)`` with constant ``c`` and computed ``x`` becomes ``Op(x, c)``."""

    def __init__(self, name: str, op_type: str):
        super().__init__(name)
        self._op_type = op_type

    def pattern(self, op, c, x):
        return getattr(op, self._op_type)(c, x)

    def check(self, context, c, x, **_):
        result = pattern.MatchResult()
        if c.const_value is None:
            return result.fail("first operand is not a constant", c)
        if x.const_value is not None:
            return result.fail("both operands are constants", x)
        return result

    def rewrite(self, op, c, x, **_):
        return getattr(op, self._op_type)(x, c)


class ScalarWhereBranch(pattern.RewriteRuleClassBase):
    """``Where(cond, [v], x)`` becomes ``Where(cond, v, x)`` (output rank >= 1)."""

    def pattern(self, op, cond, c, x):
        return op.Where(cond, c, x)

    def check(self, context, cond, c, x, **_):
        result = pattern.MatchResult()
        if c.const_value is None:
            return result.fail("true branch is not a constant", c)
        if tuple(c.const_value.shape) != (1,):
            return result.fail(f"constant has shape {list(c.const_value.shape)}, not [1]", c)
        ranks = [v.shape.rank() for v in (cond, x) if v.shape is not None]
        if not ranks or max(ranks) < 1:
            return result.fail("rank of the other Where inputs is unknown or 0", x)
        return result

    def rewrite(self, op, cond, c, x, **_):
        value = c.const_value.numpy().reshape(())
        return op.Where(cond, op.Constant(value=ir.tensor(value)), x)


class IdentityReshape(pattern.RewriteRuleClassBase):
    """``Reshape(x, s)`` whose output shape equals ``x``'s (every dimension known) is ``x``."""

    def pattern(self, op, x, shape):
        return op.Reshape(x, shape, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, shape, y, **_):
        result = pattern.MatchResult()
        if x.shape is None or y.shape is None:
            return result.fail("reshape input or output shape unknown", y)
        if any(d is None or (isinstance(d, ir.SymbolicDim) and d.value is None) for d in (*x.shape, *y.shape)):
            return result.fail("a dimension is unknown", y)
        if list(x.shape) != list(y.shape):
            return result.fail(f"reshape {list(x.shape)} -> {list(y.shape)} is not the identity", y)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


canonical_rules = pattern.RewriteRuleSet(
    [
        ConstantSecond.rule("add_constant_second", "Add"),
        ConstantSecond.rule("mul_constant_second", "Mul"),
        ScalarWhereBranch.rule("where_scalar_branch"),
    ]
)

#: run after symbolic shapes are known (see fuse_shapes)
shape_rules = pattern.RewriteRuleSet(
    [
        IdentityReshape.rule("identity_reshape"),
    ]
)
