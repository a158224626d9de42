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
"""

from __future__ import annotations

import html
import json
from functools import cache
from importlib import resources
from typing import Any

from graphopt.diff.result import DiffResult
from graphopt.diff.scopes import common_prefix, inherit_scopes

#: loose nodes beside sub-groups are gathered into one group per pass past this many
LOOSE_MAX = 3
#: leaf groups of at most this many nodes are dissolved into their parent
TINY_GROUP = 2
#: containers are opened at load while each side shows at most this many boxes
INITIAL_BOXES = 16


@cache
def _dagre_js() -> str:
    js = resources.files("graphopt.diff").joinpath("assets/dagre.min.js").read_text(encoding="utf-8")
    return "\n".join(line for line in js.splitlines() if not line.startswith("//# sourceMappingURL"))


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
    """Containers opened at load: the chain of lone containers from the top (``model``, then
    ``encoder``), while each side stays small. Repeated blocks (the layers) stay closed."""
    expanded: set[str] = set()
    level = [""]
    while True:
        nxt = sorted({k for t in trees.values() for p in level if p in t for k in t[p]["groups"]
                      if any(k in t2 and t2[k]["groups"] for t2 in trees.values())})
        if len(nxt) != 1:
            break
        trial = expanded | set(nxt)
        if any(_visible(t, trial) > INITIAL_BOXES for t in trees.values()):
            break
        expanded, level = trial, nxt
    return sorted(expanded)


def _ancestors(groups: dict[str, dict], key: str) -> list[str]:
    out = []
    p = groups[key]["parent"]
    while p is not None:
        out.append(p)
        p = groups[p]["parent"]
    return out


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
.toolbar{padding:4px 16px;display:flex;gap:8px;align-items:center}
.toolbar input{width:22em}
.panes{display:flex;gap:8px;padding:0 8px 8px 8px}
.pane{flex:1;border:1px solid #bbb;background:#fff;overflow:auto;height:80vh;position:relative}
.pane h2{font-size:13px;margin:0;padding:4px 8px;background:#eceff1;position:sticky;top:0;left:0;z-index:1}
svg text{font:13px monospace;pointer-events:none}
.node rect{stroke:#78909c;stroke-width:1;fill:#eceff1}
.node.removed rect{fill:#ffcdd2;stroke:#c62828}
.node.added rect{fill:#c8e6c9;stroke:#2e7d32}
.node.modified rect{fill:#ffe0b2;stroke:#ef6c00}
.node.group rect{fill:#f5f5f5;stroke:#607d8b;stroke-width:1.5;cursor:pointer}
.node.group.changed rect{fill:#fff3e0;stroke:#ef6c00;stroke-width:2.5}
.node.group text.title{font-weight:bold}
.node.bad rect{stroke:#b71c1c;stroke-width:3.5}
.node.hl rect,.node.found rect{stroke:#1565c0;stroke-width:4}
.cluster rect{fill:#fafcff;stroke:#90a4ae;stroke-dasharray:5 3}
.cluster.changed rect{stroke:#ef6c00;fill:#fffaf3}
.cluster text{fill:#455a64;font-weight:bold;cursor:pointer;pointer-events:auto}
.edge{fill:none;stroke:#90a4ae;stroke-width:1.2}
.badge{fill:#1565c0}
.badge-text{fill:#fff;font-weight:bold}
.legend span{display:inline-block;padding:1px 6px;margin-right:6px;border:1px solid #999;color:#222;background:#eceff1}
"""

_JS = r"""
(function(){
'use strict';
const D = JSON.parse(document.getElementById('diff-data').textContent);
const V = JSON.parse(document.getElementById('view-data').textContent);
const NW = 190, NH = 36, GW = 230, GH = 52;
const SVGNS = 'http://www.w3.org/2000/svg';
const expanded = new Set(V.expanded);
const marked = {a: new Set(), b: new Set()};  // node indices highlighted (region or search)
let markClass = 'hl';
const atol = D.numeric ? D.numeric.atol : null;
const heat = {a: {}, b: {}};  // node index -> error on the divergence path
if (D.numeric && D.numeric.path){
  const prodA = {};
  D.graphs.a.forEach((n, i) => n.outputs.forEach(o => { prodA[o] = i; }));
  const idxB = {};
  D.graphs.b.forEach((n, i) => { idxB[n.id] = i; });
  D.numeric.path.forEach(p => {
    const i = prodA[p.a];
    if (i === undefined) return;
    // beyond tolerance with a small max_abs: the shapes differ (counted as infinite error)
    const err = (p.exceeds && !(p.max_abs > atol)) ? 'inf' : p.max_abs;
    heat.a[i] = err;
    const m = D.graphs.a[i].match;
    if (m && m in idxB) heat.b[idxB[m]] = err;
  });
}
function heatColor(err){
  const e = (err === 'inf' || typeof err !== 'number' || !isFinite(err)) ? 1e30 : err;
  const lo = Math.log10(Math.max(atol || 1e-6, 1e-12));
  const t = Math.min(1, Math.max(0, (Math.log10(Math.max(e, 1e-30)) - lo + 1) / 5));
  const r = 255, g = Math.round(241 - t * 190), b = Math.round(160 - t * 130);
  return `rgb(${r},${g},${b})`;
}
function el(tag, attrs, parent){
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(x){ return (typeof x === 'number') ? x.toExponential(1) : String(x); }
function isBad(n){ return typeof n.max_abs === 'number' ? n.max_abs > atol : n.max_abs === 'inf'; }
function cut(s, k){ return s.length > k ? s.slice(0, k - 1) + '\u2026' : s; }

const groupOf = {a: {}, b: {}};  // node index -> innermost group key
['a', 'b'].forEach(side => {
  const T = V.trees[side];
  for (const k in T) T[k].nodes.forEach(i => { groupOf[side][i] = k; });
});
function ancestors(side, key){
  const T = V.trees[side], out = [];
  for (let k = key; k !== null && k !== undefined; k = T[k].parent) out.push(k);
  return out;  // key first, root ('') last
}
function rep(side, i){
  // the box standing for node i: its outermost closed group, else the node; null for hidden nodes
  const k = groupOf[side][i];
  if (k === undefined) return null;
  const chain = ancestors(side, k).reverse();
  for (const g of chain) if (g !== '' && !expanded.has(g)) return 'g:' + g;
  return 'n' + i;
}
function openFor(side, idx){ idx.forEach(i => { const k = groupOf[side][i]; if (k !== undefined) ancestors(side, k).forEach(g => { if (g) expanded.add(g); }); }); }

function layout(side){
  const T = V.trees[side], nodes = D.graphs[side];
  const g = new dagre.graphlib.Graph({compound: true});
  g.setGraph({rankdir: 'TB', nodesep: 16, ranksep: 30, edgesep: 8, marginx: 12, marginy: 12, acyclicer: 'greedy'});
  const walk = (key, parent) => {
    T[key].nodes.forEach(i => { g.setNode('n' + i, {width: NW, height: NH, kind: 'node', i: i}); if (parent) g.setParent('n' + i, parent); });
    T[key].groups.forEach(s => {
      if (expanded.has(s)){
        g.setNode('c:' + s, {kind: 'cluster', key: s});
        if (parent) g.setParent('c:' + s, parent);
        walk(s, 'c:' + s);
      } else {
        g.setNode('g:' + s, {width: GW, height: GH, kind: 'group', key: s});
        if (parent) g.setParent('g:' + s, parent);
      }
    });
  };
  walk('', null);
  const producer = {};
  nodes.forEach((n, i) => n.outputs.forEach(o => { if (o) producer[o] = i; }));
  nodes.forEach((n, i) => n.inputs.forEach(v => {
    if (!(v in producer)) return;
    const p = rep(side, producer[v]), c = rep(side, i);
    if (!p || !c || p === c) return;
    // weight: how many tensors the box edge stands for (the majority direction wins a cycle)
    if (g.hasEdge(p, c)) g.edge(p, c).weight += 1; else g.setEdge(p, c, {weight: 1});
  }));
  dagre.layout(g);
  return g;
}

function draw(side){
  const pane = document.getElementById('pane-' + side);
  const old = pane.querySelector('svg'); if (old) old.remove();
  const T = V.trees[side];
  const g = layout(side);
  const gr = g.graph();
  // shrink a graph wider than its pane to fit, down to 70 % (the labels stay legible)
  const gw = Math.ceil(gr.width || 10) + 10, gh = Math.ceil(gr.height || 10) + 30;
  const k = Math.max(0.7, Math.min(1, (pane.clientWidth - 4) / gw));
  const svg = el('svg', {width: Math.ceil(gw * k), height: Math.ceil(gh * k), viewBox: `0 0 ${gw} ${gh}`, id: 'svg-' + side}, null);
  pane.appendChild(svg);
  const root = el('g', {transform: 'translate(0,18)'}, svg);
  const cg = el('g', {}, root), eg = el('g', {}, root), ng = el('g', {}, root);
  let boxes = 0;
  g.nodes().forEach(id => {
    const v = g.node(id);
    if (v.kind !== 'cluster') return;
    const s = T[v.key];
    const c = el('g', {class: 'cluster' + (s.removed + s.added + s.modified ? ' changed' : ''), 'data-group': v.key,
                       transform: `translate(${v.x - v.width / 2},${v.y - v.height / 2 - 16})`}, cg);
    el('rect', {width: v.width, height: v.height + 16, rx: 6}, c);
    const t = el('text', {x: 8, y: 13}, c);
    t.textContent = '\u25be ' + s.label;
    t.addEventListener('click', () => { expanded.delete(v.key); drawAll(); });
  });
  g.edges().forEach(e => {
    const pts = g.edge(e).points;
    if (!pts || !pts.length) return;
    let d = `M${pts[0].x},${pts[0].y}`;
    for (let k = 1; k < pts.length; k++) d += ` L${pts[k].x},${pts[k].y}`;
    el('path', {d: d, class: 'edge'}, eg);
  });
  g.nodes().forEach(id => {
    const v = g.node(id);
    if (v.kind === 'cluster') return;
    boxes++;
    const w = v.width, h = v.height;
    const box = el('g', {transform: `translate(${v.x - w / 2},${v.y - h / 2})`}, ng);
    const rect = el('rect', {width: w, height: h, rx: 4}, box);
    if (v.kind === 'group'){
      const s = T[v.key];
      const changed = s.removed + s.added + s.modified;
      let cls = 'node group' + (changed ? ' changed' : '') + (s.bad ? ' bad' : '');
      box.setAttribute('class', cls);
      box.setAttribute('data-group', v.key);
      const t1 = el('text', {x: 8, y: 16, class: 'title'}, box), t2 = el('text', {x: 8, y: 32}, box), t3 = el('text', {x: 8, y: 46}, box);
      t1.textContent = '\u25b8 ' + cut(s.label, 27);
      t2.textContent = s.count + ' nodes' + (s.bad ? ', ' + s.bad + ' beyond tol' : '');
      const parts = [];
      if (s.removed) parts.push('\u2212' + s.removed + ' removed');
      if (s.added) parts.push('+' + s.added + ' added');
      if (s.modified) parts.push('~' + s.modified + ' modified');
      t3.textContent = parts.length ? parts.join(' ') : 'unchanged';
      const hot = Object.keys(heat[side]).filter(i => { const k = groupOf[side][i]; return k !== undefined && ancestors(side, k).includes(v.key); });
      if (hot.length) rect.setAttribute('style', 'fill:' + heatColor(Math.max(...hot.map(i => heat[side][i] === 'inf' ? Infinity : heat[side][i]))));
      el('title', {}, box).textContent = v.key + '\nclick to open';
      box.addEventListener('click', () => { expanded.add(v.key); drawAll(); scrollToGroup(v.key); });
      return;
    }
    const i = v.i, n = D.graphs[side][i];
    let cls = 'node ' + n.status;
    if (atol !== null && n.max_abs !== undefined && isBad(n)) cls += ' bad';
    if (marked[side].has(i)) cls += ' ' + markClass;
    if (i in heat[side]) cls += ' onpath';
    box.setAttribute('class', cls);
    box.setAttribute('id', 'node-' + n.id);
    if (i in heat[side]) rect.setAttribute('style', 'fill:' + heatColor(heat[side][i]));
    if (n.region !== null) box.setAttribute('data-region', n.region);
    const t1 = el('text', {x: 6, y: 15}, box), t2 = el('text', {x: 6, y: 30}, box);
    t1.textContent = cut(n.op, 22);
    let sub = n.name || n.outputs[0] || '';
    if (n.max_abs !== undefined) sub = 'err ' + fmt(n.max_abs) + ' ' + sub;
    t2.textContent = cut(sub, 23);
    const tip = [n.op + ' ' + JSON.stringify(n.name), 'status: ' + n.status];
    if (n.pass) tip.push('pass: ' + n.pass);
    if (n.region !== null) tip.push('region #' + n.region);
    if (n.changes && n.changes.length) tip.push('changes: ' + n.changes.join('; '));
    if (n.max_abs !== undefined) tip.push('max abs error: ' + n.max_abs);
    if (i in heat[side]) tip.push('on the divergence path (first divergence to the nearest output)');
    if (groupOf[side][i]) tip.push('scope: ' + groupOf[side][i]);
    tip.push('in: ' + n.inputs.join(', '), 'out: ' + n.outputs.join(', '));
    el('title', {}, box).textContent = tip.join('\n');
    if (n.region !== null){
      el('circle', {cx: w - 11, cy: 11, r: 10, class: 'badge'}, box);
      const bt = el('text', {x: w - 11, y: 15, 'text-anchor': 'middle', class: 'badge-text'}, box);
      bt.textContent = String(n.region);
    }
  });
  svg.setAttribute('data-boxes', boxes);
  return boxes;
}

function scrollTo(side, target){
  if (!target) return;
  const pane = document.getElementById('pane-' + side);
  const pr = pane.getBoundingClientRect(), r = target.getBoundingClientRect();
  pane.scrollTop += r.top - pr.top - 40;
  pane.scrollLeft += r.left - pr.left - 40;
}
function scrollToGroup(key){
  // both sides show the same group keys: bring the group to the top of both panes
  ['a', 'b'].forEach(side => scrollTo(side, document.querySelector(`#pane-${side} [data-group="${CSS.escape(key)}"]`)));
}
function mark(idx, cls){
  markClass = cls;
  ['a', 'b'].forEach(side => { marked[side] = new Set(idx[side]); openFor(side, idx[side]); });
  drawAll();
  ['a', 'b'].forEach(side => {
    if (idx[side].length) scrollTo(side, document.getElementById('node-' + D.graphs[side][idx[side][0]].id));
  });
}
function showRegion(r){
  const reg = D.regions[r];
  const pos = {};
  ['a', 'b'].forEach(side => D.graphs[side].forEach((n, i) => { pos[n.id] = i; }));
  mark({a: reg.a_nodes.map(id => pos[id]), b: reg.b_nodes.map(id => pos[id])}, 'hl');
}
function search(q){
  q = q.trim().toLowerCase();
  const idx = {a: [], b: []};
  if (q) ['a', 'b'].forEach(side => D.graphs[side].forEach((n, i) => {
    if (groupOf[side][i] === undefined) return;
    if ([n.name, ...n.inputs, ...n.outputs].some(s => s && s.toLowerCase().includes(q))) idx[side].push(i);
  }));
  mark(idx, 'found');
  document.getElementById('search-status').textContent = q ? `${idx.a.length} in A, ${idx.b.length} in B` : '';
}

document.querySelectorAll('tr.region').forEach(tr => tr.addEventListener('click', () => showRegion(+tr.dataset.region)));
document.getElementById('search').addEventListener('change', ev => search(ev.target.value));
document.getElementById('collapse').addEventListener('click', () => { expanded.clear(); V.expanded.forEach(k => expanded.add(k)); drawAll(); });
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
<title>{_esc(title)}</title><style>{_CSS}</style></head>
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
<script>{_JS}</script>
</body></html>
"""
