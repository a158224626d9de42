"""Summary deltas of two ONNX graphs: initializers, IO signature, subgraph bodies.

(Op histograms come from ``graphopt.opsets.op_histogram``, FLOPs from ``graphopt.analysis.flops``.)
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from graphopt.analysis.params import weight_elements
from graphopt.diff.matching import Matching, NodeId, a_id, b_id, graph_fingerprint
from graphopt.opsets import op_histogram, op_key


def initializer_stats(graph: ir.Graph) -> dict:
    """Count, bytes, parameters (``graphopt.analysis.params``), dtype histogram and sparsity (zero
    fraction of the float parameters) of the initializers."""
    count = nbytes = params = floats = zeros = 0
    dtypes: collections.Counter = collections.Counter()
    for v in graph.initializers.values():
        t = v.const_value
        if t is None:
            continue
        count += 1
        nbytes += t.nbytes
        n = int(np.prod(t.shape)) if len(t.shape) else 1
        dtypes[str(t.dtype.name if hasattr(t.dtype, "name") else t.dtype)] += 1
        params += weight_elements(v) or 0
        if t.dtype.is_floating_point():
            floats += n
            try:
                zeros += n - int(np.count_nonzero(t.numpy()))
            except Exception:  # noqa: BLE001
                pass
    return {"count": count, "bytes": nbytes, "params": params, "dtypes": dict(sorted(dtypes.items())),
            "sparsity": (zeros / floats) if floats else 0.0}


def _tensor_desc(t) -> dict:
    return {"dtype": str(t.dtype.name), "shape": [int(d) for d in t.shape], "bytes": int(t.nbytes)}


def initializer_delta(ga: ir.Graph, gb: ir.Graph, m: Matching, limit: int = 200) -> dict:
    """Summary numbers of both sides plus lists of added, removed, changed and renamed initializers."""
    sa, sb = initializer_stats(ga), initializer_stats(gb)
    b_vals = set(gb.initializers.values())
    mapped_a = {va.name: vb.name for vb, va in m.value_b2a.items() if vb in b_vals}
    removed = [n for n in ga.initializers if n not in mapped_a]
    added = [n for n, v in gb.initializers.items() if v not in m.value_b2a]
    renamed = [{"a": a, "b": b} for a, b in mapped_a.items() if a != b]
    changed = []
    for name in m.init_changed:
        ta, tb = ga.initializers[name].const_value, gb.initializers[name].const_value
        entry = {"name": name, **_tensor_desc(ta)}
        try:
            da, db = ta.numpy(), tb.numpy()
            if da.dtype.kind in "fiu":
                entry["max_abs"] = float(np.max(np.abs(da.astype(np.float64) - db.astype(np.float64)))) if da.size else 0.0
                entry["elements_changed"] = int(np.count_nonzero(da != db))
        except Exception:  # noqa: BLE001
            pass
        changed.append(entry)

    def desc(g: ir.Graph, names: Iterable[str]) -> list[dict]:
        out = []
        for n in list(names)[:limit]:
            t = g.initializers[n].const_value
            out.append({"name": n, **(_tensor_desc(t) if t is not None else {})})
        return out

    return {
        "a": sa, "b": sb,
        "delta": {"count": sb["count"] - sa["count"], "bytes": sb["bytes"] - sa["bytes"],
                  "params": sb["params"] - sa["params"], "sparsity": sb["sparsity"] - sa["sparsity"]},
        "added": desc(gb, added), "removed": desc(ga, removed), "changed": changed[:limit],
        "renamed": renamed[:limit],
        "truncated": max(len(added), len(removed), len(changed), len(renamed)) > limit,
    }


def _value_sig(v: ir.Value) -> dict:
    shape = None if v.shape is None else [d if isinstance(d, int) else str(d) for d in v.shape]
    return {"name": v.name, "dtype": None if v.dtype is None else v.dtype.name, "shape": shape}


def io_delta(ga: ir.Graph, gb: ir.Graph) -> dict:
    """Inputs and outputs added, removed or changed (dtype or shape)."""
    out = {}
    for kind, la, lb in (("inputs", [v for v in ga.inputs if v.name not in ga.initializers],
                          [v for v in gb.inputs if v.name not in gb.initializers]),
                         ("outputs", list(ga.outputs), list(gb.outputs))):
        sa = {v.name: _value_sig(v) for v in la}
        sb = {v.name: _value_sig(v) for v in lb}
        out[kind] = {
            "a": list(sa.values()), "b": list(sb.values()),
            "added": [n for n in sb if n not in sa], "removed": [n for n in sa if n not in sb],
            "changed": [{"name": n, "a": sa[n], "b": sb[n]} for n in sa if n in sb and sa[n] != sb[n]],
        }
    out["changed"] = any(out[k]["added"] or out[k]["removed"] or out[k]["changed"] for k in ("inputs", "outputs"))
    return out


def subgraph_delta(m: Matching) -> list[dict]:
    """For every control-flow node with bodies (If/Loop/Scan...): body node counts on both sides."""
    out = []
    a2b = m.node_a2b
    for i, na in enumerate(m.a_nodes):
        bodies_a = _bodies(na)
        j = a2b.get(i)
        bodies_b = _bodies(m.b_nodes[j]) if j is not None else {}
        if bodies_a or bodies_b:
            out.append(_body_entry(a_id(i), na, b_id(j) if j is not None else None, bodies_a, bodies_b))
    matched_b = set(m.node_b2a)
    for j, nb in enumerate(m.b_nodes):
        if j not in matched_b and (bodies_b := _bodies(nb)):
            out.append(_body_entry(None, nb, b_id(j), {}, bodies_b))
    return out


def _bodies(node: ir.Node) -> dict[str, ir.Graph]:
    out = {}
    for k, a in node.attributes.items():
        if a.type == ir.AttributeType.GRAPH:
            out[k] = a.value
        elif a.type == ir.AttributeType.GRAPHS:
            for n, g in enumerate(a.value):
                out[f"{k}[{n}]"] = g
    return out


def _body_entry(na_id: NodeId | None, node: ir.Node, nb_id: NodeId | None,
                bodies_a: dict[str, ir.Graph], bodies_b: dict[str, ir.Graph]) -> dict:
    entry = {"a": None if na_id is None else str(na_id), "b": None if nb_id is None else str(nb_id),
             "op": op_key(node), "name": node.name, "bodies": []}
    for k in sorted(set(bodies_a) | set(bodies_b)):
        ga, gb = bodies_a.get(k), bodies_b.get(k)
        ha = op_histogram(ga) if ga is not None else collections.Counter()
        hb = op_histogram(gb) if gb is not None else collections.Counter()
        entry["bodies"].append({
            "attribute": k,
            "a_nodes": sum(ha.values()) if ga is not None else None,
            "b_nodes": sum(hb.values()) if gb is not None else None,
            "op_delta": {o: hb[o] - ha[o] for o in sorted(set(ha) | set(hb)) if hb[o] != ha[o]},
            "changed": (ga is None) != (gb is None) or (ga is not None and graph_fingerprint(ga) != graph_fingerprint(gb)),
        })
    entry["changed"] = any(b["changed"] for b in entry["bodies"])
    return entry
