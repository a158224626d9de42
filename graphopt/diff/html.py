"""Self-contained HTML diff report: A and B side by side as layered DAGs drawn in inline SVG.

Everything is inlined (data as JSON, plain JS, CSS): no network, no CDN. Removed nodes (A) are
red, added nodes (B) green, modified ones orange; every rewritten region gets a numbered badge and
a row in the region table (click it to scroll both graphs to it). Runs of unchanged nodes are
collapsed into one box (click to expand). With ``--numeric`` each node shows the max abs error of
its output and nodes beyond tolerance get a thick red border. After drawing, the page sets
``document.title`` to end in "rendered" and ``<body data-rendered="1">`` (the browser test reads both).
"""

from __future__ import annotations

import html
import json

from graphopt.diff.result import DiffResult

_CSS = """
body{font:13px system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:10px 16px;background:#263238;color:#eee}
header h1{font-size:16px;margin:0 0 4px 0}
.summary{padding:8px 16px}
.summary table{border-collapse:collapse;margin:4px 0}
.regions{max-height:28vh;overflow:auto;display:inline-block}
.summary td,.summary th{border:1px solid #ccc;padding:2px 6px;text-align:left}
.summary tr.region{cursor:pointer}
.summary tr.region:hover{background:#e3f2fd}
.toolbar{padding:4px 16px}
.panes{display:flex;gap:8px;padding:0 8px 8px 8px}
.pane{flex:1;border:1px solid #bbb;background:#fff;overflow:auto;height:75vh;position:relative}
.pane h2{font-size:13px;margin:0;padding:4px 8px;background:#eceff1;position:sticky;top:0;left:0;z-index:1}
svg text{font:11px monospace;pointer-events:none}
.node rect{stroke:#78909c;stroke-width:1;fill:#eceff1}
.node.removed rect{fill:#ffcdd2;stroke:#c62828}
.node.added rect{fill:#c8e6c9;stroke:#2e7d32}
.node.modified rect{fill:#ffe0b2;stroke:#ef6c00}
.node.group rect{fill:#fff;stroke:#90a4ae;stroke-dasharray:4 3;cursor:pointer}
.node.bad rect{stroke:#b71c1c;stroke-width:3}
.node.hl rect{stroke:#1565c0;stroke-width:3}
.edge{fill:none;stroke:#90a4ae;stroke-width:1}
.badge{fill:#1565c0}
.badge-text{fill:#fff;font-weight:bold}
.legend span{display:inline-block;padding:1px 6px;margin-right:6px;border:1px solid #999;color:#222;background:#eceff1}
"""

_JS = r"""
(function(){
'use strict';
const D = JSON.parse(document.getElementById('diff-data').textContent);
const NW = 168, NH = 34, GX = 22, GY = 26, MIN_RUN = 3;
const SVGNS = 'http://www.w3.org/2000/svg';
const expanded = {a: new Set(), b: new Set()};
let allExpanded = false;
const atol = D.numeric ? D.numeric.atol : null;

function el(tag, attrs, parent){
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(x){ return (typeof x === 'number') ? x.toExponential(1) : String(x); }
function isBad(n){ return typeof n.max_abs === 'number' ? n.max_abs > atol : n.max_abs === 'inf'; }

function groups(nodes, side){
  // runs of consecutive unchanged nodes (graph order is topological), longer than MIN_RUN
  const gid = new Array(nodes.length).fill(null);
  let k = 0, i = 0;
  while (i < nodes.length){
    if (nodes[i].status !== 'unchanged' || (atol !== null && isBad(nodes[i]))){ i++; continue; }
    let j = i;
    while (j < nodes.length && nodes[j].status === 'unchanged' && !(atol !== null && isBad(nodes[j]))) j++;
    if (j - i >= MIN_RUN){
      const key = side + 'g' + k++;
      if (!allExpanded && !expanded[side].has(key)) for (let t = i; t < j; t++) gid[t] = {key: key, first: i, count: j - i};
    }
    i = j;
  }
  return gid;
}

function layout(side){
  const nodes = D.graphs[side];
  const gid = groups(nodes, side);
  const boxes = [], boxOf = new Array(nodes.length);
  const byKey = {};
  nodes.forEach((n, i) => {
    const g = gid[i];
    if (g){
      if (!(g.key in byKey)){ byKey[g.key] = boxes.length; boxes.push({group: g, idx: [], preds: new Set()}); }
      boxOf[i] = byKey[g.key]; boxes[byKey[g.key]].idx.push(i);
    } else { boxOf[i] = boxes.length; boxes.push({node: n, idx: [i], preds: new Set()}); }
  });
  const producer = {};
  nodes.forEach((n, i) => n.outputs.forEach(o => { if (o) producer[o] = i; }));
  nodes.forEach((n, i) => n.inputs.forEach(v => {
    if (v && v in producer){ const p = boxOf[producer[v]], c = boxOf[i]; if (p !== c) boxes[c].preds.add(p); }
  }));
  // longest-path layering (boxes are in topological order)
  const layer = boxes.map(() => 0);
  boxes.forEach((b, i) => b.preds.forEach(p => { layer[i] = Math.max(layer[i], layer[p] + 1); }));
  const rows = [];
  boxes.forEach((b, i) => { (rows[layer[i]] = rows[layer[i]] || []).push(i); });
  const x = boxes.map(() => 0);
  rows.forEach(row => {
    row.forEach(i => {
      const ps = [...boxes[i].preds];
      boxes[i].bary = ps.length ? ps.reduce((s, p) => s + x[p], 0) / ps.length : 0;
    });
    row.sort((p, q) => boxes[p].bary - boxes[q].bary);
    let cur = 0;
    row.forEach(i => { const want = Math.max(cur, boxes[i].bary); x[i] = want; cur = want + 1; });
  });
  return {boxes, layer, x, rows};
}

function draw(side){
  const pane = document.getElementById('pane-' + side);
  const old = pane.querySelector('svg'); if (old) old.remove();
  const L = layout(side);
  const maxX = Math.max(1, ...L.x.map(v => v + 1));
  const W = maxX * (NW + GX) + 40, H = (L.rows.length) * (NH + GY) + 40;
  const svg = el('svg', {width: W, height: H, id: 'svg-' + side, 'data-boxes': L.boxes.length});
  pane.appendChild(svg);
  const pos = L.boxes.map((b, i) => [20 + L.x[i] * (NW + GX), 20 + L.layer[i] * (NH + GY)]);
  const eg = el('g', {}, svg);
  L.boxes.forEach((b, i) => b.preds.forEach(p => {
    const [x1, y1] = pos[p], [x2, y2] = pos[i];
    const sx = x1 + NW / 2, sy = y1 + NH, tx = x2 + NW / 2, ty = y2, my = (sy + ty) / 2;
    el('path', {d: `M${sx},${sy} C${sx},${my} ${tx},${my} ${tx},${ty}`, class: 'edge'}, eg);
  }));
  const ng = el('g', {}, svg);
  L.boxes.forEach((b, i) => {
    const [px, py] = pos[i];
    const g = el('g', {transform: `translate(${px},${py})`}, ng);
    el('rect', {width: NW, height: NH, rx: 4}, g);
    const t1 = el('text', {x: 6, y: 14}, g), t2 = el('text', {x: 6, y: 28}, g);
    if (b.group){
      g.setAttribute('class', 'node group');
      g.setAttribute('data-group', b.group.key);
      t1.textContent = '\u2026 ' + b.group.count + ' unchanged';
      t2.textContent = 'click to expand';
      g.addEventListener('click', () => { expanded[side].add(b.group.key); draw(side); });
      el('title', {}, g).textContent = b.idx.map(k => D.graphs[side][k].op).join(', ');
      return;
    }
    const n = b.node;
    let cls = 'node ' + n.status;
    if (atol !== null && n.max_abs !== undefined && isBad(n)) cls += ' bad';
    g.setAttribute('class', cls);
    g.setAttribute('id', 'node-' + n.id);
    if (n.region !== null) g.setAttribute('data-region', n.region);
    t1.textContent = n.op.length > 22 ? n.op.slice(0, 21) + '\u2026' : n.op;
    let sub = n.name || n.outputs[0] || '';
    if (n.max_abs !== undefined) sub = 'err ' + fmt(n.max_abs) + ' ' + sub;
    t2.textContent = sub.length > 24 ? sub.slice(0, 23) + '\u2026' : sub;
    const tip = [n.op + ' ' + JSON.stringify(n.name), 'status: ' + n.status];
    if (n.pass) tip.push('pass: ' + n.pass);
    if (n.region !== null) tip.push('region #' + n.region);
    if (n.changes && n.changes.length) tip.push('changes: ' + n.changes.join('; '));
    if (n.max_abs !== undefined) tip.push('max abs error: ' + n.max_abs);
    tip.push('in: ' + n.inputs.join(', '), 'out: ' + n.outputs.join(', '));
    el('title', {}, g).textContent = tip.join('\n');
    if (n.region !== null){
      el('circle', {cx: NW - 10, cy: 10, r: 9, class: 'badge'}, g);
      const bt = el('text', {x: NW - 10, y: 14, 'text-anchor': 'middle', class: 'badge-text'}, g);
      bt.textContent = String(n.region);
    }
  });
  return L.boxes.length;
}

function showRegion(r){
  document.querySelectorAll('.node.hl').forEach(e => e.classList.remove('hl'));
  const reg = D.regions[r];
  ['a', 'b'].forEach(side => {
    const ids = side === 'a' ? reg.a_nodes : reg.b_nodes;
    ids.forEach(id => { const e = document.getElementById('node-' + id); if (e) e.classList.add('hl'); });
    const first = ids.length ? document.getElementById('node-' + ids[0]) : null;
    if (first){
      const pane = document.getElementById('pane-' + side);
      const m = /translate\(([-\d.]+),([-\d.]+)\)/.exec(first.getAttribute('transform'));
      if (m) { pane.scrollTop = Math.max(0, +m[2] - 80); pane.scrollLeft = Math.max(0, +m[1] - 80); }
    }
  });
}

document.querySelectorAll('tr.region').forEach(tr => tr.addEventListener('click', () => showRegion(+tr.dataset.region)));
document.getElementById('toggle').addEventListener('click', () => {
  allExpanded = !allExpanded;
  document.getElementById('toggle').textContent = allExpanded ? 'collapse unchanged' : 'expand all';
  drawAll();
});
function drawAll(){
  const na = draw('a'), nb = draw('b');
  document.getElementById('render-status').textContent =
    'rendered A: ' + D.graphs.a.length + ' nodes (' + na + ' boxes), B: ' + D.graphs.b.length + ' nodes (' + nb + ' boxes)';
  document.body.dataset.rendered = '1';
  document.title = document.title.replace(/( \u2014 rendered)?$/, ' \u2014 rendered');
}
drawAll();
const want = /region=(\d+)/.exec(location.hash);
if (want && D.regions[+want[1]]) showRegion(+want[1]);
})();
"""


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


def render_html(result: DiffResult) -> str:
    """The report as one HTML string (no external resources)."""
    data = json.dumps(result.as_dict()).replace("</", "<\\/")
    title = f"graphopt diff: {result.a['label']} vs {result.b['label']}"
    legend = ("<span style='background:#ffcdd2'>removed (A)</span><span style='background:#c8e6c9'>added (B)</span>"
              "<span style='background:#ffe0b2'>modified</span><span style='background:#eceff1'>unchanged</span>"
              "<span style='border:3px solid #b71c1c'>beyond tolerance</span>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{_esc(title)}</title><style>{_CSS}</style></head>
<body>
<header><h1>{_esc(title)}</h1><div class="legend">{legend}</div></header>
<div class="summary">{_summary_html(result)}</div>
<div class="toolbar"><button id="toggle">expand all</button> <span id="render-status">rendering…</span></div>
<div class="panes">
<div class="pane" id="pane-a"><h2>A: {_esc(result.a['label'])} ({result.a['nodes']} nodes)</h2></div>
<div class="pane" id="pane-b"><h2>B: {_esc(result.b['label'])} ({result.b['nodes']} nodes)</h2></div>
</div>
<script type="application/json" id="diff-data">{data}</script>
<script>{_JS}</script>
</body></html>
"""
