"""``early-exit``: confidence criteria, what a threshold does to the calibration rows, and its choice.

The threshold is certified on the confirm rows (held back from fitting the heads and from the candidate
grid): its argmax agreement with the full model must meet the budget's ``top1`` with a safety margin (the
one-sided Clopper-Pearson lower bound at ``confidence``, ``common.bounds.agreement_lower_bound``);
candidates are tested strictest first and the walk stops at the first failure (a fixed-sequence test),
so the pick among the certified ones (the cheapest on the tune rows) keeps the confidence level.
:func:`rows_needed` says how many confirm rows a ``top1`` target needs at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from graphopt.data.metrics import Budget
from graphopt.rewrites.common.bounds import agreement_lower_bound
from graphopt.rewrites.early_exit.heads import softmax


def confidence(logits: np.ndarray, temperature: float, criterion: str) -> np.ndarray:
    """Per-row confidence score (higher: more confident) as the graph computes it.

    ``maxprob``: the log-odds of the max softmax probability, ``log(p / (1 - p))`` = ``s_max -
    logsumexp(s_j, j != argmax)`` of ``s = logits / temperature``. It ranks rows as ``p`` does but never
    saturates: a probability rounds to 1.0 (in float32 past a logit margin of about 17) and every confident
    row would tie, so no threshold could tell the surest rows from the rest.
    ``entropy``: ``1 - entropy / log(classes)``.
    """
    s = logits.astype(np.float64) / temperature
    if criterion == "entropy":
        p = softmax(s)
        ent = -(p * np.log(p + 1e-12)).sum(-1)
        return 1.0 - ent / math.log(p.shape[-1])
    d = s - s.max(-1, keepdims=True)
    d[np.arange(len(d)), d.argmax(-1)] = -np.inf
    top = d.max(-1, keepdims=True)
    return -(top[:, 0] + np.log(np.exp(d - top).sum(-1)))


def score_threshold(threshold: float, criterion: str) -> float:
    """A user's ``threshold`` (a probability for ``maxprob``) in the scale :func:`confidence` returns."""
    if criterion != "maxprob":
        return threshold
    if threshold <= 0.0:
        return -math.inf
    if threshold >= 1.0:
        return math.inf
    return math.log(threshold / (1.0 - threshold))


def probability(score: float, criterion: str) -> float:
    """The max softmax probability a ``maxprob`` score stands for (other criteria: the score)."""
    if criterion != "maxprob":
        return score
    return 1.0 / (1.0 + math.exp(-score)) if score > -700 else 0.0


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


def rows_needed(target: float, confidence: float) -> float:
    """Fewest error-free rows whose one-sided Clopper-Pearson lower bound at ``confidence`` reaches
    ``target`` (``(1 - confidence) ** (1 / n) >= target``); inf for a target of 1 or more."""
    if confidence <= 0.0 or target <= 0.0:
        return 1
    if target >= 1.0:
        return math.inf
    n = math.ceil(math.log(1.0 - confidence) / math.log(target))
    while agreement_lower_bound(n, n, confidence) < target:  # float edge
        n += 1
    return n


def calibrate(preds, scores, labels, layer_of, target: float, tune, confirm, n_layers: int, *, criterion: str,
              confidence: float, note: Callable[[str], None]) -> float | None:
    """The cheapest threshold certified on the confirm rows: candidates (from the tune rows' scores) are
    tested strictest first, each by its confirm agreement's lower bound at ``confidence`` against
    ``target``; the first failure ends the walk (a fixed-sequence test: every threshold before it is
    certified at once), and the cheapest of those on the tune rows is chosen. None when only "never
    exit" passes."""
    if criterion == "patience":
        cands = [float(t) for t in range(preds.shape[0] + 1, 0, -1)]  # E + 1: never exits
    else:
        cands = sorted(set(np.round(np.quantile(scores[:, tune], np.linspace(0, 1, 201)), 6).tolist()))
        cands = [math.inf] + cands[::-1]

    def run(idx, t):
        ex, pr = simulate(preds[:, idx], scores[:, idx], labels[idx], criterion, t)
        return int(np.sum(pr == labels[idx])), float(layer_of[ex].mean())

    certified = []
    for t in cands:
        hits, _ = run(confirm, t)
        lb = agreement_lower_bound(hits, len(confirm), confidence)
        if lb < target:
            if certified:
                note(f"threshold {t:g}: confirm top1 {hits / len(confirm):.4f} (lower bound {lb:.4f}) misses "
                     f"{target:g}; the stricter ones before it are certified")
            break
        certified.append((run(tune, t)[1], -t, t))  # ties: the stricter
    if not certified:
        return None
    cost, _, t = min(certified)
    return None if cost >= n_layers else t
