"""Lower confidence bounds of the measured quality of a lossy candidate, shared by the lossy passes.

- :func:`cosine_lower_bound` / :func:`bounded`: the mean sample cosine with sentences (batch rows) as the
  units (a row-clustered ratio estimator, Student t); ``sparsify`` and ``contextual-sparsity`` hold the
  held-back ``cosine`` of a plan to it.
- :func:`agreement_lower_bound`: Clopper-Pearson for an agreement rate (``early-exit``'s top1 on its
  tune rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from graphopt.data.metrics import Comparison, find_mask


def _row_cosines(got: np.ndarray, ref: np.ndarray, mask: np.ndarray | None) -> list[tuple[float, int]]:
    """Per batch row: (sum of the cosines of its real samples, their count); [] for a rank-0/1 output."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.ndim < 2 or ref.dtype.kind not in "f":
        return []
    if mask is not None and ref.ndim == got.ndim + 1 and ref.shape[:2] == mask.shape:  # packed [tokens, ...]
        ends = np.cumsum(mask.astype(bool).sum(axis=1))
        rows_got = np.split(got.reshape(got.shape[0], -1) if got.ndim > 2 else got, ends[:-1])
        rows_ref = [r[m.astype(bool)] for r, m in zip(ref, mask)]
    elif got.shape != ref.shape:
        return []
    elif ref.ndim == 2:  # [batch, features]: one sample per row
        rows_got, rows_ref = list(got[:, None, :]), list(ref[:, None, :])
    else:
        m = mask.astype(bool) if mask is not None and ref.shape[:2] == mask.shape else None
        rows_got = [g.reshape(-1, g.shape[-1]) if m is None else g[m[i]] for i, g in enumerate(got)]
        rows_ref = [r.reshape(-1, r.shape[-1]) if m is None else r[m[i]] for i, r in enumerate(ref)]
    out = []
    for g, r in zip(rows_got, rows_ref):
        if not len(r):
            continue
        den = np.linalg.norm(g, axis=-1) * np.linalg.norm(r, axis=-1)
        cos = np.where(den > 0, np.sum(g * r, axis=-1) / np.where(den > 0, den, 1.0), 1.0)
        out.append((float(np.sum(cos)), len(r)))
    return out


def cosine_lower_bound(got: Sequence[Mapping[str, np.ndarray]], ref: Sequence[Mapping[str, np.ndarray]],
                       feeds: Sequence[Mapping[str, np.ndarray]], confidence: float) -> dict[str, float]:
    """Per output: a one-sided lower confidence bound (at ``confidence``) of the mean sample cosine.

    The mean is the one ``graphopt.data.metrics`` reports (over the real samples, e.g. tokens); the samples of
    one batch row (a sentence) are not independent, so the rows are the units: a ratio estimator
    (cosine sum over sample count) with its row-clustered standard error and a Student t quantile on
    ``rows - 1`` degrees of freedom. Fewer than two rows: the plain mean.
    """
    from scipy.stats import t as student_t

    rows: dict[str, list[tuple[float, int]]] = {}
    for g, r, f in zip(got, ref, feeds):
        mask = find_mask(f)
        for name in r:
            if name in g:
                rows.setdefault(name, []).extend(_row_cosines(g[name], r[name], mask))
    out = {}
    for name, rs in rows.items():
        s = np.array([a for a, _ in rs])
        n = np.array([b for _, b in rs], np.float64)
        if not len(rs):
            continue
        mean = float(s.sum() / n.sum())
        if len(rs) < 2 or confidence <= 0:
            out[name] = mean
            continue
        e = s - mean * n
        se = float(np.sqrt(len(rs) / (len(rs) - 1) * np.sum(e ** 2)) / n.sum())
        out[name] = mean - float(student_t.ppf(confidence, len(rs) - 1)) * se
    return out


def bounded(cmp: Comparison, got: Sequence[Mapping[str, np.ndarray]], ref: Sequence[Mapping[str, np.ndarray]],
            feeds: Sequence[Mapping[str, np.ndarray]], confidence: float) -> Comparison:
    """``cmp`` with each output's ``cosine`` lowered to its :func:`cosine_lower_bound` (``confidence`` 0: ``cmp``)."""
    if confidence <= 0:
        return cmp
    lb = cosine_lower_bound(got, ref, feeds, confidence)
    return Comparison({n: dataclasses.replace(d, cosine=min(d.cosine, lb.get(n, d.cosine)))
                       for n, d in cmp.outputs.items()})


def cosine_text(plain: float | None, held: Comparison, confidence: float) -> str:
    """``0.9903 (lb 0.9886)``: a held-back mean cosine and, when one is used, its lower bound."""
    mean = held.worst("cosine") if plain is None else plain
    return f"{mean:.4f}" if confidence <= 0 else f"{mean:.4f} (lb {held.worst('cosine'):.4f})"


def agreement_lower_bound(agree: int, rows: int, confidence: float) -> float:
    """One-sided Clopper-Pearson lower bound of an agreement rate (``agree`` of ``rows``) at ``confidence``.

    ``confidence=0`` gives the plain rate ``agree / rows``.
    """
    if rows <= 0:
        return 0.0
    if confidence <= 0.0:
        return agree / rows
    if agree <= 0:
        return 0.0
    from scipy.stats import beta

    return float(beta.ppf(1.0 - confidence, agree, rows - agree + 1))
