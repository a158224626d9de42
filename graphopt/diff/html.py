"""Self-contained HTML diff report: A and B side by side, grouped by name scope, laid out by dagre.

Nodes are grouped hierarchically by the module scopes the exporter recorded (``graphopt.diff.scopes``:
layers, blocks, sub-modules); nodes a pass created inherit the scope of their counterpart or
neighbours, and loose ones beside sub-groups are gathered per pass. Groups start collapsed (only
containers such as ``encoder`` are opened, while the view stays small); a group holding changed
nodes is highlighted and opens on click, on both sides at once: groups are keyed by scope, so A and
B show the same groups. The layout is computed in the page by dagre (MIT, bundled from
``assets/dagre.min.js``, license beside it), so the page needs no network. Removed nodes (A) are
red, added (B) green, modified orange; Constant nodes are not drawn. A search box finds nodes by
node or tensor name and opens the groups holding them. With ``--numeric`` nodes beyond tolerance get
a thick red border and the nodes on the divergence path (first divergence to the nearest output)
are filled by their error. After drawing, the page sets ``document.title`` to end in "rendered" and
``<body data-rendered="1">`` (the browser tests read both).

This module writes the page around its data: the summary, the diff (``DiffResult.as_dict``) and the group
tree (:func:`graphopt.diff.view.view_model`) as JSON, and the assets inlined: ``assets/diff.js`` (layout,
drawing, search), ``assets/diff.css`` and dagre.
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib import resources
from typing import Any

from graphopt.diff.result import DiffResult
from graphopt.diff.view import view_model

__all__ = ["render_html", "view_model"]


@cache
def _asset(name: str) -> str:
    """A file of ``assets/``: the page's script (``diff.js``) and style (``diff.css``), dagre."""
    return resources.files("graphopt.diff").joinpath(f"assets/{name}").read_text(encoding="utf-8")


@cache
def _dagre_js() -> str:
    return "\n".join(line for line in _asset("dagre.min.js").splitlines() if not line.startswith("//# sourceMappingURL"))


def _esc(x) -> str:
    return html.escape(str(x))


def _summary_html(r: DiffResult) -> str:
    s = r.summary
    parts = []
    if s["identical"]:
        parts.append("<p><b>identical structure</b>: nothing changed</p>")
    else:
        parts.append(
            f"<p>matched {s['matched']} nodes ({s['unchanged']} unchanged, {s['modified']} modified); "
            f"{s['removed']} removed, {s['added']} added in {s['regions']} regions</p>"
        )
    if r.regions:
        rows = "".join(
            f"<tr class='region' data-region='{g['id']}'><td>{g['id']}</td><td>{_esc(g['kind'])}</td>"
            f"<td>{_esc(', '.join(g['passes']) or '-')}</td><td>{_esc(g['summary'])}</td></tr>"
            for g in r.regions
        )
        parts.append("<div class='regions'><table><tr><th>#</th><th>kind</th><th>pass</th>"
                     f"<th>what (click to locate)</th></tr>{rows}</table></div>")
    delta = r.op_histogram["delta"]
    if delta:
        parts.append("<p>op delta: " + ", ".join(f"{_esc(k)} {v:+d}" for k, v in delta.items()) + "</p>")
    ini = r.initializers
    parts.append(
        f"<p>initializers {ini['a']['count']} → {ini['b']['count']}, bytes {ini['a']['bytes']:,} → {ini['b']['bytes']:,}, "
        f"parameters {ini['a']['params']:,} → {ini['b']['params']:,}; FLOPs (batch {r.flops['batch']}, seq {r.flops['seq']}) "
        f"{r.flops['a']['total']:,} → {r.flops['b']['total']:,}</p>"
    )
    if r.numeric:
        n = r.numeric
        f = n["first_divergence"]
        line = (f"numeric: {n['compared']} shared tensors compared, {n['exceeding']} beyond tolerance "
                f"(atol {n['atol']:g})")
        if f:
            line += f"; first divergence <b>{_esc(f['a'])}</b> ({_esc(f['op'])} {_esc(f.get('node_name', ''))}), max abs {f['max_abs']:.3g}"
        parts.append(f"<p>{line}</p>")
    return "".join(parts)


def _json(x: Any) -> str:
    return json.dumps(x).replace("</", "<\\/")


def render_html(result: DiffResult) -> str:
    """The report as one HTML string (no external resources)."""
    data = _json(result.as_dict())
    view = _json(view_model(result))
    title = f"graphopt diff: {result.a['label']} vs {result.b['label']}"
    legend = ("<span style='background:#ffcdd2'>removed (A)</span><span style='background:#c8e6c9'>added (B)</span>"
              "<span style='background:#ffe0b2'>modified</span><span style='background:#eceff1'>unchanged</span>"
              "<span style='background:#fff3e0;border:2px solid #ef6c00'>group with changes (click)</span>"
              "<span style='border:3px solid #b71c1c'>beyond tolerance</span>"
              "<span style='background:linear-gradient(90deg,#fff1a0,#ff331e)'>error on divergence path</span>"
              " Constant nodes are not drawn.")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{_esc(title)}</title><style>
{_asset('diff.css')}</style></head>
<body>
<header><h1>{_esc(title)}</h1><div class="legend">{legend}</div></header>
<div class="summary">{_summary_html(result)}</div>
<div class="toolbar"><button id="collapse">collapse all</button>
<input id="search" type="search" placeholder="find node or tensor name (Enter)"> <span id="search-status"></span>
<span id="render-status">rendering…</span></div>
<div class="panes">
<div class="pane" id="pane-a"><h2>A: {_esc(result.a['label'])} ({result.a['nodes']} nodes)</h2></div>
<div class="pane" id="pane-b"><h2>B: {_esc(result.b['label'])} ({result.b['nodes']} nodes)</h2></div>
</div>
<script type="application/json" id="diff-data">{data}</script>
<script type="application/json" id="view-data">{view}</script>
<script>{_dagre_js()}</script>
<script>
{_asset('diff.js')}</script>
</body></html>
"""
