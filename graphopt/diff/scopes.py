"""Name scopes of nodes (module paths such as ``encoder.layer.0.attention``), for grouping a graph.

The torch exporters record where each node came from: the dynamo exporter in the
``pkg.torch.onnx.name_scopes`` metadata (a Python list literal of dotted module paths, the last
being the FX node), the TorchScript exporter in the node name (``/encoder/layer.0/attention/MatMul``).
``node_scope`` returns the enclosing scopes, outermost first, each as its full path.

Nodes a graphopt pass created carry no such record; ``inherit_scopes`` gives them the scope of the
A node they are paired with, else of their consumers: a node of the preamble (no paired node
among its ancestors, like a mask shared by every layer) gets the scope its consumers share; any other node the scope of its first consumer (a helper belongs where its result
is first used, which keeps the groups in data-flow order, without cycles between layers), else of their last producer; where that is shallower than the
scope the A nodes of its rewrite region share, it takes the region's.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
#: scope entries that say "no module" (torch's placeholder for nodes outside any nn.Module)
_NO_MODULE = ("_empty_nn_module_stack",)


def node_scope(node: ir.Node) -> list[str]:
    """The scopes enclosing ``node``, outermost first, as full paths; [] when none is recorded."""
    raw = node.metadata_props.get(NAME_SCOPES)
    if raw:
        try:
            scopes = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            scopes = None
        if isinstance(scopes, list) and all(isinstance(s, str) for s in scopes):
            return [s for s in scopes if s and not s.startswith(_NO_MODULE)]
    name = node.name or ""
    if name.startswith("/") and name.count("/") >= 2:
        parts = name.split("/")[1:-1]  # the last part names the node itself
        return ["/".join(parts[: k + 1]) for k in range(len(parts)) if parts[k]]
    return []


def common_prefix(scopes: Sequence[Sequence[str]]) -> list[str]:
    """The leading scopes all of ``scopes`` share."""
    out: list[str] = []
    for level in zip(*scopes):
        if any(s != level[0] for s in level):
            break
        out.append(level[0])
    return out


def inherit_scopes(graphs: dict[str, list[dict[str, Any]]], regions: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Scope of every node record of both graphs, by id; B nodes without one inherit it (module doc)."""
    scope: dict[str, list[str]] = {}
    for side in ("a", "b"):
        for r in graphs[side]:
            scope[r["id"]] = list(r.get("scope") or [])
    for r in graphs["b"]:
        if not scope[r["id"]] and r.get("match") and scope.get(r["match"]):
            scope[r["id"]] = list(scope[r["match"]])
    b = graphs["b"]
    by_region = {g["id"]: g for g in regions}
    weak: dict[int, list[str]] = {}  # the scopes the A nodes of a B node's region share
    for k, r in enumerate(b):
        g = by_region.get(r.get("region"))
        if not scope[r["id"]] and g is not None:
            a_scopes = [scope[i] for i in g["a_nodes"] if scope.get(i)]
            weak[k] = common_prefix(a_scopes) if a_scopes else []

    def settle(k: int, found: list[str]) -> list[str]:
        # the region's shared scope only where it extends the propagated one: moving nodes
        # into an unrelated scope makes groups feed each other both ways
        w = weak.get(k, [])
        return list(w) if w[: len(found)] == found and len(w) > len(found) else list(found)

    producer = {o: k for k, r in enumerate(b) for o in r["outputs"] if o}
    consumers: dict[int, list[int]] = {k: [] for k in range(len(b))}
    for k, r in enumerate(b):
        for v in r["inputs"]:
            if v in producer:
                consumers[producer[v]].append(k)
    # the preamble: nodes with no paired node among their ancestors (the mask and index helpers
    # computed from the inputs before the first paired node of the main path)
    pre: set[int] = set()
    for k, r in enumerate(b):
        if all(producer.get(v) is None or (producer[v] in pre and not b[producer[v]].get("match"))
               for v in r["inputs"] if v):
            pre.add(k)
    known = {k for k, r in enumerate(b) if scope[r["id"]]}
    strict = True  # a preamble node waits for all its consumers (their shared scope)
    for _ in range(2 * len(b) + 2):
        changed = False
        for k in reversed(range(len(b))):  # consumers come later in graph order
            if k in known:
                continue
            near = [c for c in consumers[k] if c in known]
            if not near or (strict and k in pre and len(near) < len(consumers[k])):
                continue
            found = common_prefix([scope[b[c]["id"]] for c in near]) if k in pre else scope[b[min(near)]["id"]]
            scope[b[k]["id"]] = settle(k, found)
            known.add(k)
            changed = True
        for k, r in enumerate(b):
            if k in known or (strict and consumers[k]):
                continue
            near = [p for v in r["inputs"] if (p := producer.get(v)) is not None and p in known]
            if near:
                scope[r["id"]] = settle(k, scope[b[max(near)]["id"]])
                known.add(k)
                changed = True
        if not changed:
            if not strict:
                break
            strict = False
    for k, r in enumerate(b):
        if k not in known and weak.get(k):
            scope[r["id"]] = list(weak[k])
    # a new preamble node feeding several scopes belongs to the scope they share, even when its
    # rewrite region says deeper (else a layer would feed the helpers of an earlier layer)
    for k in reversed(sorted(pre)):
        if len(consumers[k]) >= 2 and not b[k].get("match") and not b[k].get("scope"):
            scope[b[k]["id"]] = common_prefix([scope[b[k]["id"]]] + [scope[b[c]["id"]] for c in consumers[k]])
    return scope
