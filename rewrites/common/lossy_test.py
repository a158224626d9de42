"""Tests of the lossy-pass skeleton: budget resolution, the searches, evaluate/confirm and the outcome."""

from __future__ import annotations

import numpy as np

from graphopt.data.metrics import DEFAULT_BUDGET, compare, parse_budget
from graphopt.engine import registry
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult
from graphopt.rewrites.common import lossy


class _Lossy(GraphoptPass):
    """A lossy pass that reports the budget it was handed."""

    name = "lossy-probe"
    exact = False
    default_budget = DEFAULT_BUDGET

    def call(self, model, ctx):
        s = lossy.BudgetSearch.of(self, ctx, default_note=True)
        return s.result(model, False, met=None)


def test_the_budget_is_resolved_once_outside_the_pass():
    assert registry.resolve_budget(_Lossy, None) == parse_budget(DEFAULT_BUDGET)
    given = parse_budget("cosine>=0.9")
    assert registry.resolve_budget(_Lossy, given) is given
    res = _Lossy()(None, PassContext())  # a direct call without a budget: the default, said in the notes
    assert res.notes == [f"no budget given: using the default {DEFAULT_BUDGET}"]
    assert res.budget_outcome.budget == str(parse_budget(DEFAULT_BUDGET))
    res = _Lossy()(None, PassContext(budget=given))
    assert res.notes == [] and res.budget_outcome.budget == str(given)


def test_searches():
    assert lossy.first_passing(10, lambda i: i >= 3) == 3
    assert lossy.first_passing(10, lambda i: False) is None
    assert lossy.bisect(1, 9, lambda i: i >= 4) == 4
    assert lossy.bisect(1, 9, lambda i: i <= 6, last=True) == 6
    assert lossy.bisect(1, 9, lambda i: False) is None
    rungs = lossy.ladder(2, [0.5, 0.25, 0.0], lambda i, level: level * (2 if i == 1 else 1))
    assert rungs == [[0.5, 0.5], [0.5, 0.25], [0.25, 0.25], [0.25, 0.0], [0.0, 0.0]]


def test_evaluate_confirms_on_held_back_rows_and_reports_the_outcome():
    feeds = [{"x": np.zeros((2, 4), np.float32)}]
    ref = [{"y": np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], np.float32)}]
    s = lossy.BudgetSearch("probe", parse_budget("cosine>=0.99"), calib=feeds, held=feeds,
                           ref_calib=ref, ref_held=ref)
    bad = [{"y": np.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]], np.float32)}]
    m = s.evaluate(lambda part: s.compare(part, bad))
    assert m.held is None and s.verdict(m) == "fails on calib"
    m = s.evaluate(lambda part: s.compare(part, ref))
    assert s.meets(m.held) and s.verdict(m) == "meets the budget"
    out = s.result(None, True, met=True, held=m.held)
    assert isinstance(out, PassResult) and out.budget_met is True
    assert out.budget_outcome.met is True and out.budget_outcome.measured == {"cosine": 1.0}
    assert m.held.worst("cosine") == compare(ref, ref, feeds).worst("cosine")
