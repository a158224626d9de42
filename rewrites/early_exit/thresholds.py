"""``early-exit``: confidence criteria, what a threshold does to the calibration rows, and its choice.

The threshold is the cheapest one whose argmax agreement with the full model meets the budget's ``top1``
on the tune rows with a safety margin (the Clopper-Pearson lower bound at ``confidence``,
``common.bounds.agreement_lower_bound``), confirmed on the confirm rows (else the next stricter one).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from graphopt.data.metrics import Budget
from graphopt.rewrites.common.bounds import agreement_lower_bound
from graphopt.rewrites.early_exit.heads import softmax


def confidence(logits: np.ndarray, temperature: float, criterion: str) -> np.ndarray:
    """Per-row confidence score (higher: more confident) as the graph computes it."""
    p = softmax(logits.astype(np.float64) / temperature)
    if criterion == "entropy":
        ent = -(p * np.log(p + 1e-12)).sum(-1)
        return 1.0 - ent / math.log(p.shape[-1])
    return p.max(-1)


def simulate(preds: np.ndarray, scores: np.ndarray, final: np.ndarray, criterion: str, threshold: float,
             ) -> tuple[np.ndarray, np.ndarray]:
    """(exit index per row, prediction per row); index E (= number of exits) is the full model."""
    e, n = preds.shape
    exit_at = np.full(n, e)
    out = final.copy()
    undecided = np.ones(n, bool)
    for j in range(e):
        if criterion == "patience":
            t = int(threshold)
            if t < 1 or j + 1 < t:
                continue
            ok = np.all(preds[j - t + 1 : j + 1] == preds[j], axis=0)
        else:
            ok = scores[j] >= threshold
        hit = undecided & ok
        exit_at[hit] = j
        out[hit] = preds[j][hit]
        undecided &= ~hit
    return exit_at, out


def budget_target(budget: Budget) -> float | None:
    """The ``top1`` value the budget asks for (None: it has no ``top1 >=`` term)."""
    for t in budget.terms:
        if t.metric == "top1" and t.op in (">=", ">"):
            return t.value
    return None


def calibrate(preds, scores, labels, layer_of, target: float, tune, confirm, n_layers: int, *, criterion: str,
              confidence: float, note: Callable[[str], None]) -> float | None:
    """The cheapest threshold meeting ``target`` on the tune rows (lower bound at ``confidence``) and then on
    the confirm rows (plain agreement); None when none does."""
    if criterion == "patience":
        cands = [float(t) for t in range(1, preds.shape[0] + 1)]
    else:
        cands = sorted(set(np.round(np.quantile(scores[:, tune], np.linspace(0, 1, 201)), 6).tolist()))
        cands.append(1.0 + 1e-6)

    def stats(idx, t):
        ex, pr = simulate(preds[:, idx], scores[:, idx], labels[idx], criterion, t)
        return float(np.mean(pr == labels[idx])), float(layer_of[ex].mean())

    def bound(t):
        ex, pr = simulate(preds[:, tune], scores[:, tune], labels[tune], criterion, t)
        return agreement_lower_bound(int(np.sum(pr == labels[tune])), len(tune), confidence)

    ok = [(stats(tune, t)[1], -t if criterion != "patience" else t, t) for t in cands
          if bound(t) >= target]
    ok.sort()
    for cost, _, t in ok:
        if cost >= n_layers:
            break
        if stats(confirm, t)[0] >= target:
            return t
        note(f"threshold {t:g}: top1 met on tune rows, not on confirm rows "
             f"({stats(confirm, t)[0]:.4f}); trying a stricter one")
    return None
