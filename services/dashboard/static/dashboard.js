// laswrr dashboard: fetches /api/state and /api/history, follows /api/ws (a WebSocket) when
// live, and draws every chart itself on <canvas> (no library, no build step).
// What each chart last drew is kept in window.laswrrDrawn[pool][node] (the newest point of the
// effective and target curves), so a test in a real browser can check the drawing itself.
"use strict";

const PHASE_COLORS = { active: "#22c55e", recovering: "#3b82f6", draining: "#f59e0b", drained: "#9ca3af",
                       ejected: "#ef4444", removed: "#111827" };
const MARK_COLORS = { capacity: "#7c3aed", drain: "#f59e0b", ejected: "#ef4444", "slow start": "#3b82f6",
                      rejected: "#b91c1c", admin: "#6b7280", active: "#16a34a", removed: "#111827" };
const BAND_COLORS = { interactive: "#dc2626", default: "#2563eb", batch: "#9ca3af" };  // flow control's bands
const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
                 "#9333ea", "#ea580c"];
const M = { left: 44, right: 12, top: 16, axis: 18 };

const app = { mode: null, windowS: 300, offsetMs: 0, at: null, range: [null, null], pools: {}, colors: {},
              dirty: true, loading: false, playing: null, held: null };
window.laswrrDrawn = {};

const $ = (sel, root = document) => root.querySelector(sel);

function color(node) {
  if (!(node in app.colors)) app.colors[node] = PALETTE[Object.keys(app.colors).length % PALETTE.length];
  return app.colors[node];
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

function pool(name) {
  if (!app.pools[name]) {
    app.pools[name] = { series: {}, marks: [], rate: [], table: null, requests: null, el: null,
                        queue: { interactive: [], default: [], batch: [] }, queueNow: null };
  }
  return app.pools[name];
}

function viewEnd() { return app.mode === "live" ? Date.now() + app.offsetMs : app.at; }

function setStatus(text, ok) {
  const el = $("#status");
  el.textContent = text;
  el.className = "status " + (ok ? "ok" : "bad");
}

// -- data ----------------------------------------------------------------------------------------

async function loadAt(atMs) {
  const at = atMs == null ? "" : `at=${Math.round(atMs)}&`;
  const [state, history] = await Promise.all([getJSON(`/api/state?${at}`),
                                              getJSON(`/api/history?${at}window=${app.windowS}`)]);
  applyState(state);
  for (const [name, h] of Object.entries(history.pools)) {
    const p = pool(name);
    p.series = h.series; p.marks = h.marks; p.rate = h.rate;
    if (h.queue) p.queue = h.queue;
  }
  app.dirty = true;
}

function applyState(state) {
  app.mode = state.mode; app.windowS = state.window_s; app.range = state.range_ms;
  if (state.mode === "live") app.offsetMs = state.at_ms - Date.now(); else app.at = state.at_ms;
  $("#mode").textContent = state.mode === "live" ? "live" : "recorded log";
  $("#source").textContent = state.source;
  for (const [name, s] of Object.entries(state.pools)) {
    const p = pool(name);
    p.table = s; p.requests = s.requests;
    if (s.queue) p.queueNow = s.queue;
  }
}

function onSnapshot(s) {
  const p = pool(s.pool);
  p.table = { ...s, requests: p.requests };
  for (const n of s.nodes) {
    (p.series[n.node] ||= []).push([s.ts_ms, n.effective_weight, n.target_weight, n.inflight, n.phase]);
  }
  app.dirty = true;
}

function onRequests(r) {
  const p = pool(r.pool);
  p.requests = r;
  if (r.queue) {
    p.queueNow = r.queue;
    for (const [band, depth] of Object.entries(r.queue)) (p.queue[band] ||= []).push([r.at_ms, depth]);
  }
  for (const bin of r.rate) {
    const i = p.rate.findIndex((b) => b[0] === bin[0]);
    if (i >= 0) p.rate[i] = bin; else p.rate.push(bin);
  }
  app.dirty = true;
}

// The live push: a WebSocket (/api/ws). The page first draws what /api/state and /api/history
// hold (on load), then follows; a WebSocket does not keep the page "loading" as an EventSource
// would, so a headless capture (--virtual-time-budget) returns with the page drawn.
const HANDLERS = {
  snapshot: (d) => onSnapshot(d),
  mark: (m) => {
    const marks = pool(m.pool).marks;
    if (!marks.some((k) => k[0] === m.ts_ms && k[1] === m.node && k[3] === m.text)) {
      marks.push([m.ts_ms, m.node, m.kind, m.text]);
    }
    app.dirty = true;
  },
  requests: (r) => onRequests(r),
};

// Every (re)connect starts with hello: refetch what was missed meanwhile. Pushes that arrive
// while that refetch is under way are held and applied after it, so none is lost under it.
function onHello() {
  app.held = [];
  loadAt(null).then(() => setStatus("live", true), (e) => setStatus(`error: ${e.message}`, false)).finally(() => {
    const held = app.held || [];
    app.held = null;
    for (const [event, data] of held) HANDLERS[event](data);
  });
}

function connect() {
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/api/ws`);
  ws.onmessage = (ev) => {
    const { event, data } = JSON.parse(ev.data);
    if (event === "hello") onHello();
    else if (!(event in HANDLERS)) return;
    else if (app.held) app.held.push([event, data]);
    else HANDLERS[event](data);
  };
  ws.onclose = () => { setStatus("reconnecting…", false); setTimeout(connect, 2000); };
}

function trim(p, start) {
  for (const [node, points] of Object.entries(p.series)) {
    let i = 0;
    while (i < points.length - 1 && points[i + 1][0] < start) i++;
    if (i) points.splice(0, i);  // keeps one point before the window, so the curve starts at its edge
    if (!points.length) delete p.series[node];
  }
  p.marks = p.marks.filter((m) => m[0] >= start);
  p.rate = p.rate.filter((b) => b[0] >= start - 1000);
  for (const points of Object.values(p.queue)) {
    let i = 0;
    while (i < points.length - 1 && points[i + 1][0] < start) i++;
    if (i) points.splice(0, i);
  }
}

// -- drawing ---------------------------------------------------------------------------------------

function canvas2d(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const cssH = Number(canvas.dataset.h || canvas.getAttribute("height"));
  canvas.dataset.h = cssH;
  const cssW = canvas.clientWidth || 900;
  canvas.style.height = cssH + "px";
  canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  ctx.font = "11px system-ui, sans-serif";
  canvas.laswrrLabels = [];
  return { ctx, w: cssW, h: cssH };
}

function timeAxis(ctx, x, t0, t1, y, w, left) {
  ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#eef0f3";
  const span = (t1 - t0) / 1000;
  const step = [5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600].find((s) => span / s <= 8) || 7200;
  for (let t = Math.ceil(t0 / 1000 / step) * step * 1000; t <= t1; t += step * 1000) {
    ctx.beginPath(); ctx.moveTo(x(t), M.top); ctx.lineTo(x(t), y); ctx.stroke();
    // a label is never cut by the canvas edge or drawn over the value axis: near an edge it is
    // aligned to it instead of centred on its tick
    const label = new Date(t).toLocaleTimeString([], { hour12: false });
    const half = ctx.measureText(label).width / 2;
    const cx = Math.min(Math.max(x(t), left + half), w - 1 - half);
    ctx.textAlign = "center";
    ctx.fillText(label, cx, y + 12);
    labelBoxes(ctx).push({ kind: "time", x0: cx - half, x1: cx + half, y0: y + 2, y1: y + 14 });
  }
}

function axisLabel(v) { return Number(v.toFixed(1)).toString(); }

// The left margin that fits the value axis' widest label (never cut, however large the values).
function leftMargin(ctx, max) {
  return Math.max(M.left, Math.ceil(ctx.measureText(axisLabel(max)).width) + 10);
}

function valueAxis(ctx, yOf, max, w, left) {
  ctx.textAlign = "right"; ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#eef0f3";
  for (const v of [0, max / 2, max]) {
    ctx.beginPath(); ctx.moveTo(left, yOf(v)); ctx.lineTo(w - M.right, yOf(v)); ctx.stroke();
    const text = axisLabel(v), width = ctx.measureText(text).width;
    ctx.fillText(text, left - 4, yOf(v) + 4);
    labelBoxes(ctx).push({ kind: "value", x0: left - 4 - width, x1: left - 4, y0: yOf(v) - 6, y1: yOf(v) + 5 });
  }
}

// Every label drawn on a canvas, as a box in CSS pixels (tests check none is cut or overlaps).
function labelBoxes(ctx) { return (ctx.canvas.laswrrLabels ||= []); }

function visible(points, t0) {
  let i = 0;
  while (i < points.length - 1 && points[i + 1][0] < t0) i++;
  return points.slice(i);
}

function line(ctx, points, x, yOf, index, width, dash, stepped, left, dashOffset = 0) {
  if (!points.length) return;
  ctx.lineWidth = width; ctx.setLineDash(dash); ctx.lineDashOffset = dashOffset; ctx.beginPath();
  points.forEach((pt, i) => {
    const px = Math.max(left, x(pt[0])), py = yOf(pt[index]);
    if (i === 0) ctx.moveTo(px, py);
    else if (stepped) { ctx.lineTo(px, yOf(points[i - 1][index])); ctx.lineTo(px, py); }
    else ctx.lineTo(px, py);
  });
  ctx.stroke(); ctx.setLineDash([]); ctx.lineDashOffset = 0;
}

const BAND = 12, LABEL_ROWS = 3, ROW = 12;

function drawWeights(name, p, canvas, t0, t1) {
  canvas.dataset.h = 240 + Object.keys(p.series).length * BAND + ROW * (LABEL_ROWS - 1);  // room for every band
  const { ctx, w, h } = canvas2d(canvas);
  const nodes = Object.keys(p.series).sort();
  const top = M.top + ROW * (LABEL_ROWS - 1);  // room above the curves for event labels in rows
  const bottom = h - M.axis - nodes.length * BAND - 4;
  let max = 1;
  const shown = {};
  for (const node of nodes) {
    shown[node] = visible(p.series[node], t0);
    for (const pt of shown[node]) max = Math.max(max, pt[1], pt[2]);
  }
  max *= 1.1;
  const left = leftMargin(ctx, max);
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (w - left - M.right);
  const yOf = (v) => bottom - (v / max) * (bottom - top);
  valueAxis(ctx, yOf, max, w, left);
  timeAxis(ctx, x, t0, t1, h - M.axis, w, left);
  const drawn = (window.laswrrDrawn[name] = {});
  const present = new Set((p.table?.nodes || []).map((n) => n.node));
  const removedAt = {};
  for (const [t, node, kind] of p.marks) if (kind === "removed") removedAt[node] = t;
  nodes.forEach((node) => {
    ctx.strokeStyle = color(node);
    line(ctx, shown[node], x, yOf, 2, 1.2, [5, 4], false, left);
    line(ctx, shown[node], x, yOf, 1, 2.4, [], false, left);
  });
  // Nodes of equal weight draw one line over another: each effective line is drawn again in
  // dashes of its own colour, offset per node, so a shared line shows every colour in turn.
  nodes.forEach((node, k) => {
    ctx.strokeStyle = color(node);
    line(ctx, shown[node], x, yOf, 1, 2.4, [6, 6 * (nodes.length - 1)], false, left, -6 * k);
  });
  nodes.forEach((node, k) => {
    const pts = shown[node];
    const y = bottom + 4 + k * BAND;  // the phase band of this node: one rectangle per run of a phase
    // a node gone from the latest snapshot (removed) has its band end where it was removed
    const end = present.has(node) || !pts.length ? t1 : Math.min(t1, removedAt[node] ?? pts[pts.length - 1][0]);
    let bandEnd = null;
    for (let i = 0; i < pts.length;) {
      let j = i + 1;
      while (j < pts.length && pts[j][4] === pts[i][4]) j++;
      const from = Math.max(left, x(pts[i][0])), to = j < pts.length ? x(pts[j][0]) : x(end);
      ctx.fillStyle = PHASE_COLORS[pts[i][4]] || "#d1d5db";
      ctx.fillRect(from, y, Math.max(1, to - from), BAND - 2);
      bandEnd = Math.max(from + 1, to);
      i = j;
    }
    if (pts.length) {  // the node's name on its band, in its line colour's swatch
      const from = Math.max(left, x(pts[0][0]));
      ctx.fillStyle = color(node); ctx.fillRect(from, y, 4, BAND - 2);
      ctx.font = "9px system-ui, sans-serif"; ctx.textAlign = "left"; ctx.fillStyle = "#111827";
      ctx.fillText(node, from + 6, y + BAND - 4);
      ctx.font = "11px system-ui, sans-serif";
    }
    const last = pts[pts.length - 1];
    if (last) {
      drawn[node] = { effective: last[1], target: last[2], inflight: last[3], phase: last[4], t: last[0],
                      y_px: yOf(last[1]), band: { y, label: node, end_ms: end, end_px: bandEnd } };
    }
  });
  // Event markers: a line each; labels in up to LABEL_ROWS rows, each in the first row where it
  // overlaps no other label (a label that fits nowhere is left out: the event list has it).
  const rows = Array(LABEL_ROWS).fill(-Infinity);
  const labels = [];
  for (const [t, node, kind, text] of p.marks) {
    if (t < t0 || t > t1) continue;
    const px = x(t);
    ctx.strokeStyle = MARK_COLORS[kind] || "#6b7280"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, bottom); ctx.stroke();
    const label = markLabel(kind, node, text);
    const width = ctx.measureText(label).width;
    const x0 = Math.max(left, Math.min(px + 2, w - 1 - width));  // never past the canvas edge
    const row = rows.findIndex((right) => x0 > right + 6);
    if (row < 0) continue;
    rows[row] = x0 + width;
    const y = M.top - 4 + row * ROW;
    ctx.fillStyle = ctx.strokeStyle; ctx.textAlign = "left";
    ctx.fillText(label, x0, y);
    labels.push({ label, t });
    labelBoxes(ctx).push({ kind: "mark", x0, x1: x0 + width, y0: y - 10, y1: y + 1 });
  }
  drawn.__labels = labels;
  canvas.dataset.drawn = JSON.stringify(drawn);
}

// An event marker's label: what happened and to which node; a capacity change shows the new value.
function markLabel(kind, node, text) {
  const capacity = kind === "capacity" && /capacity set to (\d+)/.exec(text);
  if (capacity) return `capacity ${node} → ${capacity[1]}`;
  return `${kind}${node ? " " + node : ""}`;
}

function drawInflight(p, canvas, t0, t1) {
  const { ctx, w, h } = canvas2d(canvas);
  const bottom = h - M.axis;
  let max = 1;
  const nodes = Object.keys(p.series).sort();
  for (const node of nodes) for (const pt of visible(p.series[node], t0)) max = Math.max(max, pt[3]);
  const left = leftMargin(ctx, max);
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (w - left - M.right);
  const yOf = (v) => bottom - (v / (max * 1.1)) * (bottom - M.top);
  valueAxis(ctx, yOf, max, w, left);
  timeAxis(ctx, x, t0, t1, bottom, w, left);
  nodes.forEach((node, k) => {
    ctx.strokeStyle = color(node);
    line(ctx, visible(p.series[node], t0), x, yOf, 3, 1.6, [], true, left);
    line(ctx, visible(p.series[node], t0), x, yOf, 3, 1.6, [6, 6 * (nodes.length - 1)], true, left, -6 * k);
  });
}

// Flow control's held requests per band, every proxy's (the log's lb.req.queued and what ended
// each); what it drew last is in canvas.dataset.drawn ({band: depth}) for tests.
function drawQueue(p, canvas, t0, t1) {
  const { ctx, w, h } = canvas2d(canvas);
  const bottom = h - M.axis;
  let max = 1;
  const bands = Object.keys(BAND_COLORS);
  for (const band of bands) for (const pt of visible(p.queue[band] || [], t0)) max = Math.max(max, pt[1]);
  const left = leftMargin(ctx, max);
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (w - left - M.right);
  const yOf = (v) => bottom - (v / (max * 1.1)) * (bottom - M.top);
  valueAxis(ctx, yOf, max, w, left);
  timeAxis(ctx, x, t0, t1, bottom, w, left);
  const drawn = {};
  bands.forEach((band, k) => {
    const points = visible(p.queue[band] || [], t0);
    const last = points.length ? points[points.length - 1] : null;
    const upto = last && last[0] < t1 ? [...points, [t1, last[1]]] : points;  // the depth holds until now
    ctx.strokeStyle = BAND_COLORS[band];
    line(ctx, upto, x, yOf, 1, 1.8, [], true, left);
    // bands of equal depth share one line drawn in all their colours (as the in-flight chart does)
    line(ctx, upto, x, yOf, 1, 1.8, [6, 6 * (bands.length - 1)], true, left, -6 * k);
    drawn[band] = last ? last[1] : 0;
  });
  canvas.dataset.drawn = JSON.stringify(drawn);
}

function renderQueue(el, depth) {
  const now = depth || { interactive: 0, default: 0, batch: 0 };
  $(".queue-now", el).innerHTML = "held now: " + Object.keys(BAND_COLORS)
    .map((b) => `<span data-band="${b}"><i style="background:${BAND_COLORS[b]}"></i>${b} <b>${now[b] ?? 0}</b></span>`)
    .join(" · ");
}

function drawRate(p, canvas, t0, t1) {
  const { ctx, w, h } = canvas2d(canvas);
  const bottom = h - M.axis;
  const bins = p.rate.filter((b) => b[0] >= t0 - 1000 && b[0] <= t1);
  const max = Math.max(1, ...bins.map((b) => b[1] + b[2]));
  const left = leftMargin(ctx, max);
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (w - left - M.right);
  const yOf = (v) => bottom - (v / (max * 1.1)) * (bottom - M.top);
  valueAxis(ctx, yOf, max, w, left);
  timeAxis(ctx, x, t0, t1, bottom, w, left);
  const width = Math.max(1, x(t0 + 1000) - x(t0) - 1);
  for (const [t, ok, bad] of bins) {
    const px = Math.max(left, x(t));
    ctx.fillStyle = "#22c55e"; ctx.fillRect(px, yOf(ok), width, bottom - yOf(ok));
    ctx.fillStyle = "#ef4444"; ctx.fillRect(px, yOf(ok + bad), width, yOf(ok) - yOf(ok + bad));
  }
}

// -- the page --------------------------------------------------------------------------------------

const fmt = (v, digits = 2) => (v == null ? "—" : Number(v).toFixed(digits));
const ms = (v) => (v == null ? "—" : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${Math.round(v)} ms`);

function section(name, p) {
  if (p.el) return p.el;
  const el = $("#pool-template").content.firstElementChild.cloneNode(true);
  el.dataset.pool = name;
  $(".pool-name", el).textContent = `pool ${name}`;
  const sections = [...document.querySelectorAll("section.pool")].map((s) => s.dataset.pool);
  const after = sections.filter((s) => s < name).pop();
  if (after) document.querySelector(`section.pool[data-pool="${CSS.escape(after)}"]`).after(el);
  else $("#pools").prepend(el);
  const empty = $("#empty");
  if (empty) empty.remove();
  return (p.el = el);
}

function renderTable(el, table) {
  const body = $("tbody", el);
  const rows = table.nodes.map((n) => {
    const cells = [
      `<td class="node"><span class="swatch" style="background:${color(n.node)}"></span>${n.node}</td>`,
      `<td class="phase"><span class="swatch" style="background:${PHASE_COLORS[n.phase] || "#ccc"}"></span>${n.phase}</td>`,
      `<td>${n.routable ? "yes" : "no"}</td>`, `<td>${n.chip}</td>`, `<td class="capacity">${n.capacity}</td>`,
      `<td>${fmt(n.slots, 1)}</td>`,
      `<td class="free-slots">${n.free_slots == null ? "—" : n.free_slots}</td>`,
      `<td class="free-blocks">${n.free_blocks == null ? "—" : n.free_blocks}</td>`,
      `<td class="target">${fmt(n.target_weight)}</td>`,
      `<td class="effective">${fmt(n.effective_weight)}</td>`, `<td class="inflight">${n.inflight}</td>`,
      `<td>${fmt(n.load)}</td>`,
      `<td>${n.sample_age_ms == null ? "—" : (n.sample_age_ms / 1000).toFixed(1) + " s"}${n.stale ? " (stale)" : ""}</td>`,
      `<td>${n.npu_health || "—"}</td>`];
    return `<tr data-node="${n.node}">${cells.join("")}</tr>`;
  });
  body.innerHTML = rows.join("");
  $(".panic", el).hidden = !table.panic;
  $(".pool-seq", el).textContent = table.as_of_seq == null ? "" : `as_of_seq ${table.as_of_seq}`;
}

function renderRequests(el, r) {
  if (!r) return;
  const outcomes = Object.entries(r.outcomes).map(([k, v]) => `${k} <b>${v}</b>`).join(" · ") || "none";
  const answers = Object.entries(r.answers || {}).map(([k, v]) => `${k} <b>${v}</b>`).join(" · ") || "none";
  $(".requests", el).innerHTML =
    `<span>rate <b>${fmt(r.rate_per_s, 1)}/s</b> (last ${r.window_s} s)</span><span>${outcomes}</span>` +
    `<span class="answers">answers: ${answers}</span>` +
    `<span>TTFT P50 <b>${ms(r.ttft_ms.p50)}</b> P99 <b>${ms(r.ttft_ms.p99)}</b></span>` +
    `<span>E2E P50 <b>${ms(r.e2e_ms.p50)}</b> P99 <b>${ms(r.e2e_ms.p99)}</b></span>`;
}

function render() {
  app.dirty = false;
  const t1 = viewEnd();
  if (t1 == null) return;
  // The window ends at the view's time and reaches back --window-s, or to the first data there is
  // (a short log or a young stack fills the width), but never less than 30 s.
  const first = Math.min(...Object.values(app.pools).flatMap((p) => Object.values(p.series).map((s) => s[0]?.[0] ?? t1)),
                         app.mode === "live" ? t1 : (app.range[0] ?? t1));
  const t0 = Math.min(t1 - 30000, Math.max(t1 - app.windowS * 1000, first));
  $("#clock").textContent = new Date(t1).toLocaleString([], { hour12: false });
  for (const [name, p] of Object.entries(app.pools)) {
    if (app.mode === "live") trim(p, t0);
    const el = section(name, p);
    if (p.table) renderTable(el, p.table);
    renderRequests(el, p.requests);
    drawWeights(name, p, $("canvas.weights", el), t0, t1);
    drawInflight(p, $("canvas.inflight", el), t0, t1);
    drawRate(p, $("canvas.rate", el), t0, t1);
    drawQueue(p, $("canvas.queue", el), t0, t1);
    renderQueue(el, p.queueNow);
    $(".legend", el).innerHTML = Object.keys(p.series).sort()
      .map((n) => `<span><i style="background:${color(n)}"></i>${n}</span>`).join("");
    $(".marks", el).innerHTML = p.marks.slice(-200).reverse()
      .map(([t, , kind, text]) => `<li>${new Date(t).toLocaleTimeString([], { hour12: false })} <b>${kind}</b> ${text}</li>`)
      .join("");
  }
}

// -- recorded log: the scrubber ----------------------------------------------------------------------

function scrubTo(atMs) {
  app.at = atMs;
  $("#scrubber").value = atMs;
  $("#scrub-time").textContent = new Date(atMs).toLocaleString([], { hour12: false });
  if (app.loading) { app.pendingAt = atMs; return; }
  app.loading = true;
  loadAt(atMs).catch((e) => setStatus(`error: ${e.message}`, false)).finally(() => {
    app.loading = false;
    if (app.pendingAt != null) { const next = app.pendingAt; app.pendingAt = null; scrubTo(next); }
  });
}

window.laswrrScrub = (atMs) => scrubTo(atMs);  // what dragging the scrubber does, for scripts and tests

function setUpScrubber() {
  const [first, last] = app.range;
  const scrubber = $("#scrubber");
  $("#scrub").hidden = false;
  scrubber.min = first; scrubber.max = last; scrubber.value = app.at;
  $("#scrub-time").textContent = new Date(app.at).toLocaleString([], { hour12: false });
  scrubber.addEventListener("input", () => scrubTo(Number(scrubber.value)));
  $("#play").addEventListener("click", () => {
    if (app.playing) { clearInterval(app.playing); app.playing = null; $("#play").textContent = "▶"; return; }
    if (app.at >= last) scrubTo(first + app.windowS * 1000);
    $("#play").textContent = "⏸";
    app.playing = setInterval(() => {
      const next = Math.min(last, app.at + 250 * Number($("#speed").value));
      scrubTo(next);
      if (next >= last) { clearInterval(app.playing); app.playing = null; $("#play").textContent = "▶"; }
    }, 250);
  });
  setStatus("recorded log", true);
}

async function main() {
  try {
    await loadAt(null);
  } catch (e) {
    setStatus(`error: ${e.message}; retrying`, false);
    setTimeout(main, 2000);
    return;
  }
  if (app.mode === "live") { setStatus("live", true); connect(); } else setUpScrubber();
  setInterval(() => { if (app.dirty || app.mode === "live") requestAnimationFrame(render); }, 250);
  window.addEventListener("resize", () => { app.dirty = true; });
  render();
}

main();
