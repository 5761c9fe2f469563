// hmpnode dashboard: plain JS, no build step, no outside resources.
// The token comes from the URL fragment (#token=..., never sent to a server) or the
// sign-in form, lives in sessionStorage (this tab only), and goes to the API only in
// the Authorization header. Everything the API returns is shown with textContent /
// SVG attributes, never parsed as HTML.
'use strict';

const TOKEN_KEY = 'hmpnode.token';
const SVG_NS = 'http://www.w3.org/2000/svg';
const FEED_MAX = 200;          // items kept in the live feed
const REFRESH_MS = 5000;       // status, peers, queues, journal, interests, the mesh graph, the charts
const RETRY_MAX_MS = 15000;    // feed reconnect back-off ceiling

const $ = (id) => document.getElementById(id);
let feedAbort = null;
let selfDid = null;            // this node's agent: its containers are "out", others' "in"
let refreshTimer = null;
const seen = new Set();        // container DIDs already in the feed

// -- token ------------------------------------------------------------------------

function takeFragmentToken() {
  const params = new URLSearchParams(location.hash.slice(1));
  const token = params.get('token');
  if (token) {
    sessionStorage.setItem(TOKEN_KEY, token);
  }
  if (location.hash) {
    history.replaceState(null, '', location.pathname);  // out of the address bar and history
  }
}

const token = () => sessionStorage.getItem(TOKEN_KEY);

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = { Authorization: 'Bearer ' + token(), ...(options.headers || {}) };
  const init = { method: options.method || 'GET', headers, cache: 'no-store', signal: options.signal };
  if (options.body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(options.body);
  }
  const resp = await fetch(path, init);
  if (resp.status === 401) {
    throw new Unauthorized('the node refused the token');
  }
  const body = (resp.headers.get('Content-Type') || '').startsWith('application/json') ? await resp.json() : await resp.text();
  if (!resp.ok) {
    // the node's one-line reason, and when it says so, how long to wait (a rate limit)
    const wait = resp.headers.get('Retry-After');
    const err = new Error((body && body.reason ? `${body.reason}: ${body.detail}` : `HTTP ${resp.status}`)
      + (wait ? ` (try again in ${wait} s)` : ''));
    err.status = resp.status;
    err.reason = body && body.reason;
    throw err;
  }
  return body;
}

// -- small DOM helpers ------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === 'class') node.className = v;
    else if (k === 'text') node.textContent = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

const short = (did) => (typeof did === 'string' && did.length > 28 ? did.slice(0, 18) + '…' + did.slice(-6) : String(did ?? ''));
const fmt = (v) => (v === null || v === undefined ? '–' : Array.isArray(v) ? v.join(', ') : String(v));

function didLink(did) {
  // href="#" keeps it a link (focusable, Enter opens it); the click never navigates
  return el('a', { href: '#', text: short(did), title: did, 'data-did': did, onclick: (event) => {
    event.preventDefault();
    openContainer(did).then(() => $('container-panel').scrollIntoView({ block: 'start' }));
  } });
}

function facts(target, pairs) {
  target.replaceChildren();
  for (const [k, v] of pairs) {
    target.append(el('dt', { text: k }), el('dd', {}, v instanceof Node ? v : fmt(v)));
  }
}

const NOTHING_YET = 'nothing yet';

// The one way an empty table, list or box says so: a row, item or paragraph of class
// "empty" reading "nothing yet" (the browser test looks for it in every panel).
function nothingYet(target) {
  const tag = target.tagName;
  if (tag === 'TBODY' || tag === 'TABLE') {
    const head = (tag === 'TBODY' ? target.parentElement : target).tHead;
    const td = el('td', { text: NOTHING_YET });
    if (head) td.setAttribute('colspan', head.rows[0].cells.length);
    target.append(el('tr', { class: 'empty' }, td));
  } else {
    target.append(el(tag === 'OL' || tag === 'UL' ? 'li' : 'p', { class: 'empty', text: NOTHING_YET }));
  }
}

// replace `target`'s children with `nodes`, or say that there is nothing yet
function fill(target, nodes) {
  target.replaceChildren(...nodes);
  if (!nodes.length) nothingYet(target);
}

function rows(tbody, items, cells) {
  fill(tbody, items.map((item) => el('tr', {}, ...cells(item).map((c) => el('td', {}, c instanceof Node ? c : fmt(c))))));
}

// -- times for a human: the local date and time, and how long ago ---------------------------

const localTime = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });

function ago(ms) {
  const s = Math.round(Math.abs(ms) / 1000);
  const span = s < 45 ? null : s < 3600 ? `${Math.round(s / 60)} min` : s < 86400 ? `${Math.round(s / 3600)} h`
    : s < 86400 * 60 ? `${Math.round(s / 86400)} d` : `${Math.round(s / (86400 * 30))} months`;
  if (!span) return 'just now';
  return ms >= 0 ? `${span} ago` : `in ${span}`;
}

const timeText = (t) => `${localTime.format(t)} (${ago(Date.now() - t)})`;

// a <time>: "5 Dec 2026, 04:10 (2 h ago)", the node's exact RFC 3339 text in its title
function when(ts) {
  const t = Date.parse(ts);
  if (typeof ts !== 'string' || Number.isNaN(t)) return el('span', { text: fmt(ts) });
  return el('time', { class: 'ago', datetime: ts, title: ts, text: timeText(t) });
}

// "just now" becomes "5 min ago" as the page stays open
function ageTimes() {
  for (const node of document.querySelectorAll('time.ago')) node.textContent = timeText(Date.parse(node.dateTime));
}

// who sent it: "you" for this node's agent, else the short DID (the full one in the title)
function sender(did) {
  if (did && did === selfDid) return el('span', { class: 'you', title: did, text: 'you' });
  return el('span', { class: 'did', title: did || '', text: short(did) });
}

// -- panels --------------------------------------------------------------------------

// "public at 203.0.113.7 (ports kept)": the verdict and where peers see us (docs/protocol.md 34.1, 34.2)
function reachability(r) {
  if (!r) return null;
  const seen = r.public_addresses.length ? ` at ${r.public_addresses.join(', ')}` : '';
  const ports = r.port_preserving === null ? '' : r.port_preserving ? ' (ports kept)' : ' (ports changed)';
  return `${r.verdict}${seen}${ports}`;
}

async function loadStatus() {
  const s = await api('/v1/status');
  selfDid = s.did;
  $('node-did').textContent = s.did || '';
  const mesh = s.mesh || {};
  const store = s.store || {};
  facts($('status'), [
    ['agent', s.did], ['version', s.api && s.api.version], ['up (s)', s.uptime_seconds],
    ['containers', store.containers], ['links', store.links], ['evaluations', store.evaluations],
    ['peer port', mesh.peer_port], ['DHT port', mesh.dht_port], ['addresses', mesh.addresses],
    ['reachability', reachability(mesh.reachability)],
    ['roles', mesh.roles], ['connected peers', mesh.connected], ['known peers', mesh.known_peers],
    ['outbox', mesh.outbox], ['relay held', mesh.relay && mesh.relay.held],
    ['event streams', s.api && s.api.event_subscribers],
    ['ingest / s', s.api && s.api.ingest_rate_per_second],
    ['loop lag max (s)', s.loop_lag_seconds && s.loop_lag_seconds.max],
  ]);
  const flat = (prefix, obj) => Object.entries(obj || {}).filter(([, v]) => typeof v === 'number').map(([k, v]) => [prefix + k, v]);
  const counters = [...flat('', s.ingest), ...flat('rejected.', s.rejected), ...flat('refused.', s.refused),
    ...flat('mesh.', mesh.counters)];
  fill($('counters'), counters.map(([k, v]) => el('tr', {}, el('th', { text: k }), el('td', { text: String(v) }))));
  $('outbox-count').textContent = mesh.outbox !== undefined ? `(${mesh.outbox})` : '';
  $('relay-count').textContent = mesh.relay ? `(${mesh.relay.held} held, ${mesh.relay.bytes} bytes)` : '';
}

async function loadPeers() {
  const { peers } = await api('/v1/peers');
  rows($('peers').tBodies[0], peers, (p) => [
    el('span', { class: 'did', text: short(p.did), title: p.did }), p.connected ? 'yes' : 'no', link(p),
    p.addresses || p.ip, p.roles, p.score, p.last_contact || p.last_seen, p.static ? 'yes' : '', wants(p),
  ]);
}

// what a connected peer declared it wants (docs/protocol.md 33) and how many broadcasts of
// ours that kept from it on this connection
function wants(p) {
  if (!p.connected) return '';
  if (!p.interests) return 'everything';
  const what = p.interests.mode === 'everything' ? 'everything' : 'declared';
  return el('span', { title: JSON.stringify(p.interests), text: `${what}, ${p.interests_withheld || 0} withheld` });
}

// how a connected peer is reached: direct, or through a circuit relay (docs/protocol.md 34.3),
// with the last hole punch's outcome (34.4)
function link(p) {
  if (!p.connected) return '';
  const punch = p.punch ? ` (punch ${p.punch.state}${p.punch.reason ? ': ' + p.punch.reason : ''})` : '';
  if (!p.via) return 'direct' + punch;
  return el('span', { title: p.via, text: `relayed via ${short(p.via)}${punch}` });
}

// static peers (/v1/peers/static): kept connected by the node; those of its configuration
// cannot be removed here (the node says so), those added here survive its restarts
async function loadStaticPeers() {
  const { static: entries, max } = await api('/v1/peers/static');
  $('static-count').textContent = `(${entries.length} of at most ${max})`;
  rows($('static-peers').tBodies[0], entries, (p) => [
    el('span', { class: 'did', text: p.spec, title: p.spec }),
    el('span', { class: 'did', text: short(p.did || p.seen_did), title: p.did || p.seen_did || '' }),
    p.connected ? 'yes' : 'no', p.failures,
    p.configured ? 'configured' : el('button', { type: 'button', text: 'Remove', 'data-spec': p.spec,
      onclick: () => changeStatic('DELETE', p.spec) }),
  ]);
}

async function changeStatic(method, peer) {
  $('static-error').textContent = '';
  try {
    await api('/v1/peers/static', { method, body: { peer } });
    if (method === 'POST') $('static-spec').value = '';
    await Promise.all([loadStaticPeers(), loadPeers()]);
  } catch (err) {
    if (err instanceof Unauthorized) return signOut(err.message);
    $('static-error').textContent = err.message;
  }
}

async function loadQueues() {
  const q = await api('/v1/mesh/queues?limit=100');
  rows($('outbox').tBodies[0], q.outbox, (o) => [didLink(o.did), short(o.recipient), o.tries, o.next_attempt]);
  rows($('relay').tBodies[0], q.relay, (r) => [didLink(r.did), short(r.recipient), short(r.sender), r.size, r.until]);
}

let journalSeen = null;         // newest entry at the last full verification

async function loadJournal(force = false) {
  // Entries come from the node's cached check (cheap); the full verification (every
  // signature and link, O(entries)) runs on sign-in, when the entries changed, or on demand.
  const { entries } = await api('/v1/journal/load?max_tokens=4000&include_routine=true');
  fill($('journal'), entries.slice().reverse().map((e) => el('li', {},
    el('strong', { text: `#${e.journal_seq} ` }), el('span', { text: e.title ? e.title + ' – ' : '' }),
    el('span', { text: e.content }), el('div', { class: 'did' }, when(e.timestamp), el('span', { text: ` ${e.novelty} ` }), didLink(e.did)))));
  const newest = entries.length ? entries[entries.length - 1].did : '';
  if (!force && newest === journalSeen) return;
  const report = await api('/v1/journal/verify');
  journalSeen = newest;
  const state = $('journal-state');
  state.dataset.state = report.ok ? 'ok' : 'broken';
  state.textContent = report.ok ? `verified: ${report.count} entries` : `broken after ${report.count} entries`;
  const problem = report.first_problem;
  $('journal-problem').textContent = problem ? `${problem.kind} at entry ${problem.index}: ${problem.detail}` : '';
}

async function refresh() {
  ageTimes();
  const results = await Promise.allSettled([loadStatus(), loadPeers(), loadStaticPeers(), loadQueues(), loadJournal(),
    loadInterests(), loadMeshGraph(), loadHistory()]);  // the last two: graph.js, charts.js
  for (const r of results) {
    if (r.status === 'rejected') {
      if (r.reason instanceof Unauthorized) return signOut(r.reason.message);
      console.warn('dashboard refresh:', r.reason && r.reason.message);
    }
  }
}

// -- the live feed (SSE read with fetch(): EventSource cannot send Authorization) ----------

function feedState(state, text) {
  const badge = $('feed-state');
  badge.dataset.state = state;
  badge.textContent = text;
}

function addToFeed(item, live) {
  if (seen.has(item.did)) return;
  seen.add(item.did);
  const head = (item.container && item.container.hmp_container && item.container.hmp_container.head) || {};
  const out = head.sender_did === selfDid;
  const li = el('li', { 'data-did': item.did, class: live ? 'live' : '' },
    el('span', { class: 'dir ' + (out ? 'dir-out' : 'dir-in'), text: out ? 'out' : 'in' }), ' ',
    el('strong', { text: head.class || '?' }), ' ', didLink(item.did),
    el('div', { class: 'did' }, 'from ', sender(head.sender_did), ` · ${item.source} · `, when(item.received)));
  const list = $('feed');
  for (const placeholder of list.querySelectorAll(':scope > li.empty')) placeholder.remove();
  if (live) list.prepend(li); else list.append(li);
  while (list.children.length > FEED_MAX) list.lastElementChild.remove();
}

function parseEvent(block) {
  let id = null, event = 'message';
  const data = [];
  for (const line of block.split('\n')) {
    if (line.startsWith(':')) continue;
    const i = line.indexOf(':');
    const field = i < 0 ? line : line.slice(0, i);
    const value = i < 0 ? '' : line.slice(i + 1).replace(/^ /, '');
    if (field === 'id') id = value;
    else if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  return { id, event, data: data.join('\n') };
}

async function runFeed() {
  feedAbort = new AbortController();
  const { signal } = feedAbort;
  let lastId = null;
  let wait = 500;
  while (!signal.aborted) {
    try {
      const headers = { Authorization: 'Bearer ' + token(), Accept: 'text/event-stream' };
      if (lastId) headers['Last-Event-ID'] = lastId;
      const resp = await fetch('/v1/events', { headers, signal, cache: 'no-store' });
      if (resp.status === 401) return signOut('the node refused the token');
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      feedState('live', 'feed live');
      wait = 500;
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, '\n');
        let cut;
        while ((cut = buffer.indexOf('\n\n')) >= 0) {
          const ev = parseEvent(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
          if (ev.event === 'container' && ev.data) {
            if (ev.id) lastId = ev.id;
            addToFeed(JSON.parse(ev.data), true);
          }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      console.warn('event feed:', err.message);
    }
    feedState('error', 'feed reconnecting');
    await new Promise((r) => setTimeout(r, wait));
    wait = Math.min(wait * 2, RETRY_MAX_MS);
  }
}

async function loadRecent() {
  const { items } = await api('/v1/containers?order=desc&limit=30');
  for (const item of items) addToFeed(item, false);
}

// -- one container: payload, links, evaluations, graph -----------------------------------------

function relatedOf(container) {
  const out = [];
  const related = (container.hmp_container && container.hmp_container.related) || {};
  for (const [type, targets] of Object.entries(related)) {
    for (const target of Array.isArray(targets) ? targets : [targets]) {
      if (typeof target === 'string') out.push({ type, did: target });
    }
  }
  return out;
}

function drawGraph(centerDid, outgoing, incoming) {
  // Containers linking to this one on the left, those it links to on the right; an
  // arrow goes from the linking container to the linked one, labelled with the relation.
  const g = $('graph');
  g.replaceChildren();
  const W = 640, H = 360, cx = W / 2, cy = H / 2, PER_SIDE = 10;
  const column = (list, x, side) => list.slice(0, PER_SIDE).map((link, i, all) => (
    { ...link, x, y: all.length === 1 ? cy : 30 + (i * (H - 60)) / (all.length - 1), side }));
  const nodes = [...column(incoming, 90, -1), ...column(outgoing, W - 90, 1)];
  const marker = svg('marker', { id: 'arrow', viewBox: '0 0 10 10', refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: 'auto' });
  marker.append(svg('path', { d: 'M0,0 L10,5 L0,10 z', fill: '#98a2b3' }));
  const defs = svg('defs');
  defs.append(marker);
  g.append(defs);
  for (const n of nodes) {
    const [fx, fy, tx, ty] = n.side > 0 ? [cx, cy, n.x, n.y] : [n.x, n.y, cx, cy];
    const len = Math.hypot(tx - fx, ty - fy) || 1;
    const rFrom = n.side > 0 ? 16 : 12, rTo = n.side > 0 ? 12 : 16;
    g.append(svg('line', {
      class: 'edge', 'data-type': n.type, 'marker-end': 'url(#arrow)',
      x1: fx + ((tx - fx) * rFrom) / len, y1: fy + ((ty - fy) * rFrom) / len,
      x2: tx - ((tx - fx) * rTo) / len, y2: ty - ((ty - fy) * rTo) / len,
    }));
    g.append(svg('text', { class: 'label', x: (fx + tx) / 2, y: (fy + ty) / 2 - 5, 'text-anchor': 'middle' }, n.type));
  }
  const drawNode = (x, y, did, cls) => {
    const group = svg('g', { class: 'node ' + cls, 'data-did': did, transform: `translate(${x},${y})` });
    group.append(svg('title', {}, did), svg('circle', { r: cls === 'center' ? 14 : 10 }),
      svg('text', { y: cls === 'center' ? 32 : 24, 'text-anchor': 'middle' }, '…' + String(did).slice(-10)));
    if (cls !== 'center') group.addEventListener('click', () => openContainer(did));
    g.append(group);
  };
  for (const n of nodes) drawNode(n.x, n.y, n.did, n.side > 0 ? 'outgoing' : 'incoming');
  drawNode(cx, cy, centerDid, 'center');
  const hidden = Math.max(0, incoming.length - PER_SIDE) + Math.max(0, outgoing.length - PER_SIDE);
  if (hidden) g.append(svg('text', { class: 'label', x: cx, y: H - 8, 'text-anchor': 'middle' }, `${hidden} more not drawn`));
  if (!nodes.length) {
    g.append(svg('text', { class: 'label', x: cx, y: cy + 60, 'text-anchor': 'middle' }, 'no links to or from this container'));
  }
}

async function openContainer(did) {
  $('open-did').value = did;
  $('container-error').textContent = '';
  let item;
  try {
    item = await api('/v1/containers/' + encodeURIComponent(did) + '?decrypt=true');
  } catch (err) {
    if (err instanceof Unauthorized) return signOut(err.message);
    $('container').hidden = true;
    $('container-none').hidden = false;
    $('container-error').textContent = err.message;
    return;
  }
  const container = item.container || {};
  const head = (container.hmp_container && container.hmp_container.head) || {};
  const meta = (container.hmp_container && container.hmp_container.meta) || {};
  facts($('container-facts'), [
    ['DID', item.did], ['class', head.class], ['subclass', head.subclass], ['sender', head.sender_did],
    ['time', head.timestamp], ['received', item.received], ['source', item.source],
    ['recipients', head.recipient], ['tags', meta.tags || head.tags], ['expired', item.expired ? 'yes' : 'no'],
    ['encrypted', head.encrypted ? 'yes' : 'no'],
  ]);
  $('container-payload').textContent = item.payload !== undefined
    ? JSON.stringify(item.payload, null, 2)
    : item.payload_error ? `not readable here: ${item.payload_error.reason} (${item.payload_error.detail})` : '–';
  const backlinks = ((container['referenced-by'] || {}).links || []).map((l) => ({ type: l.type, did: l.target }));
  fill($('container-backlinks'), backlinks.map((l) => el('li', {}, el('span', { text: l.type + ' ← ' }), didLink(l.did))));
  const evaluations = (container.evaluations || {}).items || [];
  rows($('container-evaluations').tBodies[0], evaluations, (e) => [short(e.agent_did), e.type, e.value, e.timestamp]);
  drawGraph(item.did, relatedOf(container), backlinks);
  $('container').hidden = false;
  $('container-none').hidden = true;
}

// -- recall, answered for a human (the envelope: hmpnode/memory/recall.py) --------------------

// why the memory gave no answer, for each `abstain` reason of the envelope
const ABSTAIN = {
  no_query_terms: 'the question has no content words, only stop words and filler',
  no_match: 'no stored memory holds any of the question\'s words',
  all_excluded: 'every memory that matched is superseded, expired, contested, revoked or retracted',
  no_relevant_match: 'memories share some words with the question, but none answers it',
  budget_too_small: 'relevant memories exist, but none fits the budget',
};
const EXCLUDED = ['superseded', 'expired', 'contested', 'revoked', 'retracted'];

// the readable text of a payload: its text (with a title), else the JSON
function payloadText(p) {
  if (typeof p === 'string') return p;
  if (p && typeof p === 'object') {
    const body = [p.text, p.content, p.summary].find((v) => typeof v === 'string');
    if (body !== undefined) return typeof p.title === 'string' ? `${p.title}: ${body}` : body;
  }
  return JSON.stringify(p, null, 2);
}

function budgetBar(label, used, max) {
  return el('div', { class: 'budget-row' },
    el('span', { text: label }),
    el('meter', { min: 0, max, value: Math.min(used, max), 'aria-label': label }),
    el('span', { class: 'muted', text: `${used} of ${max}` }));
}

function recallItem(it, w) {
  // w: the item's line of the receipt ("why"): full DIDs, exact time, state, score signals
  const state = w.state || it.s || 'active';
  const meta = el('div', { class: 'recall-meta' },
    el('strong', { text: w.class || it.c || 'note' }), ' ',
    w.timestamp ? when(w.timestamp) : el('span', { text: it.at }), ' · from ',
    w.sender ? sender(w.sender) : el('span', { class: it.by ? 'did' : 'you', text: it.by || 'you' }), ' ',
    el('span', { class: 'badge', 'data-state': state, text: state }));
  if (w.score) {
    meta.append(' ', el('span', { class: 'muted', title: JSON.stringify(w.score),
      text: `confidence ${w.score.confidence} · score ${Number(w.score.total).toFixed(3)}` }));
  }
  return el('li', { 'data-state': state }, meta,
    el('div', { class: 'recall-text', text: payloadText(it.p) }),
    el('div', { class: 'did' }, w.did ? didLink(w.did) : el('span', { text: it.id })));
}

function showRecall(envelope, asked) {
  const why = envelope.why || [];
  fill($('recall-items'), envelope.items.map((it, i) => recallItem(it, why[i] || {})));
  $('recall-items').hidden = Boolean(envelope.abstain);  // an abstention says why in words instead
  const abstain = $('recall-abstain');
  abstain.hidden = !envelope.abstain;
  if (envelope.abstain) {
    const need = envelope.need ? `: even an empty answer needs ${envelope.need[0]} tokens and ${envelope.need[1]} bytes` : '';
    abstain.textContent = `No answer (${envelope.abstain}): ${ABSTAIN[envelope.abstain] || 'the memory abstains'}${need}.`;
  }
  const budget = $('recall-budget');
  const [maxTokens, maxBytes] = envelope.max || asked;
  budget.hidden = !envelope.used;
  budget.replaceChildren(...(envelope.used ? [el('strong', { text: 'budget used' }),
    budgetBar('tokens', envelope.used[0], maxTokens), budgetBar('bytes', envelope.used[1], maxBytes)] : []));
  const counts = [];
  if (envelope.n) counts.push(`${envelope.n[0]} considered, ${envelope.n[1]} relevant, ${envelope.items.length} given`);
  const excluded = (envelope.x || []).map((n, i) => (n ? `${n} ${EXCLUDED[i]}` : null)).filter(Boolean);
  if (excluded.length) counts.push(`left out: ${excluded.join(', ')}`);
  $('recall-counts').textContent = counts.join('; ');
  $('recall-receipt').textContent = JSON.stringify(envelope, null, 2);
  $('recall-raw').hidden = false;
}

async function recall(event) {
  event.preventDefault();
  $('recall-error').textContent = '';
  const asked = [Number($('recall-tokens').value), Number($('recall-bytes').value)];
  try {
    // why: the full receipt (full DIDs, class, state, time: the compact items carry short ids)
    const envelope = await api('/v1/recall', { method: 'POST', body: {
      query: $('recall-query').value, max_tokens: asked[0], max_bytes: asked[1], why: true,
    } });
    showRecall(envelope, asked);
  } catch (err) {
    if (err instanceof Unauthorized) return signOut(err.message);
    $('recall-error').textContent = err.message;
  }
}

// -- interests (/v1/interests; the CLI's `hmpnode interests`): what peers send this node --------

const INTEREST_KINDS = { classes: 'class', tags: 'tag', senders: 'sender', topics: 'topic' };
let interests = null;          // the declaration in force, as GET /v1/interests gave it
let meshless = false;          // the node runs no mesh (it does not start one later): ask no more

async function loadInterests() {
  if (meshless) return;
  let view;
  try {
    view = await api('/v1/interests');
  } catch (err) {
    if (err.reason !== 'mesh_disabled') throw err;
    meshless = true;
    interests = null;
    $('interests-source').textContent = '';
    $('interests-summary').textContent = err.message;
    $('interests-form').hidden = $('interests-actions').hidden = true;
    return fill($('interests').tBodies[0], []);
  }
  interests = view.interests;
  $('interests-form').hidden = $('interests-actions').hidden = false;
  const source = $('interests-source');
  source.textContent = view.source === 'api' ? 'set here or by the CLI' : 'from the configuration';
  source.dataset.state = view.source;
  $('interests-summary').textContent = view.everything
    ? 'Peers send this node every broadcast (nothing declared, or mode everything).'
    : 'Peers send this node only the broadcasts that match one entry (directed containers always arrive).';
  $('interests-mode').value = interests.mode;
  const entries = Object.keys(INTEREST_KINDS).flatMap((kind) => interests[kind].map((entry) => ({ kind, entry })));
  rows($('interests').tBodies[0], entries, ({ kind, entry }) => [
    INTEREST_KINDS[kind], el('span', { class: kind === 'senders' ? 'did' : '', text: entry, title: entry }),
    el('button', { type: 'button', text: 'Remove', onclick: () => changeInterests((d) => {
      d[kind] = d[kind].filter((e) => e !== entry);
    }) }),
  ]);
}

// change the declaration in force (`edit` mutates a copy; null: back to the configuration).
// The node checks it as it checks the CLI's; its one-line reason is shown as it is.
async function changeInterests(edit) {
  $('interests-error').textContent = '';
  try {
    if (edit === null) {
      await api('/v1/interests', { method: 'DELETE' });
    } else {
      const declared = JSON.parse(JSON.stringify(interests || {}));
      edit(declared);
      await api('/v1/interests', { method: 'PUT', body: declared });
    }
    await loadInterests();
    return true;
  } catch (err) {
    if (err instanceof Unauthorized) return signOut(err.message);
    $('interests-error').textContent = err.message;
    await loadInterests().catch(() => {});  // the form shows what is in force, not what was asked
    return false;
  }
}

// -- settings (/v1/config, as `hmpnode config show`): read only -----------------------------------

// where a setting came from, as load_settings names it: "default", the file's path,
// the HMPNODE_* variable, the --flag
function sourceKind(source) {
  if (source === 'default') return 'default';
  if (source.startsWith('HMPNODE_')) return 'env';
  if (source.startsWith('-')) return 'flag';
  return 'file';
}

// a setting's name may break after an underscore (a phone), never inside a word
function settingName(key) {
  const parts = key.split('_');
  return el('span', {}, ...parts.flatMap((part, i) => (i < parts.length - 1 ? [part + '_', el('wbr')] : [part])));
}

function settingValue(value) {
  const text = typeof value === 'string' && value !== '' ? value : JSON.stringify(value);  // "" when empty
  return el('code', { class: text.length <= 24 ? 'whole' : '', text });  // a number or an address stays whole
}

async function loadSettings() {
  let config;
  try {
    config = await api('/v1/config');
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    $('settings-data-dir').textContent = '';
    return fill($('settings'), [el('p', { class: 'error', text: err.message })]);
  }
  $('settings-data-dir').textContent = `data dir: ${config.data_dir}`;
  // one fold per section; those where something is not a default are open
  fill($('settings'), Object.entries(config.settings).map(([section, keys]) => {
    const entries = Object.entries(keys);
    const changed = entries.filter(([, s]) => s.source !== 'default').length;
    const table = el('table', {},
      el('thead', {}, el('tr', {}, el('th', { text: 'setting' }), el('th', { text: 'value' }), el('th', { text: 'from' }))),
      el('tbody'));
    rows(table.tBodies[0], entries, ([key, s]) => [settingName(key), settingValue(s.value), el('span', {},
      el('span', { class: 'badge source', 'data-source': sourceKind(s.source), title: s.source, text: sourceKind(s.source) }),
      s.source === 'default' ? '' : el('span', { class: 'did', text: ` ${s.source}` }))]);
    for (const [i, [key]] of entries.entries()) table.tBodies[0].rows[i].dataset.setting = `${section}.${key}`;
    const fold = el('details', { 'data-section': section },
      el('summary', {}, el('strong', { text: section }),
        el('span', { class: 'muted', text: ` ${entries.length} settings${changed ? `, ${changed} not default` : ''}` })),
      el('div', { class: 'scroll' }, table));
    fold.open = changed > 0;
    return fold;
  }));
}

// the log level in force (/v1/log-level; the CLI's `hmpnode log-level`): changed from the page
// until SIGHUP re-reads the settings or the node restarts
async function loadLogLevel() {
  const { level, levels } = await api('/v1/log-level');
  const select = $('log-level');
  fill(select, levels.map((name) => el('option', { value: name, text: name })));
  select.value = level;
}

async function changeLogLevel() {
  $('log-level-error').textContent = '';
  try {
    await api('/v1/log-level', { method: 'PUT', body: { level: $('log-level').value } });
  } catch (err) {
    if (err instanceof Unauthorized) return signOut(err.message);
    $('log-level-error').textContent = err.message;
  }
  await loadLogLevel().catch((err) => { $('log-level-error').textContent = err.message; });
}

// -- sign in / out ----------------------------------------------------------------------------

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  if (feedAbort) feedAbort.abort();
  clearInterval(refreshTimer);
  feedState('off', 'feed off');
  seen.clear();
  fill($('feed'), []);
  $('node-did').textContent = '';
  selfDid = null;
  journalSeen = null;
  interests = null;
  meshless = false;
  $('app').hidden = true;
  $('sign-out').hidden = true;
  $('login').hidden = false;
  $('login-error').textContent = message || '';
}

async function signIn() {
  try {
    await loadStatus();  // checks the token, and tells which containers are this agent's
  } catch (err) {
    return signOut(err instanceof Unauthorized ? 'the node refused this token' : `the node cannot be reached: ${err.message}`);
  }
  $('login').hidden = true;
  $('app').hidden = false;
  $('sign-out').hidden = false;
  runFeed();
  loadRecent().catch((err) => console.warn('recent containers:', err.message));
  loadSettings().catch((err) => (err instanceof Unauthorized ? signOut(err.message) : console.warn('settings:', err.message)));
  loadLogLevel().catch((err) => (err instanceof Unauthorized ? signOut(err.message) : console.warn('log level:', err.message)));
  await refresh();
  refreshTimer = setInterval(refresh, REFRESH_MS);
}

document.addEventListener('DOMContentLoaded', () => {
  takeFragmentToken();
  $('login-form').addEventListener('submit', (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $('login-token').value.trim());
    $('login-token').value = '';
    signIn();
  });
  $('sign-out').addEventListener('click', () => signOut(''));
  $('refresh').addEventListener('click', refresh);
  $('journal-verify').addEventListener('click', () => loadJournal(true).catch((err) => {
    if (err instanceof Unauthorized) signOut(err.message); else $('journal-problem').textContent = err.message;
  }));
  $('open-form').addEventListener('submit', (event) => { event.preventDefault(); openContainer($('open-did').value.trim()); });
  $('recall-form').addEventListener('submit', recall);
  $('static-form').addEventListener('submit', (event) => { event.preventDefault(); changeStatic('POST', $('static-spec').value.trim()); });
  $('interests-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    const kind = $('interests-kind').value, entry = $('interests-entry').value.trim();
    if (await changeInterests((d) => { if (!d[kind].includes(entry)) d[kind].push(entry); })) $('interests-entry').value = '';
  });
  $('interests-mode').addEventListener('change', () => changeInterests((d) => { d.mode = $('interests-mode').value; }));
  $('interests-clear').addEventListener('click', () => changeInterests((d) => {
    for (const kind of Object.keys(INTEREST_KINDS)) d[kind] = [];
    d.mode = 'selective';
  }));
  $('interests-reset').addEventListener('click', () => changeInterests(null));
  $('log-level').addEventListener('change', changeLogLevel);
  for (const id of ['feed', 'recall-items']) fill($(id), []);
  if (token()) signIn(); else signOut('');
});
