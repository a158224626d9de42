"""The one place graphopt reaches into onnxscript beyond its documented API.

Everything else in graphopt imports onnxscript's public modules only (``onnxscript.rewriter``,
``onnxscript.rewriter.pattern``, ``onnxscript.optimizer``, ``onnxscript.rewriter.ort_fusions.*``).
What onnxscript does not export is either rebuilt here from public names or, where no public
form exists, read here once from its private location:

- ``DEFAULT_REWRITE_RULES``: onnxscript's default rewrite rules (``onnxscript.rewriter.rewrite`` applies
  them but does not say whether anything changed, which the cleanup loop needs). Private:
  ``onnxscript.rewriter._DEFAULT_REWRITE_RULES``.
- ``FoldConstantsPass``: a pass around the public ``onnxscript.optimizer.fold_constants_ir``;
  ``FOLD_INPUT_SIZE_LIMIT`` / ``FOLD_OUTPUT_SIZE_LIMIT`` are that function's documented defaults.
- ``mha_scale_rules`` / ``sdpa_via_mha_rules``: the rule sets onnxscript keeps in private module
  variables, rebuilt from the public rule classes the same way.
- ``FUSION_PLACEHOLDER_DOMAIN``: the domain onnxscript's ort_fusions give their intermediate
  placeholder ops (SDPA, a rotary form) until later rules map them to contrib ops; kept in
  ``graphopt.opsets`` (no onnxscript import there) and re-exported here so the test checks it.
- ``exact_identity_constants``: onnxscript's pattern constants match within ``math.isclose`` tolerances
  (``rel_tol=1e-5, abs_tol=1e-8``, private attributes of ``onnxscript.rewriter._pattern_ir.Constant``), so its
  ``x + 0`` no-op rule also matches ``x + 1e-10`` and drops an epsilon guard (``Log(x*x + 1e-10)`` becomes
  ``Log(x*x)``: NaN on silence). A pattern constant equal to 0 or 1, the identities a rule may drop, is made to
  match only exactly. Applied here, at import, to the default rules (the same objects
  ``onnxscript.optimizer.optimize`` runs), and by ``fuse`` to every rule set it runs.
- ``get_numpy_value`` / ``get_singleton_value`` / ``check_shape_bool``: the small helpers of
  onnxscript's private ``_ir_utils`` / ``_fusion_utils``, written against public API.

``onnxscript_compat_test.py`` checks that the installed onnxscript lies inside the bound
``pyproject.toml`` declares and that every name here resolves, so a new onnxscript release fails
in a test rather than at a user's first ``fuse``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript import optimizer, rewriter
from onnxscript.rewriter import _pattern_ir, pattern
from onnxscript.rewriter.ort_fusions import mha_scale, sdpa_via_mha

from graphopt.opsets import FUSION_PLACEHOLDER_DOMAIN

__all__ = [
    "DEFAULT_REWRITE_RULES",
    "FOLD_INPUT_SIZE_LIMIT",
    "FOLD_OUTPUT_SIZE_LIMIT",
    "FUSION_PLACEHOLDER_DOMAIN",
    "FoldConstantsPass",
    "check_shape_bool",
    "exact_identity_constants",
    "get_numpy_value",
    "get_singleton_value",
    "mha_scale_rules",
    "sdpa_via_mha_rules",
]

#: onnxscript versions this module was tested with (pyproject's dependency bound says the same)
TESTED_MIN = (0, 7)
TESTED_BELOW = (0, 8)


def _default_rules() -> tuple[pattern.RewriteRule, ...]:
    # no public name: onnxscript.rewriter.rewrite() applies these when given no rules

    return tuple(rewriter._DEFAULT_REWRITE_RULES)


def _rules_of(rules) -> list[pattern.RewriteRule]:
    if isinstance(rules, pattern.RewriteRuleSet):
        return list(rules.rules)
    if isinstance(rules, pattern.RewriteRule):
        return [rules]
    return [r for item in rules for r in _rules_of(item)]


def exact_identity_constants(rules) -> int:
    """Make every pattern constant of ``rules`` (a rule, a rule set or a sequence of them) that equals 0 or 1
    match only that exact value, in place; returns how many constants were tightened.

    A rule that drops an operand (``x + 0``, ``x * 1``, ``x - 0``, ``x / 1``) then fires only when the operand is
    the identity exactly, never on a guard such as ``+ 1e-10`` or a scale of ``1.000001``.
    """
    def identity(v) -> bool:
        vals = v if isinstance(v, list) else [v]
        return bool(vals) and all(isinstance(x, (int, float)) and x in (0, 1) for x in vals)

    tightened = 0
    for rule in _rules_of(rules):
        target = getattr(rule, "_target_pattern", None)
        if target is None:
            continue
        for node in target:
            for value in node.inputs:
                if isinstance(value, _pattern_ir.Constant) and identity(value.value) and (
                        value._rel_tol or value._abs_tol):
                    value._rel_tol = value._abs_tol = 0.0
                    tightened += 1
    return tightened


#: onnxscript's default rewrite rules (no-op removal, shape-chain simplification, ...), identity constants exact
DEFAULT_REWRITE_RULES: tuple[pattern.RewriteRule, ...] = _default_rules()
exact_identity_constants(DEFAULT_REWRITE_RULES)

_fold_params = inspect.signature(optimizer.fold_constants_ir).parameters
#: constant folding skips ops with an input larger than this (onnxscript's default)
FOLD_INPUT_SIZE_LIMIT: int = _fold_params["input_size_limit"].default
#: constant folding keeps an op whose output would be larger than this (onnxscript's default)
FOLD_OUTPUT_SIZE_LIMIT: int = _fold_params["output_size_limit"].default
del _fold_params


class FoldConstantsPass(ir.passes.InPlacePass):
    """onnxscript's constant folding as an onnx-ir pass."""

    def __init__(
        self,
        *,
        shape_inference: bool = True,
        input_size_limit: int = FOLD_INPUT_SIZE_LIMIT,
        output_size_limit: int = FOLD_OUTPUT_SIZE_LIMIT,
    ):
        super().__init__()
        self.shape_inference = shape_inference
        self.input_size_limit = input_size_limit
        self.output_size_limit = output_size_limit

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = optimizer.fold_constants_ir(
            model,
            onnx_shape_inference=self.shape_inference,
            input_size_limit=self.input_size_limit,
            output_size_limit=self.output_size_limit,
        )
        return ir.passes.PassResult(model, bool(result.modified))


#: fold a scale Mul on the query/key into MultiHeadAttention's ``scale`` (onnxscript's own rule)
mha_scale_rules = pattern.RewriteRuleSet([mha_scale.FuseMHAScale.rule()])
#: expand an SDPA left without a MultiHeadAttention form into MultiHeadAttention (onnxscript's rule)
sdpa_via_mha_rules = pattern.RewriteRuleSet([sdpa_via_mha.SDPAImplementation.rule()])


def get_numpy_value(value: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``value`` as an array (a Constant producer is propagated first), or None."""
    if value is None:
        return None
    node = value.producer()
    if node is not None:
        optimizer.basic_constant_propagation([node])
    tensor = value.const_value
    if tensor is None:
        return None
    try:
        return tensor.numpy()
    except FileNotFoundError:  # external data not available
        return None


def get_singleton_value(value: ir.Value | None, rank: int | Sequence[int] | None = None):
    """The element of a one-element constant (of the given rank or ranks when given), else None."""
    arr = get_numpy_value(value)
    if arr is None or arr.size != 1:
        return None
    if rank is None or (isinstance(rank, int) and arr.ndim == rank):
        return arr.item()
    if isinstance(rank, Sequence) and arr.ndim in rank:
        return arr.item()
    return None


def check_shape_bool(bindings: dict[str, int | ir.SymbolicDim], value: ir.Value, shape: Sequence[str]) -> bool:
    """Whether ``value`` has rank ``len(shape)`` with dims consistent with ``bindings`` (which it extends)."""
    if value.shape is None or value.shape.rank() != len(shape):
        return False
    for actual, expected in zip(value.shape, shape):
        if expected not in bindings:
            bindings[expected] = actual
        elif actual != bindings[expected]:
            return False
    return True
