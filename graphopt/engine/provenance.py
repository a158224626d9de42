"""Node provenance: which passes made a node, and which of its output names continue the input model's.

The pipeline writes three node metadata keys on every node a pass creates:

- ``graphopt.pass`` (:data:`graphopt.PASS_TAG`): the pass that created the construct, the first of the
  chain. ``graphopt diff`` credits it.
- ``graphopt.chain`` (:data:`CHAIN_TAG`): the passes that made and then rebuilt it, oldest first,
  comma-separated: ``"fuse,remove-padding"`` for a BiasGelu that ``fuse`` made and ``remove-padding``
  re-emitted on packed tokens.
- ``graphopt.kept`` (:data:`KEPT_TAG`): the node's output names that continue a value of the model the
  pipeline started from: a rewrite that replaced a value and kept its name (onnxscript's rewriter does).
  Any other output name of a tagged node is new: if it equals a name in an older model it is a
  coincidence (onnx-ir names new values ``val_<n>`` and reuses names freed by an earlier pass), and the
  diff does not pair values by it.

How a rebuilt node gets its history, most robust first:

1. The pass says so: ``inherit(new_node, old_node)`` when it re-emits ``old_node`` (remove-padding's
   packed twins and packed attention do).
2. The pipeline infers it: a new node of the same op (domain and type) as the node that produced one of
   its output names before the pass, which the pass removed, inherits that node's chain (a rule that
   rebuilds a fused op in place and keeps its output name).

Otherwise the node is new: its chain is the pass alone.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from graphopt import PASS_TAG
from graphopt.opsets import node_domain

__all__ = ["CHAIN_TAG", "KEPT_TAG", "Snapshot", "chain_of", "format_chain", "inherit", "kept_names", "record",
           "snapshot"]

CHAIN_TAG = "graphopt.chain"
KEPT_TAG = "graphopt.kept"
_SEP = ","


def _split(text: str | None) -> list[str]:
    return [p for p in (text or "").split(_SEP) if p]


def chain_of(node: ir.Node) -> list[str]:
    """The passes that made and rebuilt ``node``, oldest first (``[]`` for a node of the input model).

    A node tagged only with ``graphopt.pass`` (older graphopt, or a test) has that one-pass chain.
    """
    chain = _split(node.metadata_props.get(CHAIN_TAG))
    if chain:
        return chain
    tag = node.metadata_props.get(PASS_TAG)
    return [tag] if tag else []


def kept_names(node: ir.Node) -> set[str] | None:
    """Output names of ``node`` that continue values of the input model; None when unknown.

    Unknown: the node carries no chain (an input-model node, whose names are all its own, or a node
    tagged by something other than the pipeline).
    """
    if CHAIN_TAG not in node.metadata_props:
        return None
    return set(_split(node.metadata_props.get(KEPT_TAG)))


def format_chain(chain: list[str]) -> str:
    """``["fuse", "remove-padding"]`` -> ``"fuse → remove-padding"``."""
    return " → ".join(chain)


def inherit(new: ir.Node, old: ir.Node) -> None:
    """Mark ``new`` as a rebuild of ``old``: it takes ``old``'s chain; the pipeline then appends the pass.

    For passes that re-emit a node (a copy on new inputs, a packed form). Call it before the pass
    returns; nodes of the input model have an empty chain, so inheriting from one changes nothing.
    """
    chain = chain_of(old)
    if chain:
        new.metadata_props[CHAIN_TAG] = _SEP.join(chain)


@dataclasses.dataclass
class Snapshot:
    """The nodes of a model before a pass, and who produced each value name (see :func:`snapshot`)."""

    nodes: dict[int, ir.Node]  # id -> node (kept alive, so a removed node can still be read)
    producers: dict[str, ir.Node]  # value name -> producing node

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.nodes


def _all_nodes(model: ir.Model) -> list[ir.Node]:
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for f in model.functions.values():
        nodes.extend(f)
    return nodes


def snapshot(model: ir.Model) -> Snapshot:
    """Record ``model``'s nodes and value producers before a pass runs on it."""
    nodes = _all_nodes(model)
    producers = {v.name: n for n in nodes for v in n.outputs if v.name}
    return Snapshot({id(n): n for n in nodes}, producers)


def _continues(name: str, old: ir.Node) -> bool:
    """Whether value ``name`` of node ``old`` continues the input model (not a reused name)."""
    kept = kept_names(old)
    return kept is None or name in kept


def record(model: ir.Model, before: Snapshot, pass_name: str) -> int:
    """Write the provenance of the nodes ``pass_name`` created in ``model``; returns how many.

    A node whose chain a pass set with :func:`inherit` gets ``pass_name`` appended; a node that
    replaced a removed node of the same op under its output name inherits that node's chain; any other
    new node's chain is ``pass_name`` alone. A pass repeating itself is not repeated in the chain.
    """
    present = {id(n) for n in _all_nodes(model)}
    n_new = 0
    for node in _all_nodes(model):
        if id(node) in before:
            continue
        n_new += 1
        chain = _split(node.metadata_props.get(CHAIN_TAG))
        kept: list[str] = []
        for v in node.outputs:
            old = before.producers.get(v.name) if v.name else None
            if old is None or old is node:
                continue
            if _continues(v.name, old):
                kept.append(v.name)
            if not chain and id(old) not in present and (node_domain(old), old.op_type) == (node_domain(node), node.op_type):
                chain = chain_of(old)
        if not chain or chain[-1] != pass_name:
            chain.append(pass_name)
        node.metadata_props[PASS_TAG] = chain[0]
        node.metadata_props[CHAIN_TAG] = _SEP.join(chain)
        if kept:
            node.metadata_props[KEPT_TAG] = _SEP.join(kept)
        else:
            node.metadata_props.pop(KEPT_TAG, None)
    return n_new
