"""Rewritten regions: the unmatched nodes of A and B, grouped by what replaced what.

B's unmatched nodes form components (joined through values without a counterpart). Each unmatched
A node joins the B component whose paired output values it feeds (through unmatched A nodes,
stopping at paired values): "these 14 nodes became this LayerNormalization". A nodes feeding several
components (e.g. a mask computation shared by every fused attention) form their own region, which
records the regions it fed in ``shared_by``; A nodes feeding none are grouped among themselves
(removed; where a matched B node produces their result, they were folded into it, and the region
credits the pass that made that node).

Credit: each B node carries its provenance chain (:mod:`graphopt.engine.provenance`: the passes that made
and then rebuilt it). The part of the chain A already had (the longest chain of the region's A nodes
that starts B's) is history; the region credits the first pass of the rest, the one that created the
construct between A and B, and the summary names the passes that rebuilt it afterwards: "2 nodes
(Add, Gelu) became BiasGelu by fuse, rebuilt by remove-padding".
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable

import onnx_ir as ir

from graphopt.diff.matching import Matching, NodeId, Side, a_id, b_id
from graphopt.engine import provenance
from graphopt.opsets import op_key


def plural(n: int, word: str) -> str:
    """``plural(1, "node")`` -> ``"1 node"``, ``plural(3, "node")`` -> ``"3 nodes"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _short(op: str) -> str:
    """An op key without its domain, for prose (``com.microsoft::BiasGelu`` -> ``BiasGelu``)."""
    return op.rpartition("::")[2]


@dataclasses.dataclass
class Region:
    """A connected set of unmatched A nodes and the unmatched B nodes that replaced them."""

    id: int
    a_nodes: list[NodeId]
    b_nodes: list[NodeId]
    a_ops: dict[str, int]
    b_ops: dict[str, int]
    passes: dict[str, int]  # pass name -> number of B nodes it is credited with (created the construct)
    inputs: list[str]  # boundary values (A names) the region reads
    outputs: list[str]  # boundary values (A names, else B names) the region produces
    shared_by: list[int] = dataclasses.field(default_factory=list)  # regions a shared helper region fed
    chains: dict[str, int] = dataclasses.field(default_factory=dict)  # "fuse → remove-padding" -> B nodes

    @property
    def kind(self) -> str:
        if self.a_nodes and self.b_nodes:
            return "rewritten"
        return "removed" if self.a_nodes else "added"

    def summary(self) -> str:
        """One line a person reads: "9 nodes (Add×2, ...) became LayerNormalization by fuse"."""
        def ops(d: dict[str, int]) -> str:
            return ", ".join(f"{_short(k)}×{n}" if n > 1 else _short(k)
                             for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))

        def nodes(n: int, d: dict[str, int]) -> str:
            return f"{plural(n, 'node')} ({ops(d)})"

        fed = ""
        if self.shared_by:
            fed = f", shared by {'region' if len(self.shared_by) == 1 else 'regions'} {', '.join(map(str, self.shared_by))}"
        by = self._by()
        if self.kind == "rewritten":
            made = ops(self.b_ops) if len(self.b_nodes) == 1 else nodes(len(self.b_nodes), self.b_ops)
            return f"{nodes(len(self.a_nodes), self.a_ops)} became {made}{fed}{by}"
        if self.kind == "removed":
            return f"{plural(len(self.a_nodes), 'node')} removed ({ops(self.a_ops)}){fed}{by}"
        return f"{plural(len(self.b_nodes), 'node')} added ({ops(self.b_ops)}){fed}{by}"

    def _by(self) -> str:
        """" by fuse, rebuilt by remove-padding": the credited passes, each with the passes that rebuilt
        its nodes ("by fuse (rebuilt by remove-padding) and remove-padding" when several), in pipeline
        order. A shared region with no new node names the passes of the regions it feeds."""
        credited = [p for p, n in self.passes.items() if n > 0] or list(self.passes)
        if not credited:
            return ""
        chains = [c.split(" → ") for c in self.chains]
        order = {p: max((c.index(p) for c in chains if p in c), default=0) for p in credited}
        credited.sort(key=lambda p: (order[p], -self.passes[p], p))
        rebuilt = {p: [] for p in credited}
        for c in chains:
            for q in c[1:]:
                if c[0] in rebuilt and q not in rebuilt[c[0]]:
                    rebuilt[c[0]].append(q)
        if len(credited) == 1:
            p = credited[0]
            return f" by {p}" + (f", rebuilt by {' and '.join(rebuilt[p])}" if rebuilt[p] else "")
        return " by " + " and ".join(p + (f" (rebuilt by {', '.join(rebuilt[p])})" if rebuilt[p] else "")
                                     for p in credited)

    def _order(self) -> tuple[int, int]:
        """Regions are listed by their first A node, then their first B node."""
        return (min((n.index for n in self.a_nodes), default=10**9), min((n.index for n in self.b_nodes), default=0))

    def as_dict(self) -> dict:
        """The JSON form (docs/diff-json-schema.md): node ids as ``"a12"`` / ``"b7"``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["a_nodes"] = [str(n) for n in self.a_nodes]
        d["b_nodes"] = [str(n) for n in self.b_nodes]
        d["kind"] = self.kind
        d["summary"] = self.summary()
        return d


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Hashable, Hashable] = {}

    def find(self, x: Hashable) -> Hashable:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, x: Hashable, y: Hashable) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            self.parent[ry] = rx


def _shared(fed: frozenset[int]) -> tuple[str, frozenset[int]]:
    """Union-find key of the shared region feeding the B components ``fed``."""
    return ("shared", fed)


def find_regions(m: Matching) -> list[Region]:
    """Group the unmatched nodes of both graphs into rewritten regions (see the module docstring).

    Union-find keys: ``a_id(i)`` for an unmatched A node, ``b_id(c)`` for the B component rooted
    at B node ``c``, ``_shared(components)`` for the helper region feeding several components.
    """
    a_idx = {id(n): i for i, n in enumerate(m.a_nodes)}
    b_idx = {id(n): i for i, n in enumerate(m.b_nodes)}
    a_un, b_un = m.unmatched(Side.A), m.unmatched(Side.B)
    a_un_set, b_un_set = set(a_un), set(b_un)
    a2b_val = {va: vb for vb, va in m.value_b2a.items()}

    # 1. components of B's unmatched nodes. Helpers do not glue the components they feed together:
    # a new node fed only by paired values and used by several new nodes (one mask Cast shared by
    # every fused Attention), and the index a pass computes from the graph inputs alone (the
    # packing index of remove-padding, read by every layer). Helpers that feed one component join
    # it; helpers feeding several become a shared region of their own (step 3).
    def b_users(j: int, *, unpaired: bool = False) -> set[int]:
        return {b_idx[id(u)] for v in m.b_nodes[j].outputs if not (unpaired and v in m.value_b2a)
                for u, _ in v.uses() if b_idx.get(id(u)) in b_un_set}

    def fed_by_paired(j: int) -> bool:
        return all(v is None or v in m.value_b2a or v.producer() is None
                   or b_idx.get(id(v.producer())) not in b_un_set for v in m.b_nodes[j].inputs)

    hub = _input_helpers(m, b_un, b_idx)
    b_shared = hub | {j for j in b_un if fed_by_paired(j) and len(b_users(j)) >= 2}
    uf_b = _UnionFind()
    for j in b_un:
        uf_b.find(j)
        if j in b_shared and j not in hub:
            continue
        for v in m.b_nodes[j].outputs:
            if v in m.value_b2a:
                continue  # a paired value cuts the graph
            for user, _ in v.uses():
                k = b_idx.get(id(user))
                if k in b_un_set and (k in hub if j in hub else k not in b_shared):
                    uf_b.union(j, k)
    comp0 = {j: uf_b.find(j) for j in b_un}
    fed0: dict[int, set[int]] = collections.defaultdict(set)
    for j in b_shared:
        fed0[comp0[j]] |= {comp0[k] for k in b_users(j, unpaired=j in hub) if k not in b_shared}
    joined = {j for j in hub if len(fed0[comp0[j]]) == 1}  # an input index read by one component is part of it
    for j in joined:
        uf_b.union(next(iter(fed0[comp0[j]])), j)
    b_shared -= joined
    comp_of_b: dict[int, int] = {j: uf_b.find(j) for j in b_un}
    shared_fed = {j: frozenset(uf_b.find(c) for c in fed0[comp0[j]]) for j in b_shared}

    # 2. which B components each unmatched A node feeds (reverse topological order)
    reach: dict[int, frozenset[int]] = {}
    for i in reversed(a_un):
        acc: set[int] = set()
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
        comp = b_id(comp_of_b[j])
        uf.find(comp)
        if j in b_shared and len(shared_fed[j]) >= 2:
            if m.b_nodes[j].op_type != "Constant":  # a constant replaced no A computation
                uf.union(_shared(shared_fed[j]), comp)
        elif j in b_shared and shared_fed[j]:
            uf.union(b_id(next(iter(shared_fed[j]))), comp)
    for i in a_un:
        if len(reach[i]) == 1:
            uf.union(b_id(next(iter(reach[i]))), a_id(i))
        elif reach[i]:
            uf.union(_shared(reach[i]), a_id(i))  # one region per set of fed components
        else:
            uf.find(a_id(i))
    for i in a_un:
        if len(reach[i]) == 1:
            continue
        for v in m.a_nodes[i].outputs:
            if v in a2b_val:
                continue
            for user, _ in v.uses():
                k = a_idx.get(id(user))
                if k in a_un_set and len(reach[k]) != 1 and (len(reach[k]) == 0) == (len(reach[i]) == 0):
                    uf.union(a_id(i), a_id(k))
    members: dict[Hashable, tuple[list[int], list[int]]] = collections.defaultdict(lambda: ([], []))
    for i in a_un:
        members[uf.find(a_id(i))][0].append(i)
    for j in b_un:
        members[uf.find(b_id(comp_of_b[j]))][1].append(j)

    regions: list[Region] = []
    region_of_comp: dict[int, Region] = {}
    for an, bn in members.values():
        an.sort()
        bn.sort()
        a_ops = collections.Counter(op_key(m.a_nodes[i]) for i in an)
        b_ops = collections.Counter(op_key(m.b_nodes[j]) for j in bn)
        a_chains = [c for i in an if (c := provenance.chain_of(m.a_nodes[i]))]
        since = [c for j in bn if (c := chain_since(provenance.chain_of(m.b_nodes[j]), a_chains))]
        passes = collections.Counter(c[0] for c in since)
        chains = collections.Counter(provenance.format_chain(c) for c in since)
        ins, outs = _boundary(m, an, bn)
        r = Region(0, [a_id(i) for i in an], [b_id(j) for j in bn], dict(a_ops), dict(b_ops), dict(passes), ins, outs,
                   chains=dict(chains))
        regions.append(r)
        for j in bn:
            region_of_comp[comp_of_b[j]] = r
    regions.sort(key=Region._order)
    for k, r in enumerate(regions):
        r.id = k
    for r in regions:
        b_in = [n.index for n in r.b_nodes]
        if any(j not in b_shared for j in b_in):
            continue  # a region with its own new nodes is not a shared helper
        fed = set().union(*(reach[n.index] for n in r.a_nodes), *(shared_fed[j] for j in b_in))
        if fed:
            targets = sorted({region_of_comp[c].id for c in fed if c in region_of_comp})
            r.shared_by = targets
            for t in targets:
                for p in regions[t].passes:
                    r.passes.setdefault(p, 0)
        elif not r.b_nodes:
            _credit_folded(m, r, a2b_val)
    return regions


def _credit_folded(m: Matching, r: Region, a2b_val: dict[ir.Value, ir.Value]) -> None:
    """A removed region whose result a matched B node produces was folded into that node (a bias
    ``Add`` an integer MatMul took in): credit the pass that made the node, with no node counted."""
    a_chains = [c for n in r.a_nodes if (c := provenance.chain_of(m.a_nodes[n.index]))]
    for nid in r.a_nodes:
        for v in m.a_nodes[nid.index].outputs:
            p = a2b_val[v].producer() if v in a2b_val else None
            if p is not None and (c := provenance.chain_of(p)):
                r.passes.setdefault(chain_since(c, a_chains)[0], 0)


def _input_helpers(m: Matching, b_un: list[int], b_idx: dict[int, int]) -> set[int]:
    """Unmatched B nodes computed from graph inputs and constants alone (through each other) that
    rebuild nothing (a provenance chain of at most one pass) and whose outputs continue no A value:
    an index a pass derives from the inputs, such as remove-padding's packing index from the mask."""
    out: set[int] = set()
    for j in b_un:  # graph order is topological
        node = m.b_nodes[j]
        if len(provenance.chain_of(node)) > 1 or any(v in m.value_b2a for v in node.outputs):
            continue
        ok = True
        for v in node.inputs:
            if v is None or v.is_initializer() or v.const_value is not None:
                continue
            p = v.producer()
            if p is None:
                ok = ok and v.is_graph_input()
            elif not (p.op_type == "Constant" and not p.inputs):
                ok = ok and b_idx.get(id(p)) in out
        if ok:
            out.add(j)
    return out


def chain_since(chain: list[str], a_chains: list[list[str]]) -> list[str]:
    """The part of a B node's ``chain`` made after A: without the longest A chain it starts with.

    A chain A already has in full (nothing new) keeps its last pass.
    """
    k = max((len(c) for c in a_chains if chain[: len(c)] == c), default=0)
    return chain[k:] or chain[-1:]


def _boundary(m: Matching, an: list[int], bn: list[int]) -> tuple[list[str], list[str]]:
    """Values read from outside and values used outside the region (A names where paired)."""
    ins: list[str] = []
    outs: list[str] = []

    def add(lst: list[str], name: str | None) -> None:
        if name and name not in lst:
            lst.append(name)

    def a_name(v: ir.Value, side: Side) -> str | None:
        return m.value_b2a[v].name if side is Side.B and v in m.value_b2a else v.name

    for side, idxs in ((Side.A, an), (Side.B, bn)):
        nodes = [m.nodes(side)[k] for k in idxs]
        inside = {id(n) for n in nodes}
        for n in nodes:
            for v in n.inputs:
                if v is None or v.is_initializer() or v.const_value is not None:
                    continue
                p = v.producer()
                if p is None or id(p) not in inside:
                    add(ins, a_name(v, side))
            for v in n.outputs:
                if v.is_graph_output() or any(id(u) not in inside for u, _ in v.uses()):
                    add(outs, a_name(v, side))
    return ins, outs
