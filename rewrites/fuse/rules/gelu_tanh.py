"""The tanh approximation of GELU (GPT-2's ``gelu_new``) to ONNX Runtime's ``FastGelu``.

Matched subgraph (products and sums in either order)::

    x ──Pow(3)──Mul(0.044715)──┐
    x ─────────────────────────Add──Mul(sqrt(2/pi))──Tanh──Add(1)──┐
    x ──Mul(0.5)───────────────────────────────────────────────────Mul──▶ y

Rewritten to ``FastGelu(x)`` (com.microsoft), which computes
``0.5 x (1 + tanh(0.7978845608 (x + 0.044715 x^3)))``.

Refuses (graph unchanged) when: the exponent is not 3; a constant is not a scalar or differs from
0.044715, sqrt(2/pi), 1 or 0.5 (relative 1e-6); ``x`` is not float/float16; or an intermediate is
used outside the subgraph (rewriter rule).
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphopt.onnxscript_compat import get_singleton_value
from graphopt.opsets import MS_DOMAIN

_CONSTS = {"three": 3.0, "c1": 0.044715, "c2": math.sqrt(2.0 / math.pi), "one": 1.0, "half": 0.5}


class TanhGelu(pattern.RewriteRuleClassBase):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` becomes ``FastGelu(x)``."""

    def __init__(self, name: str, *, half_outside: bool):
        super().__init__(name)
        self._half_outside = half_outside

    def pattern(self, op, x, three, c1, c2, one, half):
        inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), c1)), c2)
        a = op.Add(op.Tanh(inner), one)
        if self._half_outside:  # (x * a) * 0.5
            return op.Mul(op.Mul(x, a), half)
        return op.Mul(op.Mul(x, half), a)  # (x * 0.5) * a

    def check(self, context, x, **kw):
        result = pattern.MatchResult()
        if x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return result.fail(f"input is {x.dtype}, not float/float16", x)
        for name, want in _CONSTS.items():
            v = kw[name]
            got = get_singleton_value(v)
            if got is None:
                return result.fail(f"{name} is not a scalar constant", v)
            if abs(float(got) - want) > 1e-6 * abs(want):
                return result.fail(f"constant {float(got)} is not {want}", v)
        return result

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain=MS_DOMAIN)


tanh_gelu_rules = pattern.RewriteRuleSet(
    [
        *TanhGelu.rule("tanh_gelu", half_outside=False).commute(),
        *TanhGelu.rule("tanh_gelu_half_outside", half_outside=True).commute(),
    ]
)
