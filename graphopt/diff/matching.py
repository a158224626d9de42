"""Node and value matching of two ONNX graphs, and the typed node ids the diff uses.

Matching (main graph; subgraph bodies are compared by op histogram):

1. Values are seeded: graph inputs by name; initializers by name when dtype and shape agree
   (content may differ: reported as a changed initializer), else by content hash (renamed).
2. B's nodes are visited in topological order. A B node matches an unmatched A node with the same
   domain, op type and attributes whose inputs are the matched counterparts of B's inputs
   (inputs not yet matched act as wildcards against unmatched A values); among several candidates
   the one with the same name wins, then the one with the same output names. Failing that, an A
   node with the same name, op type and provenance chain is matched as *modified*. A match pairs the
   outputs, and the wildcard inputs it bridged (a rewritten region's output feeding an unchanged node).
   A pair whose B node a pass rebuilt since A (its chain is longer) is *modified*: "rebuilt by ...".
3. Unmatched values with equal names are paired too: rewriters keep the names of the values they
   replace, so a fused node's output lines up with the end of the subgraph it replaced. A name is
   evidence only where it was kept: a node a graphopt pass created lists the output names that
   continue the input model (``graphopt.kept``, see :mod:`graphopt.engine.provenance`); its other output
   names are new, and equal to an A name only by coincidence (onnx-ir reuses freed ``val_<n>``
   names). Values whose dtypes are known and differ never pair.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
from typing import NamedTuple

import onnx_ir as ir

from graphopt.diff import quantized
from graphopt.engine import provenance
from graphopt.opsets import node_domain, op_key


class Side(enum.Enum):
    """Which model of the diff a node belongs to: A (before) or B (after)."""

    A = "a"
    B = "b"


class NodeId(NamedTuple):
    """A node of the main graph of A or B: its side and its index in graph order.

    ``str(NodeId(Side.A, 12))`` is ``"a12"``, the id written in the JSON report.
    """

    side: Side
    index: int

    def __str__(self) -> str:
        return f"{self.side.value}{self.index}"


def a_id(index: int) -> NodeId:
    return NodeId(Side.A, index)


def b_id(index: int) -> NodeId:
    return NodeId(Side.B, index)


# ---------------------------------------------------------------- hashing


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
        h.update(attr_hash(node).encode())
        h.update(str(len(node.inputs)).encode())
    for v in graph.initializers.values():
        if v.const_value is not None:
            h.update(tensor_hash(v.const_value).encode())
    return h.hexdigest()


def attr_value_repr(attr) -> str:
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


def attr_hash(node: ir.Node) -> str:
    parts = [f"{k}={attr_value_repr(a)}" for k, a in sorted(node.attributes.items())]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def pass_of(node: ir.Node) -> str | None:
    """The pass that created ``node``'s construct (the first of its provenance chain), or None."""
    chain = provenance.chain_of(node)
    return chain[0] if chain else None


def rebuilt_since(na: ir.Node, nb: ir.Node) -> list[str]:
    """The passes that rebuilt ``nb`` after ``na`` was made: the part of B's chain not in A's, or []."""
    ca, cb = provenance.chain_of(na), provenance.chain_of(nb)
    if ca == cb:
        return []
    return cb[len(ca):] if cb[: len(ca)] == ca else cb


def _name_evidence(va: ir.Value, vb: ir.Value) -> bool:
    """Whether B value ``vb`` having A value ``va``'s name says they are the same tensor."""
    if va.dtype is not None and vb.dtype is not None and va.dtype != vb.dtype:
        return False
    p = vb.producer()
    kept = provenance.kept_names(p) if p is not None else None
    return kept is None or vb.name in kept


# ---------------------------------------------------------------- the matching


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

    def nodes(self, side: Side) -> list[ir.Node]:
        return self.a_nodes if side is Side.A else self.b_nodes

    def node(self, nid: NodeId) -> ir.Node:
        return self.nodes(nid.side)[nid.index]

    def pairs(self) -> list[tuple[NodeId, NodeId]]:
        """Matched (A id, B id) pairs, in B order."""
        return [(a_id(i), b_id(j)) for j, i in sorted(self.node_b2a.items())]

    def unmatched(self, side: Side) -> list[int]:
        """Indices of the nodes of ``side`` with no counterpart, in graph order."""
        if side is Side.A:
            matched = set(self.node_b2a.values())
            return [i for i in range(len(self.a_nodes)) if i not in matched]
        return [j for j in range(len(self.b_nodes)) if j not in self.node_b2a]


_WILD = object()


def _match_values_seed(ga: ir.Graph, gb: ir.Graph) -> tuple[dict[ir.Value, ir.Value], dict[str, str]]:
    b2a: dict[ir.Value, ir.Value] = {}
    changed: dict[str, str] = {}
    a_in = {v.name: v for v in ga.inputs}
    for v in gb.inputs:
        if v.name in a_in and v.name not in gb.initializers:
            b2a[v] = a_in[v.name]
    ia, ib = dict(ga.initializers), dict(gb.initializers)
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
    b2a, init_changed = _match_values_seed(ga, gb)
    a_mapped: set[ir.Value] = set(b2a.values())

    a_by_name: dict[str, list[int]] = collections.defaultdict(list)
    a_by_sig: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, n in enumerate(a_nodes):
        if n.name:
            a_by_name[n.name].append(i)
        a_by_sig[(node_domain(n), n.op_type, attr_hash(n), len(n.inputs))].append(i)
    a_matched: set[int] = set()
    q_pairs = quantized.pair_quantized(a_nodes, b_nodes)
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
        sig = (node_domain(nb), nb.op_type, attr_hash(nb), len(nb.inputs))
        cands = [i for i in a_by_sig.get(sig, ()) if i not in a_matched and _inputs_fit(a_nodes[i], ins, a_mapped)]
        n_known = sum(1 for x in ins if x is not None and x is not _WILD)
        if cands and n_known == 0 and len(nb.inputs) > 0:
            # all inputs unknown: accept only a name or output-name match
            cands = [i for i in cands if _same_names(a_nodes[i], nb)]
        choice: int | None = None
        q = q_pairs.get(j)
        via_q = q is not None and q not in a_matched
        if via_q:
            choice = q
            node_b2a[j] = q
            modified[j] = quantized.describe(a_nodes[q], nb)
        elif cands:
            choice = max(cands, key=lambda i: (_node_names_equal(a_nodes[i], nb),
                                                _out_names_equal(a_nodes[i], nb), -abs(i - j)))
            node_b2a[j] = choice
        elif nb.name:
            for i in a_by_name.get(nb.name, ()):
                na = a_nodes[i]
                if (i not in a_matched and node_domain(na) == node_domain(nb) and na.op_type == nb.op_type
                        and provenance.chain_of(na) == provenance.chain_of(nb)):
                    choice = i
                    node_b2a[j] = i
                    modified[j] = _differences(na, nb, b2a)
                    break
        if choice is None:
            continue
        a_matched.add(choice)
        na = a_nodes[choice]
        rebuilt = rebuilt_since(na, nb)
        if rebuilt:
            modified.setdefault(j, []).insert(0, f"rebuilt by {provenance.format_chain(rebuilt)}")
        for vb, va in quantized.input_pairs(na, nb) if via_q else zip(nb.inputs, na.inputs, strict=False):
            if vb is not None and va is not None and vb not in b2a and va not in a_mapped:
                pair_value(vb, va)
        for vb, va in quantized.result_pairs(na, nb) if via_q else zip(nb.outputs, na.outputs, strict=False):
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
                if va not in a_mapped and _name_evidence(va, vb):
                    pair_value(vb, va)
    return Matching(a_nodes, b_nodes, node_b2a, modified, b2a, init_changed)


def _inputs_fit(na: ir.Node, wanted: list, a_mapped: set[ir.Value]) -> bool:
    """Whether A node ``na``'s inputs are the ``wanted`` ones (None, a paired A value, or a wildcard)."""
    for va, want in zip(na.inputs, wanted, strict=False):
        if want is None:
            ok = va is None
        elif want is _WILD:
            ok = va is not None and va not in a_mapped
        else:
            ok = va is want
        if not ok:
            return False
    return True


def _same_names(na: ir.Node, nb: ir.Node) -> bool:
    return _node_names_equal(na, nb) or _out_names_equal(na, nb)


def _node_names_equal(na: ir.Node, nb: ir.Node) -> bool:
    """Equal node names, as evidence: not for a node a pass made since A (its name is new)."""
    return bool(nb.name) and na.name == nb.name and provenance.chain_of(na) == provenance.chain_of(nb)


def _out_names_equal(na: ir.Node, nb: ir.Node) -> bool:
    """Equal output names, as evidence: only names B's node kept (see ``_name_evidence``)."""
    if not nb.outputs or [v.name for v in na.outputs] != [v.name for v in nb.outputs]:
        return False
    kept = provenance.kept_names(nb)
    return kept is None or all(v.name in kept for v in nb.outputs)


def _differences(na: ir.Node, nb: ir.Node, b2a: dict) -> list[str]:
    out = []
    ka, kb = set(na.attributes), set(nb.attributes)
    for k in sorted(ka | kb):
        if k not in ka:
            out.append(f"attribute {k} added")
        elif k not in kb:
            out.append(f"attribute {k} removed")
        elif attr_value_repr(na.attributes[k]) != attr_value_repr(nb.attributes[k]):
            out.append(f"attribute {k} changed")
    if len(na.inputs) != len(nb.inputs):
        out.append(f"{len(na.inputs)} inputs became {len(nb.inputs)}")
    else:
        for k, (va, vb) in enumerate(zip(na.inputs, nb.inputs, strict=False)):
            if (va is None) != (vb is None) or (vb is not None and b2a.get(vb) is not va):
                out.append(f"input {k} changed")
    return out or ["name-matched"]
