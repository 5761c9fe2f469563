// Charts of the last hour (GET /v1/history): small SVG line charts, one per group of
// series, x from the oldest point to now, y from 0 to the largest value. A gap (null:
// no rate for the first point) breaks the line. Uses api(), svg(), el(), $() of
// dashboard.js (loaded first), whose refresh() calls loadHistory().
'use strict';

const CHART_W = 320, CHART_H = 150;
const CHART_PAD = { left: 44, right: 8, top: 10, bottom: 22 };
const CHARTS = [
  { title: 'Containers per second', series: [['containers_in', 'in (from peers)'], ['containers_out', 'out (to peers)']] },
  { title: 'Connected peers', series: [['peers_connected', 'peers']] },
  { title: 'Held', series: [['relay_held', 'relay queue'], ['outbox_held', 'outbox']] },
  { title: 'Event-loop lag (s, worst of each point)', series: [['loop_lag_seconds', 'lag']] },
  { title: 'Refusals per second, by reason', refusals: true },
];

// 0, and a round number at or above the largest value
function niceMax(v) {
  if (!(v > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 2.5, 5, 10].map((m) => m * step).find((m) => m >= v);
}

const chartSpan = (s) => (s >= 120 ? `−${Math.round(s / 60)} min` : `−${Math.round(s)} s`);
const num = (v) => (v >= 100 ? String(Math.round(v)) : String(+v.toPrecision(2)));

function drawChart(spec, hist) {
  const lines = spec.refusals
    ? Object.entries(hist.refusals_per_second).map(([reason, values]) => [reason, values])
    : spec.series.map(([key, label]) => [label, hist.series[key]]);
  const figure = el('figure', { class: 'chart' }, el('figcaption', { text: spec.title }));
  const points = hist.ago_seconds.length;
  const values = lines.flatMap(([, vs]) => vs).filter((v) => v !== null);
  if (points < 2 || (spec.refusals && lines.length === 0)) {
    figure.append(el('p', { class: 'empty', text: spec.refusals && points >= 2 ? 'nothing refused' : 'nothing yet' }));
    return figure;
  }
  const span = Math.max(hist.ago_seconds[0], hist.interval_seconds);
  const top = niceMax(Math.max(0, ...values));
  const w = CHART_W - CHART_PAD.left - CHART_PAD.right, h = CHART_H - CHART_PAD.top - CHART_PAD.bottom;
  const x = (a) => CHART_PAD.left + w * (1 - a / span);
  const y = (v) => CHART_PAD.top + h * (1 - v / top);
  const box = svg('svg', { class: 'chart-svg', viewBox: `0 0 ${CHART_W} ${CHART_H}`, role: 'img', 'aria-label': spec.title });
  box.append(svg('line', { class: 'axis', x1: CHART_PAD.left, y1: y(0), x2: CHART_W - CHART_PAD.right, y2: y(0) }));
  box.append(svg('line', { class: 'axis', x1: CHART_PAD.left, y1: y(0), x2: CHART_PAD.left, y2: y(top) }));
  box.append(svg('line', { class: 'grid', x1: CHART_PAD.left, y1: y(top), x2: CHART_W - CHART_PAD.right, y2: y(top) }));
  box.append(svg('text', { class: 'tick', x: CHART_PAD.left - 4, y: y(0), 'text-anchor': 'end', dy: '0.35em' }, '0'));
  box.append(svg('text', { class: 'tick', x: CHART_PAD.left - 4, y: y(top), 'text-anchor': 'end', dy: '0.35em' }, num(top)));
  box.append(svg('text', { class: 'tick', x: CHART_PAD.left, y: CHART_H - 6, 'text-anchor': 'start' }, chartSpan(span)));
  box.append(svg('text', { class: 'tick', x: CHART_W - CHART_PAD.right, y: CHART_H - 6, 'text-anchor': 'end' }, 'now'));
  const legend = el('ul', { class: 'chart-legend' });
  lines.forEach(([label, vs], i) => {
    let d = '', pen = 'M';
    vs.forEach((v, j) => {
      if (v === null) { pen = 'M'; return; }
      d += `${pen}${x(hist.ago_seconds[j]).toFixed(1)},${y(v).toFixed(1)}`;
      pen = 'L';
    });
    if (d) box.append(svg('path', { class: `series series-${i % 7}`, d, 'data-series': label }));
    legend.append(el('li', { class: `series-${i % 7}`, text: label }));
  });
  figure.append(box, legend);
  return figure;
}

async function loadHistory() {
  const hist = await api('/v1/history');
  $('charts').replaceChildren(...CHARTS.map((spec) => drawChart(spec, hist)));
  $('charts-note').textContent = `last ${chartSpan(hist.window_seconds).slice(1)} at most, a point every ${hist.interval_seconds} s`;
}
