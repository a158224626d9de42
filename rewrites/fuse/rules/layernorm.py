"""Decomposed LayerNorm (as older exporters and hand-written models write it) to ``LayerNormalization``.

Matched subgraph (``Pow(d, 2)`` or ``Mul(d, d)``; ``Div(d, s)`` or ``Mul(d, Reciprocal(s))``;
``ReduceMean`` axes as input (opset >= 18) or attribute; the final ``Add`` optional)::

    x ──ReduceMean(-1)── mean
    x ─────────────────Sub(x, mean)── d ──Pow(2)──ReduceMean(-1)──Add(eps)──Sqrt── s
                                      d ──────────────────────────Div(d, s)──Mul(gamma)──Add(beta)──▶ y

Rewritten to ``LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)`` (ONNX opset >= 17), which
SkipLayerNormalization fusion can then absorb.

Refuses (graph unchanged) when: the opset is below 17; ``x`` is not float/float16/double; a
ReduceMean reduces other than exactly the last axis or drops it (keepdims=0); the exponent is not 2;
eps is not a scalar constant; gamma/beta are not constants of shape ``[D]`` (D = last dim of x) or
their last dim differs; or an intermediate (mean, d, the variance, s, ...) is used outside the
subgraph (the rewriter refuses such matches).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from graphopt.onnxscript_compat import get_numpy_value, get_singleton_value
from graphopt.opsets import default_opset

_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE)


class DecomposedLayerNorm(pattern.RewriteRuleClassBase):
    """mean/var/normalise/scale[/shift] over the last axis becomes one LayerNormalization."""

    def __init__(self, name: str, *, axes_input: bool, square: str, divide: bool, bias: bool):
        super().__init__(name)
        self._axes_input, self._square, self._divide, self._bias = axes_input, square, divide, bias

    def _mean(self, op, v, axes, out):
        if self._axes_input:
            return op.ReduceMean(v, axes, _allow_other_attributes=True, _outputs=[out])
        return op.ReduceMean(v, _allow_other_attributes=True, _outputs=[out])

    def pattern(self, op, x, axes1, axes2, two, eps, gamma, beta):
        mean = self._mean(op, x, axes1, "mean")
        d = op.Sub(x, mean)
        sq = op.Pow(d, two) if self._square == "pow" else op.Mul(d, d)
        var = self._mean(op, sq, axes2, "var")
        s = op.Sqrt(op.Add(var, eps))
        n = op.Div(d, s) if self._divide else op.Mul(d, op.Reciprocal(s))
        y = op.Mul(n, gamma)
        return op.Add(y, beta) if self._bias else y

    def check(self, context, x, eps, gamma, mean, var, two=None, beta=None, **_):
        result = pattern.MatchResult()
        model = context.model if context is not None else None
        if model is not None:
            opset = default_opset(model)
            if opset < 17:
                return result.fail(f"opset {opset} < 17 has no LayerNormalization", x)
        if x.dtype not in _TYPES:
            return result.fail(f"input is {x.dtype}, not float/float16/double", x)
        rank = x.shape.rank() if x.shape is not None else None
        for v in (mean, var):
            node = v.producer()
            if node.attributes.get_int("keepdims", 1) != 1:
                return result.fail("ReduceMean drops the reduced axis (keepdims=0)", v)
            if self._axes_input:
                axes = get_numpy_value(node.inputs[1]) if len(node.inputs) > 1 else None
                axes = None if axes is None else axes.reshape(-1).tolist()
            else:
                axes = node.attributes.get_ints("axes", None)
                axes = None if axes is None else list(axes)
            if axes is None:
                return result.fail("ReduceMean axes are not constant", v)
            last = [-1] if rank is None else [-1, rank - 1]
            if len(axes) != 1 or axes[0] not in last:
                return result.fail(f"ReduceMean reduces axes {axes}, not just the last one", v)
        if two is not None:
            p = get_singleton_value(two)
            if p is None or float(p) != 2.0:
                return result.fail("exponent is not the constant 2", two)
        e = get_singleton_value(eps)
        if e is None:
            return result.fail("epsilon is not a scalar constant", eps)
        width = x.shape[-1] if rank else None
        for name, v in (("gamma", gamma), ("beta", beta)):
            if v is None and name == "beta":
                continue
            c = v.const_value
            if c is None:
                return result.fail(f"{name} is not a constant", v)
            if len(c.shape) != 1 or (isinstance(width, int) and c.shape[0] != width):
                return result.fail(f"{name} has shape {list(c.shape)}, not [{width}]", v)
            if not np.issubdtype(c.numpy().dtype, np.floating) or c.dtype != x.dtype:
                return result.fail(f"{name} is {c.dtype}, not {x.dtype}", v)
        if beta is not None and beta.const_value.shape[0] != gamma.const_value.shape[0]:
            return result.fail("gamma and beta differ in length", beta)
        return result

    def rewrite(self, op, x, eps, gamma, beta=None, **_):
        e = float(get_singleton_value(eps))
        inputs = [x, gamma] + ([beta] if beta is not None else [])
        return op.LayerNormalization(*inputs, axis=-1, epsilon=e, stash_type=1)


def _rules(bias: bool) -> list:
    rules = []
    for axes_input in (True, False):
        for square in ("pow", "mul"):
            for divide in (True, False):
                name = f"layer_norm_{'axes_in' if axes_input else 'axes_attr'}_{square}_{'div' if divide else 'recip'}"
                name += "_bias" if bias else ""
                rule = DecomposedLayerNorm.rule(name, axes_input=axes_input, square=square, divide=divide, bias=bias)
                rules.append(rule)  # canonical rules have put constants second already
    return rules


#: with the trailing ``Add(beta)``; run before the scale-only rules (a set tries its rules node by node,
#: so the scale-only form would match at the ``Mul`` first and leave the ``Add`` behind)
layer_norm_rules = pattern.RewriteRuleSet(_rules(bias=True))
#: scale only
layer_norm_scale_rules = pattern.RewriteRuleSet(_rules(bias=False))
