"""The weight side of ``sparsify``: masks in each pattern and the least-squares re-fit of the kept weights.

Scores: :func:`_elem_scores` (``wanda``: |W| · ‖x‖ of the input feature, ``magnitude``: |W|). Masks:
:func:`block_mask` (balanced blocks), :func:`nm_mask` (n:m along K), :func:`column_mask` (unstructured,
per output column). Re-fits given ``G = XᵀX`` of the calibration activations: :func:`lstsq_groups` (columns
that share their kept rows), :func:`lstsq_columns` (one exact solve per column) and :func:`sparsegpt`
(SparseGPT's sequential OBS update, for columns that keep more than ``EXACT_MAX_ROWS`` rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _damped(g: np.ndarray, damp: float) -> np.ndarray:
    g = g.copy()
    d = np.diag(g)
    g[np.diag_indices_from(g)] += damp * (float(d.mean()) if d.size else 1.0) + 1e-12
    return g


def lstsq_groups(w: np.ndarray, g: np.ndarray, groups: Sequence[tuple[np.ndarray, np.ndarray]],
                 damp: float) -> np.ndarray:
    """Re-fit ``w[K, N]``: for each (kept rows, columns) group, ``min ‖X_S w'_S − X w‖`` given ``G = XᵀX``."""
    gd = _damped(g, damp)
    out = np.zeros_like(w, dtype=np.float64)
    for rows, cols in groups:
        rhs = g[rows] @ w[:, cols].astype(np.float64)
        out[np.ix_(rows, cols)] = np.linalg.solve(gd[np.ix_(rows, rows)], rhs)
    return out.astype(np.float32)


def sparsegpt(w: np.ndarray, keep: np.ndarray, g: np.ndarray, damp: float, batch: int = 128) -> np.ndarray:
    """SparseGPT's sequential OBS update of ``w[K, N]`` (input rows K) for a fixed mask ``keep``."""
    k = w.shape[0]
    h = _damped(g, damp)
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper
    wf = w.astype(np.float64).copy()
    for i1 in range(0, k, batch):
        i2 = min(i1 + batch, k)
        blk = wf[i1:i2].copy()
        err = np.zeros_like(blk)
        hb = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q = blk[i] * keep[i1 + i]
            e = (blk[i] - q) / hb[i, i]
            blk[i:] -= np.outer(hb[i, i:], e)
            blk[i] = q
            err[i] = e
        wf[i1:i2] = blk
        wf[i2:] -= hinv[i1:i2, i2:].T @ err
    return (wf * keep).astype(np.float32)


def lstsq_columns(w: np.ndarray, keep: np.ndarray, g: np.ndarray, damp: float, chunk: int = 64) -> np.ndarray:
    """Exact least-squares re-fit of every column of ``w`` on its own kept rows (batched solves)."""
    gd = _damped(g, damp)
    out = np.zeros(w.shape, np.float64)
    kept = int(keep[:, 0].sum())
    if not np.all(keep.sum(axis=0) == kept):
        raise ValueError("every column must keep the same number of rows")
    rows = np.sort(np.argsort(~keep, axis=0, kind="stable")[:kept], axis=0).T  # [N, kept]
    for c0 in range(0, w.shape[1], chunk):
        r = rows[c0:c0 + chunk]
        a = gd[r[:, :, None], r[:, None, :]]                                   # [c, kept, kept]
        rhs = np.einsum("ckj,jc->ck", g[r], w[:, c0:c0 + chunk].astype(np.float64))
        sol = np.linalg.solve(a, rhs[..., None])[..., 0]
        np.put_along_axis(out[:, c0:c0 + chunk], r.T, sol.T, axis=0)
    return out.astype(np.float32)


#: above this many kept rows per column, per-column exact solves cost too much: SparseGPT's update instead
EXACT_MAX_ROWS = 512


def _elem_scores(w: np.ndarray, g: np.ndarray | None, scores: str) -> np.ndarray:
    s = np.abs(w).astype(np.float64)
    if scores == "wanda" and g is not None:
        s *= np.sqrt(np.maximum(np.diag(g), 0))[:, None]
    return s


def block_mask(w: np.ndarray, g: np.ndarray | None, level: float, block: int, scores: str,
               cols: int | None = None) -> np.ndarray:
    """Balanced block mask ``[K/b, N/bn]`` (``bn = cols``, default ``b``): every output block column keeps its
    top input blocks."""
    k, n = w.shape
    bn = cols or block
    s = _elem_scores(w, g, scores) ** 2
    bs = s.reshape(k // block, block, n // bn, bn).sum(axis=(1, 3))
    kept = max(1, round((k // block) * (1 - level)))
    order = np.argsort(-bs, axis=0, kind="stable")[:kept]
    keep = np.zeros_like(bs, dtype=bool)
    np.put_along_axis(keep, order, True, axis=0)
    return keep


def nm_mask(w: np.ndarray, g: np.ndarray | None, scores: str, n: int = 2, m: int = 4) -> np.ndarray:
    """n:m mask along K (the top ``n`` scores of every ``m`` consecutive input rows, per column)."""
    k, cols = w.shape
    s = _elem_scores(w, g, scores).reshape(k // m, m, cols)
    order = np.argsort(-s, axis=1, kind="stable")[:, :n, :]
    keep = np.zeros_like(s, dtype=bool)
    np.put_along_axis(keep, order, True, axis=1)
    return keep.reshape(k, cols)


def column_mask(w: np.ndarray, g: np.ndarray | None, level: float, scores: str) -> np.ndarray:
    """Unstructured: each output column keeps its top ``(1 - level) K`` weights (Wanda's comparison group)."""
    k = w.shape[0]
    s = _elem_scores(w, g, scores)
    kept = max(1, round(k * (1 - level)))
    order = np.argsort(-s, axis=0, kind="stable")[:kept]
    keep = np.zeros_like(s, dtype=bool)
    np.put_along_axis(keep, order, True, axis=0)
    return keep
