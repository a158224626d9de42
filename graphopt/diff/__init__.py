"""Graph diff: what changed between two ONNX models, structurally and numerically.

``diff_models(a, b)`` matches the nodes of B against A, groups the unmatched ones into rewritten
regions (credited to the pass that created them, with the passes that rebuilt them since, from the
provenance the pipeline writes on nodes: :mod:`graphopt.engine.provenance`), and
summarises op-histogram, initializer, IO-signature, parameter, FLOP and subgraph deltas. With
``numeric=True`` both models run on the same feeds and every intermediate tensor they share is
compared, to find the first one that drifts beyond tolerance.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from graphopt import io
from graphopt.analysis.flops import FLOP_BATCH, FLOP_SEQ, estimate_flops
from graphopt.diff import deltas
from graphopt.diff import numeric as _numeric
from graphopt.diff.matching import Matching, NodeId, Side, match_graphs, pass_of
from graphopt.diff.regions import find_regions
from graphopt.diff.result import SCHEMA_VERSION, DiffResult
from graphopt.diff.scopes import node_scope
from graphopt.engine import provenance
from graphopt.opsets import op_histogram, op_key

__all__ = ["SCHEMA_VERSION", "DiffResult", "diff_models"]


def _as_model(m: ir.Model | str | os.PathLike) -> tuple[ir.Model, str]:
    if isinstance(m, ir.Model):
        return m, m.graph.name or "model"

    return io.load(m), str(m)


def _opsets(model: ir.Model) -> dict[str, int]:
    return {(k or "ai.onnx"): v for k, v in sorted(model.opset_imports.items())}


def _node_records(m: Matching, side: Side) -> list[dict[str, Any]]:
    """One JSON node record per node of ``side``, in graph order (so record k is node k)."""
    return [
        {
            "id": str(NodeId(side, i)),
            "name": n.name or "",
            "op": op_key(n),
            "status": "unchanged",
            "match": None,
            "region": None,
            "pass": pass_of(n),
            "chain": provenance.chain_of(n),
            "changes": [],
            "inputs": [v.name if v is not None else "" for v in n.inputs],
            "outputs": [v.name or "" for v in n.outputs],
            "scope": node_scope(n),
        }
        for i, n in enumerate(m.nodes(side))
    ]


def diff_models(
    a: ir.Model | str | os.PathLike,
    b: ir.Model | str | os.PathLike,
    *,
    numeric: bool = False,
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    calib: str | os.PathLike | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    input_values: Mapping[str, np.ndarray] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    flop_batch: int = FLOP_BATCH,
    flop_seq: int = FLOP_SEQ,
) -> DiffResult:
    """Diff model ``a`` (before) against ``b`` (after); paths are loaded with ``graphopt.io.load``.

    ``numeric``: also run both on the same feeds (``calib``'s, else ``feeds``, else generated to make A
    run, ``input_shapes`` / ``input_values`` fixing inputs: ``graphopt.data.feeds.select``) and compare
    the tensors both graphs still have, with ``atol``/``rtol``.
    """
    ma, label_a = _as_model(a)
    mb, label_b = _as_model(b)
    ga, gb = ma.graph, mb.graph
    m = match_graphs(ga, gb)
    regions = find_regions(m)

    records = {side: _node_records(m, side) for side in Side}
    ra, rb = records[Side.A], records[Side.B]

    def rec(nid: NodeId) -> dict[str, Any]:
        return records[nid.side][nid.index]

    for na, nb in m.pairs():
        rec(na)["match"], rec(nb)["match"] = str(nb), str(na)
        if nb.index in m.modified:
            for nid in (na, nb):
                rec(nid).update(status="modified", changes=list(m.modified[nb.index]))
    for r in regions:
        for nid in r.a_nodes:
            rec(nid).update(status="removed", region=r.id)
        for nid in r.b_nodes:
            rec(nid).update(status="added", region=r.id)

    hist_a, hist_b = op_histogram(ga), op_histogram(gb)
    hist_delta = {k: hist_b[k] - hist_a[k] for k in sorted(set(hist_a) | set(hist_b)) if hist_b[k] != hist_a[k]}
    inits = deltas.initializer_delta(ga, gb, m)
    io_d = deltas.io_delta(ga, gb)
    subs = deltas.subgraph_delta(m)
    fa = estimate_flops(ma, flop_batch, flop_seq)
    fb = estimate_flops(mb, flop_batch, flop_seq)

    modified = [
        {"a": str(na), "b": str(nb), "op": op_key(m.node(nb)), "name": m.node(nb).name or "",
         "changes": m.modified[nb.index]}
        for na, nb in m.pairs() if nb.index in m.modified
    ]
    counts = collections.Counter(r["status"] for r in ra)
    counts_b = collections.Counter(r["status"] for r in rb)
    identical = (
        not regions and not modified and not io_d["changed"] and not inits["added"] and not inits["removed"]
        and not inits["changed"] and not any(s["changed"] for s in subs) and _opsets(ma) == _opsets(mb)
    )
    summary = {
        "identical": identical,
        "nodes_a": len(m.a_nodes),
        "nodes_b": len(m.b_nodes),
        "matched": len(m.node_b2a),
        "unchanged": counts["unchanged"],
        "modified": len(modified),
        "removed": counts["removed"],
        "added": counts_b["added"],
        "regions": len(regions),
        "passes": dict(sum((collections.Counter(r.passes) for r in regions), collections.Counter())),
        "chains": dict(sum((collections.Counter(r.chains) for r in regions), collections.Counter())),
    }
    result = DiffResult(
        a={"label": label_a, "nodes": len(m.a_nodes), "opsets": _opsets(ma)},
        b={"label": label_b, "nodes": len(m.b_nodes), "opsets": _opsets(mb)},
        summary=summary,
        op_histogram={"a": dict(sorted(hist_a.items())), "b": dict(sorted(hist_b.items())), "delta": hist_delta},
        regions=[r.as_dict() for r in regions],
        modified=modified,
        initializers=inits,
        io=io_d,
        params={"a": inits["a"]["params"], "b": inits["b"]["params"], "delta": inits["delta"]["params"]},
        flops={"a": fa, "b": fb, "delta": fb["total"] - fa["total"], "batch": flop_batch, "seq": flop_seq},
        subgraphs=subs,
        graphs={"a": ra, "b": rb},
    )
    if numeric:

        result.numeric = _numeric.numeric_diff(ma, mb, m, feeds=feeds, calib=calib, shapes=input_shapes,
                                               values=input_values, atol=atol, rtol=rtol)
        by_id = {r["id"]: r for r in (*ra, *rb)}
        for side in Side:
            for nid, err in result.numeric["node_errors"][side.value].items():
                by_id[nid]["max_abs"] = err
    return result
