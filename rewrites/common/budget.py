"""Budget arithmetic the lossy passes share."""

from __future__ import annotations

from graphopt.data.metrics import Budget, BudgetTerm


def share(budget: Budget, s: float) -> Budget:
    """``budget`` with only a share ``s`` of its slack: ``m>=v`` (v <= 1) -> ``m>=1-s(1-v)``, ``m<=v`` -> ``m<=s v``
    (a ratio, ``ppl_ratio<=v``: ``<=1+s(v-1)``)."""
    terms = []
    for t in budget.terms:
        v = t.value
        if t.metric == "ppl_ratio":
            v = 1.0 + s * (v - 1.0)
        elif t.op in (">=", ">") and v <= 1.0:
            v = 1.0 - s * (1.0 - v)
        elif t.op in ("<=", "<"):
            v = s * v
        terms.append(BudgetTerm(t.metric, t.op, v))
    return Budget(tuple(terms))
