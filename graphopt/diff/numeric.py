"""Numeric diff: run A and B on the same feeds and compare every tensor both graphs still have.

The paired values of the structural match (same name, or outputs of matched nodes, or a rewritten
region's outputs) are exposed as extra graph outputs on copies of both models; ONNX Runtime runs
them with graph optimizations off (so what runs is what the graphs say), and each pair is compared
mask-aware with ``graphopt.data.metrics.compare``. The *first divergence* is the earliest pair in A's
topological order whose error exceeds ``atol + rtol*|ref|``; the *path* follows A's data flow from
it to the nearest graph output and lists the error of every compared tensor on the way.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from graphopt.data import feeds as feeds_mod
from graphopt.data import metrics
from graphopt.diff import staged
from graphopt.diff.structural import Matching, op_key
from graphopt.errors import GraphoptError
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)

#: A values compared per step of a staged run (bounds the intermediates alive at once)
GROUP = 16


def _pairs(m: Matching) -> list[tuple[ir.Value, ir.Value]]:
    """(A value, B value) pairs worth comparing, in A's topological order."""
    a_order: dict[ir.Value, int] = {}
    k = 0
    for n in m.a_nodes:
        for v in n.outputs:
            a_order[v] = k
            k += 1
    pairs = [(va, vb) for vb, va in m.value_b2a.items() if va in a_order and va.name and vb.name]
    pairs.sort(key=lambda p: a_order[p[0]])
    return pairs


def _with_outputs(model: ir.Model, names: Sequence[str]):
    """A ModelProto copy of ``model`` whose graph outputs also list ``names``."""
    proto = ir.serde.serialize_model(model)
    have = {o.name for o in proto.graph.output}
    for n in names:
        if n not in have:
            proto.graph.output.append(onnx.ValueInfoProto(name=n))
            have.add(n)
    return proto


def _feeds_for(ma: ir.Model, mb: ir.Model, feeds, calib, shapes, values):
    """A's feeds (``graphopt.data.feeds.select``); generated ones get what B's extra inputs need too."""
    selection = feeds_mod.select(ma, feeds=feeds, calib=calib, shapes=shapes, values=values, check_given=True)
    feeds = selection.feeds
    if selection.source == "generated":
        b_needs = [v.name for v in mb.graph.inputs if v.name not in mb.graph.initializers]
        if any(n not in feeds[0] for n in b_needs):
            extra = feeds_mod.generate(mb, count=len(feeds) - 1 if len(feeds) > 1 else 1)
            for f, e in zip(feeds, extra, strict=False):
                for k, v in e.items():
                    f.setdefault(k, v)
    return feeds


def _ort_error(e: Exception) -> GraphoptError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return GraphoptError(f"numeric diff: ONNX Runtime failed to run the models: {msg}")


def _compare_pairs(ma: ir.Model, mb: ir.Model, pairs, feeds, atol: float, rtol: float):
    """Running comparison of every pair over ``feeds``, one feed and one group of pairs at a time.

    Both models run staged (``graphopt.diff.staged``): group ``c`` holds ``GROUP`` of A's values in
    topological order and their B partners; each group is compared, then dropped. Where a model
    cannot be cut, both run whole (every intermediate of one feed at once), as before.
    """
    a_names = [va.name for va, _ in pairs]
    distinct = list(dict.fromkeys(a_names))
    group_of = {n: k // GROUP for k, n in enumerate(distinct)}
    n_groups = (len(distinct) + GROUP - 1) // GROUP
    groups = [[] for _ in range(n_groups)]
    for va, vb in pairs:
        groups[group_of[va.name]].append((va.name, vb.name))
    try:
        runs = (staged.StagedRun(ir.serde.serialize_model(ma), [[a for a, _ in g] for g in groups]),
                staged.StagedRun(ir.serde.serialize_model(mb), [[b for _, b in g] for g in groups]))
        return _compare_runs(runs, groups, a_names, feeds, atol, rtol)
    except Exception as e:  # a model the cut does not suit: run both whole
        logger.debug("numeric diff: staged run failed (%s); running both models whole", e, exc_info=True)
    whole = [[(va.name, vb.name) for va, vb in pairs]]
    try:
        runs = (_WholeRun(_with_outputs(ma, a_names)), _WholeRun(_with_outputs(mb, [vb.name for _, vb in pairs])))
        return _compare_runs(runs, whole, a_names, feeds, atol, rtol)
    except GraphoptError:
        raise
    except Exception as e:
        raise _ort_error(e) from e


class _WholeRun:
    """The model in one session with every wanted value as a graph output: one group per feed."""

    def __init__(self, proto):
        self.sess = runtime.make_session(proto, optimize=False)

    def run(self, feed):
        yield runtime.run(self.sess, [feed], [o.name for o in self.sess.get_outputs()])[0]


def _compare_runs(runs, groups, a_names, feeds, atol, rtol):
    comparer = metrics.Comparer(a_names, atol=atol, rtol=rtol)
    sets = [{a for a, _ in g} for g in groups]
    names_of = [[n for n in a_names if n in group] for group in sets]  # repeats kept, as compare() had them
    for feed in feeds:
        for g, names, oa, ob in zip(groups, names_of, *(r.run(feed) for r in runs), strict=True):
            got, ref = {}, {}
            for a, b in g:  # B's tensors keyed by their A counterpart's name (the last pair wins, as before)
                if b in ob:
                    got[a] = ob[b]
                if a in oa:
                    ref[a] = oa[a]
            comparer.add(got, ref, feed, names=names)
            del got, ref, oa, ob
        _release_freed_memory()  # batches of other lengths would otherwise grow the heap feed by feed
    return comparer.result()


def _release_freed_memory() -> None:
    """Give the C heap's freed pages back to the system (glibc ``malloc_trim``; a no-op elsewhere)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:

        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def numeric_diff(
    ma: ir.Model,
    mb: ir.Model,
    m: Matching,
    *,
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    calib: str | os.PathLike | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> dict[str, Any]:
    """Compare the paired intermediate tensors of ``ma`` and ``mb``; see the module docstring. Feeds: the
    ``calib`` folder's, else ``feeds``, else generated to make ``ma`` run (``shapes`` / ``values`` fix inputs)."""
    feeds = _feeds_for(ma, mb, feeds, calib, shapes, values)
    pairs = _pairs(m)
    comp = _compare_pairs(ma, mb, pairs, feeds, atol, rtol)
    a_idx = {id(n): i for i, n in enumerate(m.a_nodes)}
    b_idx = {id(n): j for j, n in enumerate(m.b_nodes)}
    tensors = []
    node_err: dict[str, dict[str, float]] = {"a": {}, "b": {}}
    exceeding: set[str] = set()
    for va, vb in pairs:
        d = comp.outputs[va.name]
        bad = d.shape_mismatch is not None or d.mismatch > 0
        pa, pb = va.producer(), vb.producer()
        rec = {
            "a": va.name, "b": vb.name,
            "a_node": f"a{a_idx[id(pa)]}" if pa is not None and id(pa) in a_idx else None,
            "b_node": f"b{b_idx[id(pb)]}" if pb is not None and id(pb) in b_idx else None,
            "op": op_key(pa) if pa is not None else None,
            "max_abs": d.max_abs, "max_rel": d.max_rel, "cosine": d.cosine, "mismatch": d.mismatch,
            "shape_mismatch": d.shape_mismatch, "exceeds": bad, "graph_output": va.is_graph_output(),
        }
        tensors.append(rec)
        if bad:
            exceeding.add(va.name)
        err = float("inf") if d.shape_mismatch else d.max_abs
        for side, nid in (("a", rec["a_node"]), ("b", rec["b_node"])):
            if nid is not None:
                node_err[side][nid] = max(node_err[side].get(nid, 0.0), err)

    first = next((t for t in tensors if t["exceeds"]), None)
    if first is not None and first["a_node"] is not None:
        node = m.a_nodes[int(first["a_node"][1:])]
        first = {**first, "node_name": node.name or "",
                 "node_inputs": [v.name if v is not None else "" for v in node.inputs],
                 "changed_initializers": [v.name for v in node.inputs
                                          if v is not None and v.name in m.init_changed]}
    path = _path_to_output(m, first["a"], {t["a"]: t for t in tensors}) if first else []
    outputs = {t["a"]: {k: t[k] for k in ("max_abs", "max_rel", "cosine", "mismatch", "shape_mismatch", "exceeds")}
               for t in tensors if t["graph_output"]}
    return {
        "feeds": len(feeds),
        "atol": atol, "rtol": rtol,
        "compared": len(tensors),
        "exceeding": len(exceeding),
        "first_divergence": first,
        "path": path,
        "outputs": outputs,
        "outputs_exceeding": sorted(n for n, o in outputs.items() if o["exceeds"]),
        "tensors": tensors,
        "node_errors": node_err,
    }


def _path_to_output(m: Matching, start: str, by_name: dict[str, dict]) -> list[dict]:
    """Shortest data-flow path in A from value ``start`` to a graph output, with errors on it."""
    values = {v.name: v for n in m.a_nodes for v in n.outputs}
    v0 = values.get(start)
    if v0 is None:
        return []
    prev: dict[ir.Value, ir.Value | None] = {v0: None}
    queue = collections.deque([v0])
    end = None
    while queue:
        v = queue.popleft()
        if v.is_graph_output():
            end = v
            break
        for user, _ in v.uses():
            for o in user.outputs:
                if o not in prev:
                    prev[o] = v
                    queue.append(o)
    if end is None:
        return []
    chain = []
    v = end
    while v is not None:
        chain.append(v)
        v = prev[v]
    chain.reverse()
    out = []
    for v in chain:
        t = by_name.get(v.name)
        if t is not None:
            out.append({"a": v.name, "op": t["op"], "max_abs": t["max_abs"], "cosine": t["cosine"],
                        "exceeds": t["exceeds"]})
    return out
