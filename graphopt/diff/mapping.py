"""Model Explorer sync-navigation mapping (``--mapping FILE``).

Writes Model Explorer's ``SyncNavigationData`` JSON ("Upload mapping from computer" in the
split-pane sync menu): ``mappingEntries`` with one entry per matched node pair and one
many-to-many entry per rewritten region, so selecting a fused node highlights the nodes it
replaced. Node ids are ONNX node names (the ONNX adapter's ids); a nameless node is identified by
its first output name.
"""

from __future__ import annotations

import json

from graphopt.diff.result import DiffResult


def _node_id(rec: dict) -> str:
    return rec["name"] or (rec["outputs"][0] if rec["outputs"] else rec["id"])


def mapping_data(result: DiffResult) -> dict:
    """The ``SyncNavigationData`` dict for ``result`` (A is the left pane, B the right)."""
    ra, rb = result.graphs["a"], result.graphs["b"]
    by_id = {rec["id"]: rec for rec in (*ra, *rb)}
    entries = []
    for rec in ra:
        if rec["match"] is not None:
            entries.append({"leftNodeIds": [_node_id(rec)], "rightNodeIds": [_node_id(by_id[rec["match"]])]})
    for region in result.regions:
        left = [_node_id(by_id[n]) for n in region["a_nodes"]]
        right = [_node_id(by_id[n]) for n in region["b_nodes"]]
        if left and right:
            entries.append({"leftNodeIds": left, "rightNodeIds": right})
    return {"mappingEntries": entries, "disableMappingFallback": True, "showDiffHighlights": True}


def to_json(result: DiffResult) -> str:
    """``mapping_data`` as indented JSON text."""
    return json.dumps(mapping_data(result), indent=2) + "\n"
