"""The dashboard's page: one self-contained HTML document, inline CSS, SVG and JavaScript (no
CDN, nothing fetched but /dashboard/events from this server). It draws the charts of the
simulator's HTML report (kvserve.sim.html), in its colours, and redraws on each event."""

from __future__ import annotations

import json

from kvserve.sim.html import REPORT_CSS
from kvserve.sim.svg import PALETTE, TIMELINE_COLORS

_SCRIPT = """
const PALETTE = __PALETTE__, COLORS = __COLORS__, MAX = 600;
const data = {t: [], running: [], waiting: [], kv: [], preemptions: [], hit: []};
let updates = 0, requests = [], now = 0;
const NS = "http://www.w3.org/2000/svg";
function el(name, attrs, text) {
  const node = document.createElementNS(NS, name);
  for (const k in attrs) node.setAttribute(k, attrs[k]);
  if (text !== undefined) node.textContent = text;
  return node;
}
function frame(svg, title, x0, x1, y1) {
  svg.replaceChildren();
  const W = 640, H = 240, L = 64, R = 40, T = 28, B = 40, w = W - L - R, h = H - T - B;
  svg.append(el("text", {x: L, y: 16, class: "title"}, title));
  for (let i = 0; i <= 4; i++) {
    const y = T + h - h * i / 4;
    svg.append(el("line", {x1: L, x2: L + w, y1: y, y2: y, class: "grid"}));
    svg.append(el("text", {x: L - 6, y: y + 4, class: "tick", "text-anchor": "end"},
                  +(y1 * i / 4).toPrecision(3)));
  }
  svg.append(el("text", {x: L + w / 2, y: H - 6, class: "label", "text-anchor": "middle"},
                "seconds since the dashboard opened"));
  svg.append(el("text", {x: L, y: H - 22, class: "tick"}, x0.toFixed(1)));
  svg.append(el("text", {x: L + w, y: H - 22, class: "tick", "text-anchor": "end"},
                x1.toFixed(1)));
  const span = Math.max(x1 - x0, 1e-9);
  return {x: v => L + w * (v - x0) / span, y: v => T + h - h * v / Math.max(y1, 1e-9)};
}
function lines(id, title, series, yMax) {
  const svg = document.getElementById(id), t = data.t;
  if (!t.length) return;
  const top = yMax || Math.max(1, ...series.flatMap(s => s[1])) * 1.05;
  const f = frame(svg, title, t[0], t[t.length - 1], top);
  series.forEach(([name, ys], i) => {
    const pts = ys.map((y, j) => f.x(t[j]).toFixed(1) + "," + f.y(y).toFixed(1));
    svg.append(el("polyline", {points: pts.join(" "), fill: "none",
                               stroke: PALETTE[i % PALETTE.length], "stroke-width": 1.6,
                               "data-series": name}));
    svg.append(el("rect", {x: 440 + 100 * i, y: 6, width: 10, height: 10,
                           fill: PALETTE[i % PALETTE.length]}));
    svg.append(el("text", {x: 454 + 100 * i, y: 15, class: "tick"}, name));
  });
}
function timeline() {
  const svg = document.getElementById("timeline"), rows = requests, H = 28 + 40 + 9 * rows.length;
  svg.setAttribute("height", H); svg.setAttribute("viewBox", `0 0 1280 ${H}`);
  svg.replaceChildren(el("text", {x: 64, y: 16, class: "title"},
                         `The ${rows.length} most recent requests`));
  if (!rows.length) return;
  const t0 = Math.min(...rows.map(r => r.arrival)), t1 = Math.max(now, t0 + 1e-3);
  const x = v => 64 + 1176 * (v - t0) / (t1 - t0);
  rows.forEach((r, i) => {
    const y = 28 + 9 * i, end = r.finished ?? now, g = el("g", {class: "request"});
    g.append(el("title", {}, `${r.id}: queued ${((r.scheduled ?? end) - r.arrival).toFixed(3)} s`));
    const spans = [["queue", r.arrival, r.scheduled ?? end],
                   ["prefill", r.scheduled, r.first_token ?? (r.scheduled === null ? null : end)],
                   ["decode", r.first_token, r.first_token === null ? null : end]];
    for (const [a, b] of r.preempted) spans.push(["preempted", a, b ?? end]);
    for (const [kind, a, b] of spans) {
      if (a === null || b === null || b <= a) continue;
      g.append(el("rect", {x: x(a).toFixed(1), y: y, width: Math.max(x(b) - x(a), 0.6).toFixed(1),
                           height: 8, fill: COLORS[kind]}));
    }
    svg.append(g);
  });
  let lx = 1280 - 40 - 4 * 90;
  for (const kind in COLORS) {
    svg.append(el("rect", {x: lx, y: 6, width: 10, height: 10, fill: COLORS[kind]}));
    svg.append(el("text", {x: lx + 14, y: 15, class: "tick"}, kind)); lx += 90;
  }
}
function figures() {
  const last = k => data[k].length ? data[k][data[k].length - 1] : 0;
  document.getElementById("f-running").textContent = last("running");
  document.getElementById("f-waiting").textContent = last("waiting");
  document.getElementById("f-kv").textContent = (100 * last("kv")).toFixed(1) + "%";
  document.getElementById("f-preemptions").textContent = last("preemptions");
  document.getElementById("f-hit").textContent = (100 * last("hit")).toFixed(1) + "%";
}
function redraw() {
  figures();
  lines("kv", "KV cache usage", [["KV usage", data.kv.map(v => 100 * v)]], 100);
  lines("queues", "Running and waiting requests", [["running", data.running],
                                                   ["waiting", data.waiting]]);
  lines("preemptions", "Preemptions (total)", [["preemptions", data.preemptions]]);
  lines("hits", "Prefix cache hit rate", [["hit rate", data.hit.map(v => 100 * v)]], 100);
  timeline();
}
// relative: behind a proxy that serves the server under --root-path too
const source = new EventSource("dashboard/events" + location.search);
source.onmessage = message => {
  const snap = JSON.parse(message.data);
  for (const [t, running, waiting, kv, preemptions, hit] of snap.samples) {
    data.t.push(t); data.running.push(running); data.waiting.push(waiting); data.kv.push(kv);
    data.preemptions.push(preemptions); data.hit.push(hit);
  }
  for (const k in data) if (data[k].length > MAX) data[k].splice(0, data[k].length - MAX);
  requests = snap.requests; now = snap.now; updates += 1;
  document.body.dataset.updates = updates;
  document.body.dataset.steps = data.t.length;
  document.getElementById("status").textContent =
    `live: ${updates} updates, ${data.t.length} steps shown`;
  redraw();
};
source.onerror = () => { document.getElementById("status").textContent = "disconnected"; };
"""

_FIGURES = "".join(
    f'<div class="figure"><span class="muted">{label}</span><b id="f-{key}">-</b></div>'
    for key, label in (("running", "running"), ("waiting", "waiting"), ("kv", "KV usage"),
                       ("preemptions", "preemptions"), ("hit", "prefix hit rate")))

PAGE = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>kvserve dashboard</title><style>" + REPORT_CSS + "</style></head>"
        "<body data-updates=\"0\" data-steps=\"0\"><h1>kvserve dashboard: <span id=\"model\">"
        "__MODEL__</span></h1><p class=\"muted\" id=\"status\">connecting...</p>"
        f"<div class=\"figures\">{_FIGURES}</div>"
        "<h2>Over time</h2><div class=\"grid2\">"
        + "".join(f'<svg id="{name}" xmlns="http://www.w3.org/2000/svg" width="640" '
                  'height="240" viewBox="0 0 640 240"></svg>'
                  for name in ("kv", "queues", "preemptions", "hits"))
        + "</div><h2>Requests over time</h2><p class=\"muted\">grey: queued, amber: prefill "
        "(first scheduled to first token), blue: decode, red: preempted and waiting to "
        "resume.</p><svg id=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"1280\" "
        "height=\"68\"></svg><script>"
        + _SCRIPT.replace("__PALETTE__", json.dumps(list(PALETTE)))
        .replace("__COLORS__", json.dumps(TIMELINE_COLORS))
        + "</script></body></html>\n")
