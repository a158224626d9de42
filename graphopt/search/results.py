"""What a search found: the chosen candidate, every trial, the Pareto front, and its JSON form."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from graphopt.data.metrics import METRICS, parse_budget
from graphopt.engine import recipe as recipe_mod
from graphopt.engine.report import json_safe
from graphopt.search.trials import Trial


@dataclasses.dataclass
class SearchResult:
    """The chosen candidate (None: nothing met the budget), every trial, the Pareto front."""

    input: str
    budget: str
    provider: str
    trials: list[Trial]
    chosen: Trial | None
    recipe: recipe_mod.Recipe | None
    pareto: list[str]
    metric: str
    seconds: float
    time_limit: float
    workers: str
    interrupted: bool = False
    timed_out: bool = False
    duel: list[dict] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return json_safe({
            "input": self.input, "budget": self.budget, "provider": self.provider, "metric": self.metric,
            "seconds": round(self.seconds, 1), "time_limit": self.time_limit, "workers": self.workers,
            "interrupted": self.interrupted, "timed_out": self.timed_out,
            "chosen": self.chosen.name if self.chosen else None,
            "recipe": _recipe_dict(self.recipe) if self.recipe else None,
            "pareto": [self._point(t) for t in self.trials if t.name in self.pareto],
            "pareto_by_metric": {m: pareto_front(self.trials, m)
                                 for m in dict.fromkeys(t.metric for t in parse_budget(self.budget).terms)},
            "final_duel": self.duel, "notes": self.notes,
            "candidates": [t.as_dict() for t in self.trials],
        })

    def _point(self, t: Trial) -> dict:
        return {"name": t.name, "speedup": t.speedup, self.metric: t.held.get(self.metric),
                "meets_budget": t.meets_budget}


def pareto_front(trials: Sequence[Trial], metric: str) -> list[str]:
    """Names of the trials no other trial beats on both speed and held-back ``metric`` (the better way)."""
    up = METRICS[metric]
    pts = [(t.name, t.speedup, t.held.get(metric) if up else -t.held.get(metric))
           for t in trials if t.speedup is not None and t.held.get(metric) is not None
           and math.isfinite(t.held[metric])]
    front = []
    for name, s, q in pts:
        if not any((s2 >= s and q2 >= q) and (s2 > s or q2 > q) for _, s2, q2 in pts):
            front.append(name)
    return front


def chosen_speedup(t: Trial) -> float:
    """The final duel's speed-up when there was one, else the trial's."""
    return t.duel_speedup if t.duel_speedup is not None else (t.speedup or 0.0)


def _recipe_dict(recipe: recipe_mod.Recipe) -> dict:
    steps = []
    for s in recipe.steps:
        d: dict[str, Any] = {"pass": s.pass_name}
        if s.options:
            d["options"] = dict(s.options)
        steps.append(d)
    return {"name": recipe.name, "description": recipe.description, "step": steps}

