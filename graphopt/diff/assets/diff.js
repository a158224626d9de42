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
