"""What the HTML diff page draws: each side's nodes grouped by name scope, and the groups open at load.

Nodes are grouped hierarchically by the module scopes the exporter recorded (``graphopt.diff.scopes``:
layers, blocks, sub-modules); nodes a pass created inherit the scope of their counterpart or
neighbours, and loose ones beside sub-groups are gathered per pass. Groups are keyed by scope, so A and
B show the same groups. Only containers such as ``encoder`` start open, while the view stays small.
Constant nodes are left out. The page (``graphopt.diff.html``) embeds this as JSON and lays it out.
"""

from __future__ import annotations

from typing import Any

from graphopt.diff.result import DiffResult
from graphopt.diff.scopes import common_prefix, inherit_scopes

#: loose nodes beside sub-groups are gathered into one group per pass past this many
LOOSE_MAX = 3
#: leaf groups of at most this many nodes are dissolved into their parent
TINY_GROUP = 2
#: containers are opened at load while each side shows at most this many boxes
INITIAL_BOXES = 16


def _label(key: str, parent: str) -> str:
    for sep in (".", "/"):
        if parent and key.startswith(parent + sep):
            return key[len(parent) + 1:]
    return key.rsplit("/", 1)[-1] if key.startswith("/") else key


def _pass_label(p: Any) -> str:
    """The pass that made a node, for grouping (a provenance chain counts by its first pass)."""
    if isinstance(p, list | tuple):
        p = p[0] if p else None
    return str(p) if p else "other ops"


def _side_tree(records: list[dict[str, Any]], scope: dict[str, list[str]], strip: int) -> dict[str, dict]:
    """Groups of one side by key ("" is the root): label, parent, child groups, own node indices."""
    groups: dict[str, dict] = {"": {"label": "", "parent": None, "groups": [], "nodes": []}}

    def group(key: str, parent: str) -> None:
        if key not in groups:
            groups[key] = {"label": _label(key, parent), "parent": parent, "groups": [], "nodes": []}
            groups[parent]["groups"].append(key)

    for i, r in enumerate(records):
        if r["op"] == "Constant":
            continue
        parent = ""
        for key in scope[r["id"]][strip:]:
            group(key, parent)
            parent = key
        groups[parent]["nodes"].append(i)
    # a group with a single child is that child; a leaf group of two nodes (one decomposed op,
    # like a Shape+Squeeze ``sym_size``) is not worth a box of its own
    changed = True
    while changed:
        changed = False
        for key in list(groups):
            g = groups.get(key)
            if key and g is not None and not g["groups"] and len(g["nodes"]) <= TINY_GROUP:
                parent = groups[g["parent"]]
                parent["groups"].remove(key)
                parent["nodes"] += g["nodes"]
                del groups[key]
                changed = True
            elif key and g is not None and len(g["groups"]) + len(g["nodes"]) == 1:
                parent = groups[g["parent"]]
                k = parent["groups"].index(key)
                if g["groups"]:
                    child = g["groups"][0]
                    parent["groups"][k] = child
                    groups[child]["parent"] = g["parent"]
                    groups[child]["label"] = f"{g['label']}.{groups[child]['label']}"
                else:
                    del parent["groups"][k]
                    parent["nodes"].append(g["nodes"][0])
                del groups[key]
                changed = True
    # loose nodes beside sub-groups: one group per pass (or "other ops"), same key on both sides
    for key, g in list(groups.items()):
        if g["groups"] and len(g["nodes"]) > LOOSE_MAX:
            by_label: dict[str, list[int]] = {}
            for i in g["nodes"]:
                by_label.setdefault(_pass_label(records[i].get("pass")), []).append(i)
            g["nodes"] = []
            for label, idx in by_label.items():
                if len(idx) == 1:
                    g["nodes"] += idx
                    continue
                sub = f"{key}#{label}"
                if sub not in groups:
                    groups[sub] = {"label": f"[{label}]", "parent": key, "groups": [], "nodes": []}
                    g["groups"].append(sub)
                groups[sub]["nodes"] += idx
    for g in groups.values():
        g["nodes"].sort()
    return groups


def _stats(groups: dict[str, dict], records: list[dict[str, Any]], atol: float | None) -> None:
    """Per group: node count and status counts, recursively ("changed" when any)."""

    def walk(key: str) -> dict[str, int]:
        g = groups[key]
        c = {"count": 0, "removed": 0, "added": 0, "modified": 0, "bad": 0}
        for i in g["nodes"]:
            r = records[i]
            c["count"] += 1
            if r["status"] in c:
                c[r["status"]] += 1
            err = r.get("max_abs")
            if atol is not None and err is not None and (err == "inf" or (isinstance(err, float | int) and err > atol)):
                c["bad"] += 1
        for sub in g["groups"]:
            for k, v in walk(sub).items():
                c[k] += v
        g.update(c)
        return c

    walk("")


def _visible(groups: dict[str, dict], expanded: set[str], key: str = "") -> int:
    g = groups[key]
    return len(g["nodes"]) + sum(_visible(groups, expanded, s) if s in expanded else 1 for s in g["groups"])


def _initial_expanded(trees: dict[str, dict[str, dict]]) -> list[str]:
    """Containers opened at load: on each side the chain of lone containers from the top (``model``,
    then ``encoder``), while both sides stay small. Repeated blocks (the layers) stay closed."""
    expanded: set[str] = set()
    for t in trees.values():
        level = ""
        while True:
            kids = [k for k in t[level]["groups"] if t[k]["groups"]]
            if len(kids) != 1:
                break
            trial = expanded | {kids[0]}
            if any(_visible(t2, trial & set(t2)) > INITIAL_BOXES for t2 in trees.values()):
                break
            expanded, level = trial, kids[0]
    return sorted(expanded)


def view_model(result: DiffResult) -> dict[str, Any]:
    """What the page draws: the group tree of each side and the groups open at load."""
    scope = inherit_scopes(result.graphs, result.regions)
    scoped = [s for s in scope.values() if s]
    strip = len(common_prefix(scoped))
    if scoped and strip == min(len(s) for s in scoped):
        strip -= 1  # keep at least one level for the most shallow scope
    strip = max(strip, 0)
    atol = result.numeric["atol"] if result.numeric else None
    trees = {}
    for side in ("a", "b"):
        trees[side] = _side_tree(result.graphs[side], scope, strip)
        _stats(trees[side], result.graphs[side], atol)
    return {"trees": trees, "expanded": _initial_expanded(trees)}
