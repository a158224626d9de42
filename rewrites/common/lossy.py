"""The budget search every lossy pass shares: rows, evaluate, search, confirm, report.

One :class:`BudgetSearch` per call of a lossy pass (``quantize``, ``convert-precision``, ``prune-heads``,
``early-exit``, ``sparsify``, ``contextual-sparsity``); the pass supplies what is its own (the candidates
and how one is scored), the skeleton does the rest:

- **budget**: ``ctx.budget``, resolved once by the pipeline (``registry.resolve_budget``: ``--budget`` or
  the pass's ``default_budget``); ``budget_share`` spends only a share of its slack (``budget.share``);
- **rows**: :meth:`BudgetSearch.rows`: the calibration rows and the rows held back to confirm on
  (``calibration_feeds``), and the float model's outputs on both (:meth:`BudgetSearch.reference`);
- **evaluate**: :meth:`BudgetSearch.evaluate`: a candidate scored on the calibration rows and, once it
  meets the budget there, confirmed on the held-back rows (:class:`Measured`); the held-back ``cosine``
  is the lower confidence bound where the pass asks for one (``confidence``, :mod:`.bounds`);
- **search**: the pass makes the candidates (a ladder of levels, an order of heads, thresholds); they are
  walked by :func:`first_passing` / :func:`bisect` (binary searches, quality assumed monotone) or
  :meth:`BudgetSearch.first_confirmed` (calibration, then held-back rows, every rung once);
- **report**: :meth:`BudgetSearch.result`: the ``PassResult`` with the notes and one
  :class:`~graphopt.engine.registry.BudgetOutcome` (the terms, what was measured on held-back rows, met or not).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from graphopt.data.feeds import calibration_feeds
from graphopt.data.metrics import Budget, Comparison, compare
from graphopt.engine.registry import BudgetOutcome, GraphoptPass, PassContext, PassResult
from graphopt.errors import UsageError
from graphopt.rewrites.common import bounds
from graphopt.rewrites.common.budget import share

Feed = Mapping[str, np.ndarray]
#: which rows a candidate is scored on
CALIB, HELD = "calib", "held"


@dataclasses.dataclass
class Measured:
    """One candidate: its comparison on the calibration rows, then on the held-back rows (None: not run,
    the calibration rows already fail), and what else the pass measured (``extra``)."""

    calib: Comparison | None
    held: Comparison | None = None
    extra: Any = None


@dataclasses.dataclass
class BudgetSearch:
    """The budget, rows, references and notes of one call of a lossy pass."""

    pass_name: str
    budget: Budget
    #: False when the caller gave no budget (``ctx.budget_given``): explicitly asked levels go unchecked
    given: bool = True
    #: > 0: the held-back ``cosine`` is its one-sided lower confidence bound at this level
    confidence: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    calib: list[Feed] = dataclasses.field(default_factory=list)
    held: list[Feed] = dataclasses.field(default_factory=list)
    ref_calib: Sequence[Any] = ()
    ref_held: Sequence[Any] = ()
    #: the default spec the pass declares (the "no budget given" note)
    default_spec: str = ""
    logger: logging.Logger = dataclasses.field(default_factory=lambda: logging.getLogger(__name__))
    #: id of a held-back comparison (cosine: the lower bound) -> the plain mean cosine
    plain: dict[int, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, p: GraphoptPass, ctx: PassContext, *, budget_share: float = 1.0, confidence: float = 0.0,
           default_note: bool = False, log: bool = True) -> BudgetSearch:
        """The search for one call of ``p``: ``default_note`` says first when the caller gave no budget
        (:meth:`note_default`), ``budget_share`` < 1 notes the reduced budget searched under."""
        s = cls(p.name, ctx.budget or Budget(), ctx.budget_given, confidence,
                default_spec=p.default_budget, logger=logging.getLogger(type(p).__module__))
        if default_note:
            s.note_default(log=log)
        if budget_share < 1.0:
            s.budget = share(s.budget, budget_share)
            s.note(f"budget_share {budget_share:g}: searching under {s.budget}", log=log)
        return s

    # ------------------------------------------------------------ notes

    def note(self, msg: str, *, log: bool = True) -> None:
        if log:
            self.logger.info("%s: %s", self.pass_name, msg)
        self.notes.append(msg)

    def require_decoder_terms(self, example: str) -> None:
        """UsageError unless the budget has terms and all are decoder metrics (``ppl_ratio``, ``greedy_match``)."""
        other = [str(t) for t in self.budget.terms if not t.decoder]
        if other or not self.budget:
            raise UsageError(f"{self.pass_name} measures decoder metrics only; budget {self.budget} has "
                             f"{', '.join(other) or 'none'}", hint=f"e.g. --budget '{example}'")

    def note_default(self, *, log: bool = True) -> None:
        """Say that the pass runs under its default budget because the caller gave none (a direct call)."""
        if not self.given:
            self.note(f"no budget given: using the default {self.default_spec}", log=log)

    # ------------------------------------------------------------ rows

    def rows(self, model: ir.Model, ctx: PassContext, purpose: str = "calibrating", *, log: bool = True) -> None:
        """Calibration rows and held-back rows (generated and noted when the pipeline has none)."""
        self.calib, self.held, fed = calibration_feeds(model, ctx.calib_feeds, ctx.feeds, purpose)
        if fed:
            self.note(fed, log=log)

    def feeds(self, part: str) -> list[Feed]:
        return self.calib if part == CALIB else self.held

    def reference(self, run: Callable[[list[Feed]], Sequence[Any]]) -> None:
        """The float model's outputs on both sets of rows (``run(feeds) -> outputs``)."""
        self.ref_calib = run(self.calib)
        self.ref_held = run(self.held)

    # ------------------------------------------------------------ evaluate and confirm

    def fails(self, c: Comparison) -> list[str]:
        return self.budget.failures(c)

    def meets(self, c: Comparison | None) -> bool:
        return c is not None and not self.budget.failures(c)

    def compare(self, part: str, got: Sequence[Mapping[str, np.ndarray]]) -> Comparison:
        """``got`` (a candidate's outputs on ``part``'s rows) against the reference; held-back rows: with the
        cosine lower bound at ``confidence``."""
        feeds = self.feeds(part)
        ref = self.ref_calib if part == CALIB else self.ref_held
        c = compare(got, ref, feeds)
        if part == CALIB:
            return c
        lowered = bounds.bounded(c, got, ref, feeds, self.confidence)
        self.plain[id(lowered)] = c.worst("cosine")
        return lowered

    def evaluate(self, score: Callable[[str], Comparison], held_always: bool = False) -> Measured:
        """``score(part)`` on the calibration rows and, when those meet the budget (or ``held_always``), on
        the held-back rows."""
        cal = score(CALIB)
        if not held_always and self.fails(cal):
            return Measured(cal)
        return Measured(cal, score(HELD))

    def verdict(self, m: Measured) -> str:
        if m.held is None:
            return "fails on calib"
        return "fails on held-back feeds" if self.fails(m.held) else "meets the budget"

    def first_confirmed(self, n: int, measure: Callable[[int], Measured],
                        seen: Callable[[int, Measured], None] | None = None) -> tuple[int | None, dict[int, Measured]]:
        """The first of ``n`` candidates (cheapest first) that meets the budget on calibration and then on
        held-back rows (:func:`first_passing`); every candidate is measured once, ``seen(i, m)`` told."""
        done: dict[int, Measured] = {}

        def ok(j: int) -> bool:
            if j not in done:
                done[j] = measure(j)
                if seen is not None:
                    seen(j, done[j])
            return self.meets(done[j].held)

        return first_passing(n, ok), done

    # ------------------------------------------------------------ report

    def cosine_text(self, c: Comparison) -> str:
        """``0.9903 (lb 0.9886)`` for a held-back comparison with a lower bound, else ``0.9903``."""
        conf = self.confidence if id(c) in self.plain else 0.0
        return bounds.cosine_text(self.plain.get(id(c)), c, conf)

    def outcome(self, held: Comparison | Mapping[str, float] | None, met: bool | None) -> BudgetOutcome:
        """The budget outcome: the budget's metrics as measured on the held-back rows."""
        if held is None:
            measured: dict[str, float] = {}
        elif isinstance(held, Comparison):
            measured = {t.metric: float(held.worst(t.metric)) for t in self.budget.terms}
        else:
            measured = {k: float(v) for k, v in held.items()}
        return BudgetOutcome(str(self.budget), measured, met)

    def result(self, model: ir.Model, modified: bool, *, met: bool | None = None,
               held: Comparison | Mapping[str, float] | None = None,
               rule_counts: Mapping[str, int] | None = None) -> PassResult:
        """The pass's result: the notes, ``budget_met`` and the :class:`BudgetOutcome`."""
        return PassResult(model, modified, notes=self.notes, rule_counts=dict(rule_counts or {}), budget_met=met,
                          budget_outcome=self.outcome(held, met))


def decoder_text(m: Measured) -> str:
    """``calibration: ppl A / B = r, greedy g; held-back: ...`` of a decoder candidate's measurement."""
    parts = []
    for label, c in (("calibration", m.calib), ("held-back", m.held)):
        if c is not None:
            d = c.decoder
            parts.append(f"{label}: ppl {d['ppl']:.3f} / {d['ppl_reference']:.3f} = {d['ppl_ratio']:.4f}, "
                         f"greedy {d['greedy_match']:.3f}")
    return "; ".join(parts)


def first_passing(n: int, ok: Callable[[int], bool]) -> int | None:
    """Binary search for the first index in ``range(n)`` where ``ok`` holds (monotone assumption)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < n and ok(lo) else None


def bisect(lo: int, hi: int, ok: Callable[[int], bool], *, last: bool = False) -> int | None:
    """Binary search over ``lo..hi`` (inclusive) for the first (``last``: the last) index where ``ok`` holds
    (monotone assumption); ``ok`` is called on the midpoints only. None when none holds."""
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best = mid
            if last:
                lo = mid + 1
            else:
                hi = mid - 1
        elif last:
            hi = mid - 1
        else:
            lo = mid + 1
    return best


def ladder(n_layers: int, levels: Sequence[float], local_error: Callable[[int, float], float]) -> list[list[float]]:
    """Per-layer level lists from every layer at ``levels[0]`` to all at the last level (the lossless end).

    Each rung moves the layer with the largest ``local_error(layer, level)`` one level on.
    """
    at = [0] * n_layers
    out = []
    while True:
        out.append([levels[s] for s in at])
        open_ = [i for i, s in enumerate(at) if s < len(levels) - 1]
        if not open_:
            return out
        worst = max(open_, key=lambda i: local_error(i, levels[at[i]]))
        at[worst] += 1
