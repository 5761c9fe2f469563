// The mesh as a graph (GET /v1/mesh/graph): this node in the centre, the peers it is
// connected to, dialling or has banned on the first ring, the rest of its peers table and
// the peers those report on the second. Deterministic layout: the order the node gives.
// Uses api(), svg() and $() of dashboard.js (loaded first), whose refresh() calls loadMeshGraph().
'use strict';

const GRAPH_SIZE = 600;
const GRAPH_RINGS = [0, 130, 225];
const ROLE_MARKS = { relay: 'R', mailman: 'M', circuit: 'C' };

// A ring's nodes at even angles, starting at the top; the second ring's follow the
// first-ring peer that reports them, so a peer's neighbours sit behind it.
function graphLayout(graph) {
  const c = GRAPH_SIZE / 2;
  const at = new Map();
  const first = graph.nodes.filter((n) => n.ring === 1);
  const order = new Map(first.map((n, i) => [n.id, i]));
  const parent = new Map();
  for (const l of graph.links) {
    if (order.has(l.from) && !parent.has(l.to)) parent.set(l.to, order.get(l.from));
  }
  const second = graph.nodes.filter((n) => n.ring === 2)
    .map((n, i) => [parent.has(n.id) ? parent.get(n.id) : first.length, i, n])
    .sort((a, b) => a[0] - b[0] || a[1] - b[1]).map((e) => e[2]);
  for (const n of graph.nodes.filter((n) => n.ring === 0)) at.set(n.id, { x: c, y: c, angle: Math.PI / 2 });
  for (const [ring, nodes] of [[1, first], [2, second]]) {
    nodes.forEach((n, i) => {
      const angle = -Math.PI / 2 + (2 * Math.PI * i) / nodes.length;
      at.set(n.id, { x: c + GRAPH_RINGS[ring] * Math.cos(angle), y: c + GRAPH_RINGS[ring] * Math.sin(angle), angle });
    });
  }
  return at;
}

function drawMeshGraph(graph) {
  const box = $('mesh-graph');
  box.replaceChildren();
  const at = graphLayout(graph);
  const c = GRAPH_SIZE / 2;
  for (const r of GRAPH_RINGS.slice(1)) box.append(svg('circle', { class: 'ring', cx: c, cy: c, r }));
  for (const l of graph.links) {
    const a = at.get(l.from), b = at.get(l.to);
    const line = svg('line', { class: `link link-${l.state}`, 'data-state': l.state, 'data-from': l.from, 'data-to': l.to,
      x1: a.x.toFixed(1), y1: a.y.toFixed(1), x2: b.x.toFixed(1), y2: b.y.toFixed(1) });
    line.append(svg('title', {}, `${l.state}${l.via ? ' via ' + l.via : ''}`));
    box.append(line);
  }
  for (const n of graph.nodes) {
    const p = at.get(n.id);
    const cls = ['gnode', `ring-${n.ring}`, n.self ? 'self' : '', n.our_mailman ? 'our-mailman' : '', n.did ? '' : 'address']
      .filter(Boolean).join(' ');
    const g = svg('g', { class: cls, 'data-id': n.id, transform: `translate(${p.x.toFixed(1)},${p.y.toFixed(1)})` });
    g.append(svg('title', {}, [n.did || n.id, n.roles.join(', '), n.our_mailman ? 'our mailman' : ''].filter(Boolean).join('\n')));
    g.append(svg('circle', { r: n.self ? 12 : 9 }));
    const marks = n.roles.map((r) => ROLE_MARKS[r]).filter(Boolean).join('');
    if (marks) g.append(svg('text', { class: 'mark', 'text-anchor': 'middle', dy: '0.35em' }, marks));
    if (n.ring === 0) {
      g.append(svg('text', { class: 'glabel', 'text-anchor': 'middle', y: 26 }, n.label));
    } else {  // radial, outwards, never upside down
      const deg = (p.angle * 180) / Math.PI;
      const flip = Math.cos(p.angle) < 0;
      g.append(svg('text', { class: 'glabel', 'text-anchor': flip ? 'end' : 'start', dy: '0.35em',
        transform: `rotate(${(flip ? deg + 180 : deg).toFixed(1)}) translate(${flip ? -13 : 13},0)` }, n.label));
    }
    box.append(g);
  }
  const peers = graph.nodes.length - 1;
  $('graph-note').textContent = peers === 0 ? 'nothing yet: no peer known'
    : `${peers} ${peers === 1 ? 'peer' : 'peers'}` + (graph.truncated ? `; ${graph.omitted} more not drawn (limit ${graph.limit})` : '')
      + (graph.dht_contacts !== null && graph.dht_contacts !== undefined ? `; DHT contacts: ${graph.dht_contacts}` : '');
}

async function loadMeshGraph() {
  drawMeshGraph(await api('/v1/mesh/graph'));
}
