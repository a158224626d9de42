"""Structural diff of two ONNX graphs: node matching, rewritten regions, and summary deltas.

Matching (main graph; subgraph bodies are compared by op histogram):

1. Values are seeded: graph inputs by name; initializers by name when dtype and shape agree
   (content may differ: reported as a changed initializer), else by content hash (renamed).
2. B's nodes are visited in topological order. A B node matches an unmatched A node with the same
   domain, op type and attributes whose inputs are the matched counterparts of B's inputs
   (inputs not yet matched act as wildcards against unmatched A values); among several candidates
   the one with the same name wins, then the one with the same output names. Failing that, an A
   node with the same name and op type is matched as *modified*. A match pairs the outputs, and
   the wildcard inputs it bridged (a rewritten region's output feeding an unchanged node).
3. Unmatched values with equal names are paired too: rewriters keep the names of the values they
   replace, so a fused node's output lines up with the end of the subgraph it replaced.

Unmatched nodes are grouped into *regions*: connected components of unmatched A nodes and
unmatched B nodes, joined through values that have no counterpart, and across the two graphs
through paired values one side of each produces ("these 14 nodes became this LayerNormalization").
The pass that made a region is read from the ``graphopt.pass`` metadata of its B nodes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from graphopt import PASS_TAG
from graphopt.flops import FLOP_BATCH, FLOP_SEQ, estimate_flops  # noqa: F401 (re-exported for diff)
from graphopt.report import op_histogram, op_key

logger = logging.getLogger(__name__)


_WILD = object()


def _domain(node: ir.Node) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def tensor_hash(t) -> str:
    """Content hash of a tensor: dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=12)
    h.update(str(t.dtype).encode())
    h.update(str(tuple(t.shape)).encode())
    try:
        h.update(t.tobytes())
    except Exception:  # noqa: BLE001 - unreadable external data: hash by name only
        h.update(b"?")
    return h.hexdigest()


def graph_fingerprint(graph: ir.Graph) -> str:
    """Structure of a (sub)graph: its op sequence and initializer hashes, names ignored."""
    h = hashlib.blake2b(digest_size=12)
    for node in graph:
        h.update(op_key(node).encode())
        h.update(_attr_hash(node).encode())
        h.update(str(len(node.inputs)).encode())
    for v in graph.initializers.values():
        if v.const_value is not None:
            h.update(tensor_hash(v.const_value).encode())
    return h.hexdigest()


def _attr_value_repr(attr) -> str:
    t = attr.type
    if t == ir.AttributeType.TENSOR:
        return tensor_hash(attr.value)
    if t == ir.AttributeType.TENSORS:
        return ",".join(tensor_hash(x) for x in attr.value)
    if t == ir.AttributeType.GRAPH:
        return graph_fingerprint(attr.value)
    if t == ir.AttributeType.GRAPHS:
        return ",".join(graph_fingerprint(g) for g in attr.value)
    return repr(attr.value)


def _attr_hash(node: ir.Node) -> str:
    parts = [f"{k}={_attr_value_repr(a)}" for k, a in sorted(node.attributes.items())]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def pass_of(node: ir.Node) -> str | None:
    """The pass that created ``node`` (its ``graphopt.pass`` metadata), or None."""
    return node.metadata_props.get(PASS_TAG) or None


# ---------------------------------------------------------------- result records


@dataclasses.dataclass
class NodeInfo:
    """One node of A or B as the diff sees it."""

    id: str  # "a12" / "b7": side and index in graph order
    name: str
    op: str
    status: str = "unchanged"  # unchanged | modified | removed (A) | added (B)
    match: str | None = None  # id of the counterpart
    region: int | None = None
    pass_name: str | None = None
    changes: list[str] = dataclasses.field(default_factory=list)
    inputs: list[str] = dataclasses.field(default_factory=list)  # value names
    outputs: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Region:
    """A connected set of unmatched A nodes and the unmatched B nodes that replaced them."""

    id: int
    a_nodes: list[str]
    b_nodes: list[str]
    a_ops: dict[str, int]
    b_ops: dict[str, int]
    passes: dict[str, int]  # pass name -> number of B nodes tagged with it
    inputs: list[str]  # boundary values (A names) the region reads
    outputs: list[str]  # boundary values (A names, else B names) the region produces
    shared_by: list[int] = dataclasses.field(default_factory=list)  # regions a shared helper region fed

    @property
    def kind(self) -> str:
        if self.a_nodes and self.b_nodes:
            return "rewritten"
        return "removed" if self.a_nodes else "added"

    def summary(self) -> str:
        def ops(d: dict[str, int]) -> str:
            return ", ".join(f"{k}×{n}" if n > 1 else k for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))

        by = f" by {', '.join(sorted(self.passes))}" if self.passes else ""
        fed = f", shared by regions {', '.join(map(str, self.shared_by))}" if self.shared_by else ""
        if self.kind == "rewritten":
            return f"{len(self.a_nodes)} nodes ({ops(self.a_ops)}) became {len(self.b_nodes)} ({ops(self.b_ops)}){fed}{by}"
        if self.kind == "removed":
            return f"{len(self.a_nodes)} nodes removed ({ops(self.a_ops)}){fed}{by}"
        return f"{len(self.b_nodes)} nodes added ({ops(self.b_ops)}){fed}{by}"

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["kind"] = self.kind
        d["summary"] = self.summary()
        return d


@dataclasses.dataclass
class Matching:
    """Node and value correspondence between two graphs."""

    a_nodes: list[ir.Node]
    b_nodes: list[ir.Node]
    node_b2a: dict[int, int]  # B index -> A index
    modified: dict[int, list[str]]  # B index -> what differs
    value_b2a: dict[ir.Value, ir.Value]
    init_changed: dict[str, str]  # A initializer name -> reason

    @property
    def node_a2b(self) -> dict[int, int]:
        return {a: b for b, a in self.node_b2a.items()}


# ---------------------------------------------------------------- matching


def _init_values(graph: ir.Graph) -> dict[str, ir.Value]:
    return dict(graph.initializers)


def _match_values_seed(ga: ir.Graph, gb: ir.Graph) -> tuple[dict[ir.Value, ir.Value], dict[str, str]]:
    b2a: dict[ir.Value, ir.Value] = {}
    changed: dict[str, str] = {}
    a_in = {v.name: v for v in ga.inputs}
    for v in gb.inputs:
        if v.name in a_in and v.name not in gb.initializers:
            b2a[v] = a_in[v.name]
    ia, ib = _init_values(ga), _init_values(gb)
    used_a: set[str] = set()
    for name, vb in ib.items():
        va = ia.get(name)
        if va is None:
            continue
        ta, tb = va.const_value, vb.const_value
        if ta is not None and tb is not None and (ta.dtype != tb.dtype or tuple(ta.shape) != tuple(tb.shape)):
            continue
        b2a[vb] = va
        used_a.add(name)
        if ta is not None and tb is not None and tensor_hash(ta) != tensor_hash(tb):
            changed[name] = "content"
    # renamed initializers: same content, different name
    by_hash: dict[str, list[str]] = collections.defaultdict(list)
    for name, va in ia.items():
        if name not in used_a and va.const_value is not None:
            by_hash[tensor_hash(va.const_value)].append(name)
    for vb in ib.values():
        if vb in b2a or vb.const_value is None:
            continue
        cands = by_hash.get(tensor_hash(vb.const_value))
        if cands:
            b2a[vb] = ia[cands.pop(0)]
    return b2a, changed


def match_graphs(ga: ir.Graph, gb: ir.Graph) -> Matching:
    """Match the nodes and values of graph ``gb`` against ``ga`` (see the module docstring)."""
    a_nodes, b_nodes = list(ga), list(gb)
    a_idx = {id(n): i for i, n in enumerate(a_nodes)}
    b2a, init_changed = _match_values_seed(ga, gb)
    a_mapped: set[ir.Value] = set(b2a.values())

    a_attr = [_attr_hash(n) for n in a_nodes]
    a_by_name: dict[str, list[int]] = collections.defaultdict(list)
    a_by_sig: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, n in enumerate(a_nodes):
        if n.name:
            a_by_name[n.name].append(i)
        a_by_sig[(_domain(n), n.op_type, a_attr[i], len(n.inputs))].append(i)
    a_matched: set[int] = set()
    node_b2a: dict[int, int] = {}
    modified: dict[int, list[str]] = {}

    def pair_value(vb: ir.Value, va: ir.Value) -> None:
        if vb in b2a or va in a_mapped:
            return
        b2a[vb] = va
        a_mapped.add(va)

    for j, nb in enumerate(b_nodes):
        # a B value not yet paired may pair with the unmatched A value of the same name
        ins: list = []
        for v in nb.inputs:
            if v is None:
                ins.append(None)
            elif v in b2a:
                ins.append(b2a[v])
            else:
                ins.append(_WILD)
        sig = (_domain(nb), nb.op_type, _attr_hash(nb), len(nb.inputs))
        cands = []
        for i in a_by_sig.get(sig, ()):
            if i in a_matched:
                continue
            na = a_nodes[i]
            ok = True
            for va, want in zip(na.inputs, ins, strict=False):
                if want is None:
                    ok = va is None
                elif want is _WILD:
                    ok = va is not None and va not in a_mapped
                else:
                    ok = va is want
                if not ok:
                    break
            if ok:
                cands.append(i)
        n_known = sum(1 for x in ins if x is not None and x is not _WILD)
        if cands and n_known == 0 and len(nb.inputs) > 0:
            # all inputs unknown: accept only a name or output-name match
            cands = [i for i in cands if _same_names(a_nodes[i], nb)]
        choice: int | None = None
        if cands:
            choice = max(cands, key=lambda i: (a_nodes[i].name == nb.name and bool(nb.name),
                                                _out_names_equal(a_nodes[i], nb), -abs(i - j)))
            node_b2a[j] = choice
        elif nb.name:
            for i in a_by_name.get(nb.name, ()):
                na = a_nodes[i]
                if i not in a_matched and _domain(na) == _domain(nb) and na.op_type == nb.op_type:
                    choice = i
                    node_b2a[j] = i
                    modified[j] = _differences(na, nb, b2a)
                    break
        if choice is None:
            continue
        a_matched.add(choice)
        na = a_nodes[choice]
        for vb, va in zip(nb.inputs, na.inputs, strict=False):
            if vb is not None and va is not None and vb not in b2a and va not in a_mapped:
                pair_value(vb, va)
        for vb, va in zip(nb.outputs, na.outputs, strict=False):
            pair_value(vb, va)
        changed_inits = [v.name for v in na.inputs if v is not None and v.name in init_changed and v.is_initializer()]
        if changed_inits:
            modified.setdefault(j, []).extend(f"initializer {n!r} content changed" for n in changed_inits)

    # name pairing of the values still unpaired (outputs of rewritten regions)
    a_vals = {v.name: v for n in a_nodes for v in n.outputs if v.name and v not in a_mapped}
    for nb in b_nodes:
        for vb in nb.outputs:
            if vb not in b2a and vb.name in a_vals:
                va = a_vals[vb.name]
                if va not in a_mapped:
                    pair_value(vb, va)
    del a_idx
    return Matching(a_nodes, b_nodes, node_b2a, modified, b2a, init_changed)


def _same_names(na: ir.Node, nb: ir.Node) -> bool:
    return (bool(nb.name) and na.name == nb.name) or _out_names_equal(na, nb)


def _out_names_equal(na: ir.Node, nb: ir.Node) -> bool:
    return bool(nb.outputs) and [v.name for v in na.outputs] == [v.name for v in nb.outputs]


def _differences(na: ir.Node, nb: ir.Node, b2a: dict) -> list[str]:
    out = []
    ka, kb = set(na.attributes), set(nb.attributes)
    for k in sorted(ka | kb):
        if k not in ka:
            out.append(f"attribute {k} added")
        elif k not in kb:
            out.append(f"attribute {k} removed")
        elif _attr_value_repr(na.attributes[k]) != _attr_value_repr(nb.attributes[k]):
            out.append(f"attribute {k} changed")
    if len(na.inputs) != len(nb.inputs):
        out.append(f"{len(na.inputs)} inputs became {len(nb.inputs)}")
    else:
        for k, (va, vb) in enumerate(zip(na.inputs, nb.inputs, strict=False)):
            if (va is None) != (vb is None) or (vb is not None and b2a.get(vb) is not va):
                out.append(f"input {k} changed")
    return out or ["name-matched"]


# ---------------------------------------------------------------- regions


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, x, y) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[ry] = rx


def find_regions(m: Matching) -> list[Region]:
    """Group the unmatched nodes of both graphs into rewritten regions.

    B's unmatched nodes form components (joined through values without a counterpart). Each
    unmatched A node joins the B component whose paired output values it feeds (through unmatched
    A nodes, stopping at paired values). A nodes feeding several components (e.g. a mask
    computation shared by every fused attention) form their own region, which records the regions
    it fed in ``shared_by``; A nodes feeding none are grouped among themselves (removed).
    """
    a_idx = {id(n): i for i, n in enumerate(m.a_nodes)}
    b_idx = {id(n): i for i, n in enumerate(m.b_nodes)}
    matched_a = set(m.node_b2a.values())
    a_un = [i for i in range(len(m.a_nodes)) if i not in matched_a]
    b_un = [j for j in range(len(m.b_nodes)) if j not in m.node_b2a]
    a_un_set, b_un_set = set(a_un), set(b_un)
    a2b_val = {va: vb for vb, va in m.value_b2a.items()}

    # 1. components of B's unmatched nodes. A new helper fed only by paired values and used by
    # several new nodes (e.g. one mask Cast shared by every fused Attention) does not glue their
    # components together: it becomes a shared region of its own (step 3).
    def _b_users(j: int) -> set[int]:
        return {b_idx[id(u)] for v in m.b_nodes[j].outputs for u, _ in v.uses() if b_idx.get(id(u)) in b_un_set}

    def _fed_by_paired(j: int) -> bool:
        return all(v is None or v in m.value_b2a or v.producer() is None
                   or b_idx.get(id(v.producer())) not in b_un_set for v in m.b_nodes[j].inputs)

    b_shared = {j for j in b_un if _fed_by_paired(j) and len(_b_users(j)) >= 2}
    uf_b = _UnionFind()
    for j in b_un:
        uf_b.find(j)
        if j in b_shared:
            continue
        for v in m.b_nodes[j].outputs:
            if v in m.value_b2a:
                continue  # a paired value cuts the graph
            for user, _ in v.uses():
                k = b_idx.get(id(user))
                if k in b_un_set and k not in b_shared:
                    uf_b.union(j, k)
    comp_of_b = {j: uf_b.find(j) for j in b_un}
    shared_fed = {j: frozenset(comp_of_b[k] for k in _b_users(j) if k not in b_shared) for j in b_shared}

    # 2. which B components each unmatched A node feeds (reverse topological order)
    reach: dict[int, frozenset] = {}
    for i in reversed(a_un):
        acc: set = set()
        for v in m.a_nodes[i].outputs:
            if v in a2b_val:
                p = a2b_val[v].producer()
                if p is not None and b_idx.get(id(p)) in b_un_set:
                    acc.add(comp_of_b[b_idx[id(p)]])
                continue
            for user, _ in v.uses():
                k = a_idx.get(id(user))
                if k in a_un_set:
                    acc |= reach.get(k, frozenset())
        reach[i] = frozenset(acc)

    # 3. group: single-component A nodes join it; shared and orphan A nodes group by connectivity
    uf = _UnionFind()
    for j in b_un:
        uf.find(("b", comp_of_b[j]))
        if j in b_shared and len(shared_fed[j]) >= 2:
            uf.union(("shared", shared_fed[j]), ("b", comp_of_b[j]))
        elif j in b_shared and shared_fed[j]:
            uf.union(("b", next(iter(shared_fed[j]))), ("b", comp_of_b[j]))
    for i in a_un:
        if len(reach[i]) == 1:
            uf.union(("b", next(iter(reach[i]))), ("a", i))
        elif reach[i]:
            uf.union(("shared", reach[i]), ("a", i))  # one region per set of fed components
        else:
            uf.find(("a", i))
    for i in a_un:
        if len(reach[i]) == 1:
            continue
        for v in m.a_nodes[i].outputs:
            if v in a2b_val:
                continue
            for user, _ in v.uses():
                k = a_idx.get(id(user))
                if k in a_un_set and len(reach[k]) != 1 and (len(reach[k]) == 0) == (len(reach[i]) == 0):
                    uf.union(("a", i), ("a", k))
    members: dict = collections.defaultdict(lambda: ([], []))
    for i in a_un:
        members[uf.find(("a", i))][0].append(i)
    for j in b_un:
        members[uf.find(("b", comp_of_b[j]))][1].append(j)

    regions = []
    root_of_comp = {}
    for root, (an, bn) in members.items():
        an.sort()
        bn.sort()
        a_ops = collections.Counter(op_key(m.a_nodes[i]) for i in an)
        b_ops = collections.Counter(op_key(m.b_nodes[j]) for j in bn)
        passes = collections.Counter(p for j in bn if (p := pass_of(m.b_nodes[j])))
        ins, outs = _boundary(m, an, bn, a2b_val)
        r = Region(0, [f"a{i}" for i in an], [f"b{j}" for j in bn], dict(a_ops), dict(b_ops), dict(passes), ins, outs)
        r._root = root  # type: ignore[attr-defined]
        regions.append(r)
        for j in bn:
            root_of_comp[comp_of_b[j]] = r
    regions.sort(key=lambda r: min([int(x[1:]) for x in r.a_nodes] or [10**9]) * 1.0
                 + min([int(x[1:]) for x in r.b_nodes] or [0]) * 1e-9)
    for k, r in enumerate(regions):
        r.id = k
    for r in regions:
        if not r.a_nodes and not r.b_nodes:
            continue
        b_in = [int(x[1:]) for x in r.b_nodes]
        if any(j not in b_shared for j in b_in):
            continue  # a region with its own new nodes is not a shared helper
        fed = set().union(*(reach[int(x[1:])] for x in r.a_nodes), *(shared_fed[j] for j in b_in))
        if fed:
            targets = sorted({root_of_comp[c].id for c in fed if c in root_of_comp})
            r.shared_by = targets
            for t in targets:
                for p in regions[t].passes:
                    r.passes.setdefault(p, 0)
    return regions


def _boundary(m: Matching, an: list[int], bn: list[int], a2b_val) -> tuple[list[str], list[str]]:
    inside_a = {id(m.a_nodes[i]) for i in an}
    inside_b = {id(m.b_nodes[j]) for j in bn}
    ins: list[str] = []
    outs: list[str] = []

    def add(lst: list[str], name: str | None) -> None:
        if name and name not in lst:
            lst.append(name)

    for nodes, inside, is_a in ((an and [m.a_nodes[i] for i in an], inside_a, True),
                                (bn and [m.b_nodes[j] for j in bn], inside_b, False)):
        for n in nodes or []:
            for v in n.inputs:
                if v is None or v.is_initializer() or v.const_value is not None:
                    continue
                p = v.producer()
                if p is None or id(p) not in inside:
                    name = v.name if is_a else (m.value_b2a[v].name if v in m.value_b2a else v.name)
                    add(ins, name)
            for v in n.outputs:
                if v.is_graph_output() or any(id(u) not in inside for u, _ in v.uses()):
                    name = v.name if is_a else (m.value_b2a[v].name if v in m.value_b2a else v.name)
                    add(outs, name)
    return ins, outs


# ---------------------------------------------------------------- summaries


def initializer_stats(graph: ir.Graph) -> dict:
    """Count, bytes, parameters, dtype histogram and sparsity (zero fraction) of the initializers."""
    count = nbytes = params = zeros = 0
    dtypes: collections.Counter = collections.Counter()
    for v in graph.initializers.values():
        t = v.const_value
        if t is None:
            continue
        count += 1
        nbytes += t.nbytes
        n = int(np.prod(t.shape)) if len(t.shape) else 1
        dtypes[str(t.dtype.name if hasattr(t.dtype, "name") else t.dtype)] += 1
        if t.dtype.is_floating_point():
            params += n
            try:
                zeros += n - int(np.count_nonzero(t.numpy()))
            except Exception:  # noqa: BLE001
                pass
    return {"count": count, "bytes": nbytes, "params": params, "dtypes": dict(sorted(dtypes.items())),
            "sparsity": (zeros / params) if params else 0.0}


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
            out.append(_body_entry(f"a{i}", na, f"b{j}" if j is not None else None, bodies_a, bodies_b))
    matched_b = set(m.node_b2a)
    for j, nb in enumerate(m.b_nodes):
        if j not in matched_b and (bodies_b := _bodies(nb)):
            out.append(_body_entry(None, nb, f"b{j}", {}, bodies_b))
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


def _body_entry(a_id, node, b_id, bodies_a, bodies_b) -> dict:
    entry = {"a": a_id, "b": b_id, "op": op_key(node), "name": node.name, "bodies": []}
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
