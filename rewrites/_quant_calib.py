"""Calibration for the ``quantize`` pass: activation statistics and range calibrators.

``collect`` runs the float model over the calibration feeds one feed at a time, with the wanted
activations added as graph outputs, and keeps running statistics only (memory does not grow with
the number of feeds), per activation: min/max, per-channel |max| (SmoothQuant), a random sample
of rows (local error estimates, SmoothQuant alpha search) and optionally XᵀX (GPTQ). Rows at padded
positions (attention mask 0) are left out. A second run fills signed histograms when a
histogram-based calibrator asks for them.

Calibrators turn the statistics into a (min, max) range:
- ``minmax``: the observed range;
- ``percentile``: the ``percentile``-th percentile of |x| on each side (default 99.99);
- ``entropy``: the clipping threshold minimising KL(P || Q) between the |x| histogram and its
  128-level quantized version (TensorRT's method).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt import runtime, standins
from graphopt.metrics import find_mask

BINS = 2048


@dataclasses.dataclass
class Stats:
    """Statistics of one activation over the calibration feeds."""

    lo: float = np.inf
    hi: float = -np.inf
    chan_min: np.ndarray | None = None
    chan_max: np.ndarray | None = None
    rows: np.ndarray | None = None
    xtx: np.ndarray | None = None
    hist: np.ndarray | None = None  # signed histogram over [-edge, edge]
    edge: float = 0.0
    n_rows: int = 0

    @property
    def chan_absmax(self) -> np.ndarray:
        return np.maximum(np.abs(self.chan_min), np.abs(self.chan_max))


def _rows(arr: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    a = np.asarray(arr, dtype=np.float32)
    if mask is not None and a.ndim >= 3 and a.shape[:2] == mask.shape:
        a = a[mask.astype(bool)]
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


def _session_with_outputs(model: ir.Model, names: Sequence[str]):
    m = model.clone()
    by_name = {}
    for n in m.graph:
        for o in n.outputs:
            by_name[o.name] = o
    for v in m.graph.inputs:
        by_name[v.name] = v
    present = {o.name for o in m.graph.outputs}
    for name in names:
        if name not in present and name in by_name:
            m.graph.outputs.append(by_name[name])
            present.add(name)
    return runtime.make_session(standins.cpu_runnable(m)[0], threads=1, level="basic")


def collect(
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
    *,
    histograms: bool = False,
    xtx_for: Sequence[str] = (),
    sample_rows: int = 512,
    seed: int = 0,
) -> dict[str, Stats]:
    """Statistics of the activations ``names`` over ``feeds`` (see the module docstring)."""
    names = list(dict.fromkeys(names))
    if not names or not feeds:
        return {}
    sess = _session_with_outputs(model, names)
    avail = {o.name for o in sess.get_outputs()}
    names = [n for n in names if n in avail]
    rng = np.random.default_rng(seed)
    stats = {n: Stats() for n in names}
    samples: dict[str, list[np.ndarray]] = {n: [] for n in names}
    n_feeds = len(feeds)
    per_feed = max(1, sample_rows // n_feeds)
    xtx_for = set(xtx_for)
    results = []
    for i, feed in enumerate(feeds):
        # rows sampled from this feed: sample_rows in all, also when there are more feeds than that
        take = per_feed if n_feeds <= sample_rows else (i + 1) * sample_rows // n_feeds - i * sample_rows // n_feeds
        out = runtime.run(sess, [feed], outputs=names)[0]
        mask = find_mask(feed)
        for n in names:
            r = _rows(out[n], mask)
            if r.size == 0:
                continue
            s = stats[n]
            s.lo, s.hi = min(s.lo, float(r.min())), max(s.hi, float(r.max()))
            cmin, cmax = r.min(axis=0), r.max(axis=0)
            s.chan_min = cmin if s.chan_min is None else np.minimum(s.chan_min, cmin)
            s.chan_max = cmax if s.chan_max is None else np.maximum(s.chan_max, cmax)
            if take:
                idx = rng.choice(r.shape[0], size=min(take, r.shape[0]), replace=False)
                samples[n].append(r[idx])
            s.n_rows += r.shape[0]
            if n in xtx_for:
                xx = r.T.astype(np.float64) @ r.astype(np.float64)
                s.xtx = xx if s.xtx is None else s.xtx + xx
        if histograms:
            results.append((feed, mask))
    for n in names:
        if samples[n]:
            stats[n].rows = np.concatenate(samples[n])
    if histograms:
        for n in names:
            s = stats[n]
            s.edge = max(abs(s.lo), abs(s.hi), 1e-8)
            s.hist = np.zeros(BINS, np.int64)
        for feed, mask in results:
            out = runtime.run(sess, [feed], outputs=names)[0]
            for n in names:
                r = _rows(out[n], mask)
                s = stats[n]
                h, _ = np.histogram(r, bins=BINS, range=(-s.edge, s.edge))
                s.hist += h
    return stats


def _percentile_range(s: Stats, pct: float) -> tuple[float, float]:
    cdf = np.cumsum(s.hist) / max(1, s.hist.sum())
    edges = np.linspace(-s.edge, s.edge, BINS + 1)
    tail = (100.0 - pct) / 100.0
    lo_i = int(np.searchsorted(cdf, tail))
    hi_i = int(np.searchsorted(cdf, 1.0 - tail))
    lo = max(float(edges[lo_i]), float(s.lo))
    hi = min(float(edges[min(hi_i + 1, BINS)]), float(s.hi))
    return min(lo, 0.0), max(hi, 0.0)


def _kl_threshold(s: Stats, levels: int = 128) -> float:
    """TensorRT-style entropy calibration on the |x| histogram; returns the clipping threshold."""
    half = BINS // 2
    absh = s.hist[half:].astype(np.float64) + s.hist[:half][::-1].astype(np.float64)
    nb = absh.size
    width = s.edge / nb
    best, best_i = np.inf, nb
    for i in range(levels, nb + 1, 8):
        p = absh[:i].copy()
        p[i - 1] += absh[i:].sum()
        if p.sum() == 0:
            continue
        # merge i bins into `levels`, then expand back over the non-empty bins
        idx = (np.arange(i) * levels) // i
        q_merged = np.bincount(idx, weights=absh[:i], minlength=levels)
        nonzero = np.bincount(idx, weights=(absh[:i] > 0).astype(np.float64), minlength=levels)
        q = np.where(absh[:i] > 0, q_merged[idx] / np.maximum(nonzero[idx], 1), 0.0)
        pn, qn = p / p.sum(), q / max(q.sum(), 1e-12)
        m = pn > 0
        kl = float(np.sum(pn[m] * np.log(pn[m] / np.maximum(qn[m], 1e-12))))
        if kl < best:
            best, best_i = kl, i
    return best_i * width


def act_range(s: Stats, calibrator: str, percentile: float = 99.99) -> tuple[float, float]:
    """(min, max) of an activation under ``calibrator``."""
    if calibrator == "minmax" or s.hist is None:
        return float(min(s.lo, 0.0)), float(max(s.hi, 0.0))
    if calibrator == "percentile":
        return _percentile_range(s, percentile)
    if calibrator == "entropy":
        t = _kl_threshold(s)
        lo = max(float(s.lo), -t) if s.lo < 0 else 0.0
        return lo, min(float(s.hi), t)
    raise ValueError(f"unknown calibrator {calibrator!r}")
