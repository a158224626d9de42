"""Calibration for the ``quantize`` pass: activation statistics and range calibrators.

``collect`` runs the float model over the calibration feeds one feed at a time, with the wanted
activations added as graph outputs, and keeps running statistics only (memory does not grow with
the number of feeds), per activation: min/max, per-channel |max| (SmoothQuant), a random sample
of rows (local error estimates, SmoothQuant alpha search) and optionally XᵀX (GPTQ). Rows at padded
positions (attention mask 0) are left out. A second run fills signed histograms when a
histogram-based calibrator asks for them.

Layer by layer (``segment_bytes``; the ``quantize`` pass asks for it on models whose weights are
streamed from disk): the graph, whose node order is topological, is cut into consecutive segments
of about ``segment_bytes`` of weights each, and each segment becomes a model of its own whose inputs
are the values crossing into it. All feeds go through one segment before the next is loaded, so one
segment's weights and activations are in memory at a time; the values that cross to later segments
are kept per feed in an ``OutputStore`` (spilled to disk past its memory budget). The statistics are
the same as the whole model's (per activation, the feeds are folded in the same order); rows are
sampled with one random stream per activation, so they do not depend on where the cuts fall. Graphs
with subgraphs (If, Loop, Scan) are run whole.

Calibrators turn the statistics into a (min, max) range:
- ``minmax``: the observed range;
- ``percentile``: the ``percentile``-th percentile of |x| on each side (default 99.99);
- ``entropy``: the clipping threshold minimising KL(P || Q) between the |x| histogram and its
  128-level quantized version (TensorRT's method).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt import memory
from graphopt.data.metrics import find_mask
from graphopt.data.outputs import OutputStore
from graphopt.runtime import session as runtime
from graphopt.runtime import standins

logger = logging.getLogger(__name__)

BINS = 2048
#: layer-wise calibration cuts the graph into about this many segments (by weight bytes)
SEGMENTS = 16


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
    segment_bytes: int | None = None,
    on_done: Callable[[str, Stats], None] | None = None,
) -> dict[str, Stats]:
    """Statistics of the activations ``names`` over ``feeds`` (see the module docstring).

    ``segment_bytes``: run the graph layer by layer, in segments of about that many weight bytes
    (None: the whole model at once). ``on_done(name, stats)`` is called for each activation as soon
    as its statistics are complete (it may reduce them in place, e.g. turn XᵀX into a result and
    drop it), in graph order when layer by layer, at the end otherwise.
    """
    names = list(dict.fromkeys(names))
    if not names or not feeds:
        return {}
    if segment_bytes is not None:
        cuts = segments(model, segment_bytes)
        if cuts is not None:
            return _collect_layerwise(model, cuts, feeds, names, histograms=histograms, xtx_for=set(xtx_for),
                                      sample_rows=sample_rows, seed=seed, on_done=on_done)
    stats = _collect_whole(model, feeds, names, histograms=histograms, xtx_for=xtx_for,
                           sample_rows=sample_rows, seed=seed)
    if on_done is not None:
        for n, st in stats.items():
            on_done(n, st)
    return stats


def _collect_whole(model, feeds, names, *, histograms, xtx_for, sample_rows, seed) -> dict[str, Stats]:
    sess = _session_with_outputs(model, names)
    avail = {o.name for o in sess.get_outputs()}
    names = [n for n in names if n in avail]
    rng = np.random.default_rng(seed)
    stats = {n: Stats() for n in names}
    samples: dict[str, list[np.ndarray]] = {n: [] for n in names}
    n_feeds = len(feeds)
    xtx_for = set(xtx_for)
    results = []
    for i, feed in enumerate(feeds):
        take = _take(i, n_feeds, sample_rows)
        out = runtime.run(sess, [feed], outputs=names)[0]
        mask = find_mask(feed)
        for n in names:
            r = _rows(out[n], mask)
            if r.size:
                _fold(stats[n], r, take, rng, samples[n], n in xtx_for)
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


def _take(i: int, n_feeds: int, sample_rows: int) -> int:
    """Rows sampled from feed ``i`` of ``n_feeds``: ``sample_rows`` in all, also with more feeds than that."""
    if n_feeds <= sample_rows:
        return max(1, sample_rows // n_feeds)
    return (i + 1) * sample_rows // n_feeds - i * sample_rows // n_feeds


def _fold(s: Stats, r: np.ndarray, take: int, rng: np.random.Generator, samples: list, xtx: bool) -> None:
    """Fold the rows ``r`` of one feed into ``s`` (a sample of ``take`` rows goes to ``samples``)."""
    s.lo, s.hi = min(s.lo, float(r.min())), max(s.hi, float(r.max()))
    cmin, cmax = r.min(axis=0), r.max(axis=0)
    s.chan_min = cmin if s.chan_min is None else np.minimum(s.chan_min, cmin)
    s.chan_max = cmax if s.chan_max is None else np.maximum(s.chan_max, cmax)
    if take:
        idx = rng.choice(r.shape[0], size=min(take, r.shape[0]), replace=False)
        samples.append(r[idx])
    s.n_rows += r.shape[0]
    if xtx:
        xx = r.T.astype(np.float64) @ r.astype(np.float64)
        s.xtx = xx if s.xtx is None else s.xtx + xx


def segments(model: ir.Model, segment_bytes: int) -> list[list[ir.Node]] | None:
    """The main graph's nodes in consecutive runs of about ``segment_bytes`` of initializer bytes each
    (a run ends after the node that reaches it), or None for graphs with subgraphs (values they
    capture would cross the cuts unseen)."""
    graph = model.graph
    runs: list[list[ir.Node]] = [[]]
    size = 0
    seen: set[int] = set()
    for node in graph:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return None
        runs[-1].append(node)
        for v in node.inputs:
            if v is not None and v.is_initializer() and id(v) not in seen and v.const_value is not None:
                seen.add(id(v))
                size += v.const_value.nbytes
        if size >= segment_bytes:
            runs.append([])
            size = 0
    return [r for r in runs if r]


def _segment_model(model: ir.Model, index: int, cuts: list[list[ir.Node]], outputs: Sequence[str],
                   types: Mapping[str, np.dtype]) -> ir.Model:
    """Segment ``index`` of ``cuts`` as a model of its own: the values it reads from outside become
    inputs (typed from ``types``), ``outputs`` its outputs. The weights are shared, not copied."""
    lo = sum(len(c) for c in cuts[:index])
    m = model.clone()
    g = m.graph
    nodes = list(g)
    keep = nodes[lo:lo + len(cuts[index])]
    kept = set(map(id, keep))
    new_inputs: dict[str, ir.Value] = {}
    for node in keep:
        for i, v in enumerate(node.inputs):
            if v is None or v.is_initializer():
                continue
            p = v.producer()
            if p is not None and id(p) in kept:
                continue
            if v.name not in new_inputs:
                new_inputs[v.name] = ir.Value(name=v.name, type=ir.TensorType(ir.DataType.from_numpy(types[v.name])))
            node.replace_input_with(i, new_inputs[v.name])
    produced = {o.name: o for node in keep for o in node.outputs}
    g.outputs.clear()
    g.outputs.extend(produced[n] for n in outputs)
    g.remove([n for n in nodes if id(n) not in kept], safe=True)
    g.inputs.clear()
    g.inputs.extend(new_inputs.values())
    for name in [n for n, v in g.initializers.items() if not v.uses()]:
        g.initializers.pop(name)
    return m


def _collect_layerwise(model, cuts, feeds, names, *, histograms, xtx_for, sample_rows, seed, on_done
                       ) -> dict[str, Stats]:
    graph = model.graph
    # where each value is read: the segments after the one that makes it need it
    seg_of = {id(n): k for k, run in enumerate(cuts) for n in run}
    reads: dict[str, list[int]] = {}
    for k, run in enumerate(cuts):
        for node in run:
            for v in node.inputs:
                if v is not None and not v.is_initializer():
                    reads.setdefault(v.name, []).append(k)
    made_in: dict[str, int] = {o.name: seg_of[id(n)] for n in graph for o in n.outputs}
    wanted = set(names)
    ins = [sorted({v.name for n in run for v in n.inputs if v is not None and not v.is_initializer()
                   and made_in.get(v.name) != k}) for k, run in enumerate(cuts)]
    outs = [[o.name for n in run for o in n.outputs
             if o.name and (o.name in wanted or any(j > k for j in reads.get(o.name, ())))] for k, run in enumerate(cuts)]
    last_read = {name: max(ks) for name, ks in reads.items()}

    n_feeds = len(feeds)
    stats: dict[str, Stats] = {}
    masks = [find_mask(f) for f in feeds]
    order = {n: i for i, n in enumerate(names)}

    def fold(acts: list[str], outputs_per_feed, rerun) -> None:
        """Statistics of ``acts`` from their arrays feed by feed (``outputs_per_feed`` yields one dict
        per feed, in order); ``rerun()`` yields them again for the histograms."""
        rngs = {n: np.random.default_rng([seed, order[n]]) for n in acts}
        smp: dict[str, list[np.ndarray]] = {n: [] for n in acts}
        for n in acts:
            stats[n] = Stats()
        for i, got in enumerate(outputs_per_feed):
            for n in acts:
                r = _rows(got[n], masks[i])
                if r.size:
                    _fold(stats[n], r, _take(i, n_feeds, sample_rows), rngs[n], smp[n], n in xtx_for)
        for n in acts:
            if smp[n]:
                stats[n].rows = np.concatenate(smp[n])
        if histograms and acts:
            for n in acts:
                s = stats[n]
                s.edge = max(abs(s.lo), abs(s.hi), 1e-8)
                s.hist = np.zeros(BINS, np.int64)
            for i, got in enumerate(rerun()):
                for n in acts:
                    h, _ = np.histogram(_rows(got[n], masks[i]), bins=BINS, range=(-stats[n].edge, stats[n].edge))
                    stats[n].hist += h
        for n in acts:
            if on_done is not None:
                on_done(n, stats[n])

    # activations that are graph inputs come straight from the feeds
    graph_inputs = {v.name for v in graph.inputs}
    direct = [n for n in names if n in graph_inputs and all(n in f for f in feeds)]
    if direct:
        fold(direct, feeds, lambda: feeds)

    live = OutputStore()
    for f in feeds:
        live.append({k: np.asarray(v) for k, v in f.items() if k in reads})
    for k in range(len(cuts)):
        if not outs[k]:  # nothing read further on and no activation wanted (e.g. after the last one)
            continue
        first = live[0]
        seg = _segment_model(model, k, cuts, outs[k], {n: first[n].dtype for n in ins[k]})
        sess = runtime.make_session(standins.cpu_runnable(seg)[0], threads=1, level="basic")
        del seg, first
        acts = [n for n in outs[k] if n in wanted]
        store = OutputStore()
        # the values later segments read go on to ``store``, feed by feed
        onward = {n for n, last in last_read.items() if last > k}
        fold(acts, _run_segment(sess, live, ins[k], outs[k], store, onward),
             functools.partial(_run_segment, sess, live, ins[k], acts))
        live = store
        del sess
        memory.trim()
        logger.debug("calibration: segment %d of %d (%d nodes) done", k + 1, len(cuts), len(cuts[k]))
    return {n: stats[n] for n in names if n in stats}


def _run_segment(sess, live: Sequence[Mapping[str, np.ndarray]], ins: list[str], fetch: list[str],
                 store: OutputStore | None = None, onward: set[str] = frozenset()):
    """Run one segment's session on each feed's live values; yield its outputs ``fetch`` per feed and
    append the values read further on (``onward``) to ``store``."""
    for env in live:
        got = dict(zip(fetch, sess.run(fetch, {n: env[n] for n in ins})))
        if store is not None:
            store.append({n: a for n, a in {**env, **got}.items() if n in onward})
        yield got


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
