// Job page: uPlot charts fed by the server's downsampled series, then by live points
// from /ws/jobs/<id>/; learner grid, timeline and status follow the same socket.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { connectLive, fmtBytes, fmtSI, setBadge, toDate } from "./live.js";
import { markersPlugin, renderLegend, tokensAtTime } from "./markers.js";

const JOB = document.getElementById("job-script").dataset.job;
const SUMMED = new Set(["tokens_per_s", "bytes_sent"]);
const MAX_POINTS = 3000;

// name -> {tokens: [], time: [], value: []}, sorted by time
const series = {};
// learner index -> its last reported tokens/s (running learners) and tokens
const learnerRate = {};
const learnerTokens = {};
let livePoints = 0;

function load(raw) {
  for (const k of Object.keys(series)) delete series[k];
  for (const [name, pts] of Object.entries(raw || {})) {
    series[name] = { tokens: pts.map((p) => p[0]), time: pts.map((p) => p[1]), value: pts.map((p) => p[2]) };
  }
}
load(JSON.parse(document.getElementById("chart-data").textContent));

// Latest per-learner value of summed series, so a live point becomes the job's figure.
const perLearner = {};

function thin(s) {
  if (s.time.length <= MAX_POINTS) return;
  const half = Math.floor(s.time.length / 2);
  for (const k of ["tokens", "time", "value"]) {
    const old = s[k].slice(0, half).filter((_, i) => i % 2 === 0);
    s[k] = old.concat(s[k].slice(half));
  }
}

// Learner-level steps count one learner's tokens; the charts' x is the job's tokens (as
// the server's series): scale by the number of learners reporting the series.
const reporters = {};
function jobTokens(p) {
  const step = Number(p.step) || 0;
  if (p.learner === null || p.learner === undefined) return step;
  (reporters[p.name] = reporters[p.name] || new Set()).add(p.learner);
  const grid = document.querySelectorAll("#learners tbody tr[data-learner]").length;
  return step * Math.max(reporters[p.name].size, grid, 1);
}
let explicitTps = false;

function addPoint(p) {
  if (typeof p.value !== "number" || !Number.isFinite(p.value)) return;
  const name = p.name;
  if (name === "tokens_per_s") explicitTps = true;
  const t = typeof p.time === "number" ? p.time : (toDate(p.time) || new Date()).getTime() / 1000;
  let value = p.value;
  if (SUMMED.has(name) && p.learner !== null && p.learner !== undefined) {
    perLearner[name] = perLearner[name] || {};
    perLearner[name][p.learner] = value;
    value = Object.values(perLearner[name]).reduce((a, b) => a + b, 0);
  }
  const s = (series[name] = series[name] || { tokens: [], time: [], value: [] });
  // keep time order (points of several learners interleave)
  let i = s.time.length;
  while (i > 0 && s.time[i - 1] > t) i -= 1;
  if (i > 0 && s.time[i - 1] === t) {
    // same instant from another learner: a summed series now holds the new total, the
    // others the mean of the two (uPlot needs distinct x values)
    s.value[i - 1] = SUMMED.has(name) ? value : (s.value[i - 1] + value) / 2;
    livePoints += 1;
    return;
  }
  s.tokens.splice(i, 0, jobTokens(p));
  s.time.splice(i, 0, t);
  s.value.splice(i, 0, value);
  thin(s);
  livePoints += 1;
}

const css = getComputedStyle(document.documentElement);
const color = (v, fallback) => (css.getPropertyValue(v).trim() || fallback);
const COLORS = {
  train_loss: color("--c1", "#2563eb"), val_loss: color("--c2", "#dc2626"),
  tokens_per_s: color("--c3", "#059669"), goodput: color("--c4", "#7c3aed"),
  bytes_sent: color("--c5", "#d97706"),
};
// series without a colour of their own (an island's ranks) take these in turn
const PALETTE = [COLORS.train_loss, COLORS.val_loss, COLORS.tokens_per_s, COLORS.goodput, COLORS.bytes_sent];
const axisColor = color("--muted", "#888");
const gridColor = color("--grid", "rgba(128,128,128,.15)");

function axis(extra = {}) {
  return { stroke: axisColor, grid: { stroke: gridColor, width: 1 }, ticks: { stroke: gridColor }, ...extra };
}

// Aligned data for uPlot: union of x values, null where a series has no point.
function join(names, xKey) {
  const tables = names.map((n) => {
    const s = series[n] || { tokens: [], time: [], value: [] };
    const xs = s[xKey];
    const idx = xs.map((_, i) => i).sort((a, b) => xs[a] - xs[b]);
    return [idx.map((i) => xs[i]), idx.map((i) => s.value[i])];
  });
  return uPlot.join(tables);
}

const charts = [];

// Incidents, learner moves and checkpoints (apps/dashboard/markers.py), drawn on every chart;
// fetched after the first paint (/jobs/<id>/markers.json), so the page's queries stay bounded.
let markers = [];
const markerTokens = (t) => tokensAtTime(series.train_loss || series.val_loss, t);

function makeChart(elId, names, xKey, opts = {}) {
  const el = document.getElementById(elId);
  const seriesOpts = [{ label: xKey === "time" ? "time" : "tokens", value: xKey === "time" ? undefined : (u, v) => fmtSI(v) }];
  for (const n of names) {
    seriesOpts.push({
      label: n.replace(/_/g, " "), stroke: COLORS[n] || PALETTE[(seriesOpts.length - 1) % PALETTE.length],
      width: 1.5, spanGaps: true,
      scale: opts.scales && opts.scales[n] ? opts.scales[n] : "y",
      value: (u, v) => (v === null || v === undefined ? "—" : n === "bytes_sent" ? fmtBytes(v) : fmtSI(v)),
    });
  }
  const axes = [
    axis(xKey === "time" ? {} : { values: (u, vals) => vals.map((v) => fmtSI(v)) }),
    axis({ values: (u, vals) => vals.map((v) => fmtSI(v)), size: 60 }),
  ];
  if (opts.rightAxis) axes.push(axis({ scale: opts.rightAxis, side: 1, size: 70, grid: { show: false },
                                        values: (u, vals) => vals.map((v) => fmtBytes(v)) }));
  // One x value would give uPlot a zero-width range: pad it (30 s of time, or 1 k tokens).
  const pad = xKey === "time" ? 30 : 1000;
  // (uPlot itself widens a single time point to 86400/ms "days", i.e. years in seconds.)
  const xRange = (u, min, max) => {
    const xs = u.data && u.data[0];
    if (!xs || !xs.length || min === null || max === null) {
      const c = xKey === "time" ? Date.now() / 1000 : 0;
      return [c - pad, c + pad];
    }
    if (xs[0] === xs[xs.length - 1]) return [xs[0] - pad, xs[0] + pad];
    if (xKey === "time" && markers.length) {  // a marker after the newest point stays in view
      return [min, Math.max(max, ...markers.map((m) => m.time))];
    }
    return [min, max];
  };
  const u = new uPlot({
    width: Math.max(240, el.clientWidth), height: 220, series: seriesOpts, axes,
    scales: { x: { time: xKey === "time", range: xRange } },
    legend: { live: true },
    cursor: { drag: { x: true, y: false } },
    plugins: [markersPlugin(() => markers, xKey === "time" ? (t) => t : markerTokens)],
  }, join(names, xKey), el);
  const empty = document.createElement("div");
  empty.className = "nodata";
  empty.textContent = "no data yet";
  el.parentElement.append(empty);
  charts.push({ u, el, names, xKey, empty });
}

makeChart("chart-loss-tokens", ["train_loss", "val_loss"], "tokens");
makeChart("chart-loss-time", ["train_loss", "val_loss"], "time");
makeChart("chart-tps", ["tokens_per_s"], "time");
makeChart("chart-goodput", ["goodput", "bytes_sent"], "time",
  { scales: { bytes_sent: "bytes" }, rightAxis: "bytes" });
const ranksEl = document.getElementById("chart-ranks");
if (ranksEl) makeChart("chart-ranks", ranksEl.dataset.names.split(","), "time");

new ResizeObserver(() => {
  for (const c of charts) c.u.setSize({ width: Math.max(240, c.el.clientWidth), height: 220 });
}).observe(document.querySelector(".charts"));

let redrawQueued = false;
function redraw() {
  if (redrawQueued) return;
  redrawQueued = true;
  requestAnimationFrame(() => {
    redrawQueued = false;
    for (const c of charts) {
      c.u.setData(join(c.names, c.xKey));
      c.empty.hidden = c.names.some((n) => series[n] && series[n].value.length);
      c.el.dataset.points = String(c.names.reduce((a, n) => a + (series[n] ? series[n].value.length : 0), 0));
    }
    document.getElementById("live-points").textContent = String(livePoints);
    renderLegend(document.getElementById("marker-legend"), markers);
    const tps = series.tokens_per_s;  // the learners' heartbeats, when known, give the KPI
    if (tps && tps.value.length && !Object.keys(learnerRate).length) {
      document.getElementById("kpi-tokens-per-s").textContent = fmtSI(tps.value.at(-1));
    }
    const val = series.val_loss;
    if (val && val.value.length) document.getElementById("kpi-val-loss").textContent = val.value.at(-1).toPrecision(4);
  });
}
redraw();

// ----------------------------------------------------------------- learner grid
const FIELDS = ["node", "incarnation", "tokens", "tokens_per_s", "work_size", "staleness", "loss", "last_heartbeat"];

function learnerRow(index) {
  const tbody = document.querySelector("#learners tbody");
  let row = tbody.querySelector(`tr[data-learner="${CSS.escape(String(index))}"]`);
  if (row) return row;
  tbody.querySelector("tr.empty")?.remove();
  row = document.createElement("tr");
  row.dataset.learner = String(index);
  const th = document.createElement("th");
  th.scope = "row";
  th.textContent = String(index);
  row.append(th, document.createElement("td"));
  const node = document.createElement("td");
  node.dataset.field = "node";
  const stateTd = document.createElement("td");
  const badge = document.createElement("span");
  badge.dataset.field = "state";
  stateTd.append(badge);
  row.append(node, stateTd);
  for (const f of FIELDS.slice(1)) {
    const td = document.createElement("td");
    td.dataset.field = f;
    if (f !== "last_heartbeat") td.className = "n";
    row.append(td);
  }
  tbody.append(row);
  return row;
}

function onLearnerRate(index, msg) {
  if (typeof msg.tokens === "number") learnerTokens[index] = msg.tokens;
  if (msg.state && msg.state !== "running") delete learnerRate[index];
  else if (typeof msg.tokens_per_s === "number") learnerRate[index] = msg.tokens_per_s;
  else return;
  const total = Object.values(learnerRate).reduce((a, b) => a + b, 0);
  document.getElementById("kpi-tokens-per-s").textContent = fmtSI(total);
  if (!explicitTps && total > 0) {
    const s = (series.tokens_per_s = series.tokens_per_s || { tokens: [], time: [], value: [] });
    const t = typeof msg.last_heartbeat === "number" ? msg.last_heartbeat : Date.now() / 1000;
    const x = Object.values(learnerTokens).reduce((a, b) => a + b, 0);
    if (s.time.length && t <= s.time.at(-1)) {
      s.value[s.value.length - 1] = total; // same instant: keep the newest total
    } else {
      s.tokens.push(x);
      s.time.push(t);
      s.value.push(total);
      thin(s);
    }
    redraw();
  }
}

function onLearner(msg) {
  const index = msg.index ?? msg.learner;
  if (index === undefined || index === null) return;
  onLearnerRate(index, msg);
  const row = learnerRow(index);
  if (msg.state) setBadge(row.querySelector('[data-field="state"]'), msg.state);
  const set = (f, text) => {
    const td = row.querySelector(`[data-field="${f}"]`);
    if (td) td.textContent = text;
  };
  if (msg.node !== undefined) set("node", msg.node_hostname || msg.node || "—");
  const poolTd = row.children[1];
  if (msg.pool && poolTd && poolTd.dataset.pool !== msg.pool && !poolTd.textContent.includes(msg.pool)) {
    const a = document.createElement("a");
    a.href = `/fleet/${encodeURIComponent(msg.pool)}/`;
    a.textContent = msg.pool;
    poolTd.replaceChildren(a);
    poolTd.dataset.pool = msg.pool;
  }
  for (const f of ["incarnation", "work_size", "staleness"]) if (msg[f] !== undefined) set(f, String(msg[f]));
  if (msg.tokens !== undefined) set("tokens", fmtSI(msg.tokens));
  if (msg.tokens_per_s !== undefined) set("tokens_per_s", fmtSI(msg.tokens_per_s));
  if (typeof msg.loss === "number") set("loss", msg.loss.toPrecision(4));
  const hb = toDate(msg.last_heartbeat ?? msg.time);
  if (hb) set("last_heartbeat", hb.toLocaleTimeString([], { hour12: false }));
}

// ----------------------------------------------------------------- timeline, status
async function refreshCheckpoints() {
  const resp = await fetch(`/jobs/${JOB}/checkpoints.html`, { headers: { Accept: "text/html" } });
  if (!resp.ok) return;
  const tbody = document.querySelector("#checkpoints tbody");
  if (tbody) tbody.innerHTML = await resp.text();
}

// A live event that is a marker shows at once; the server's list (with incidents' heal
// times) replaces it a moment later, and is polled while an incident is open.
const MARKER_EVENTS = { failed: "incident", reassigned: "move", rebalanced: "move", drained: "move",
  checkpointed: "checkpoint" };
let markerFetch = null;
async function refetchMarkers() {
  const resp = await fetch(`/jobs/${JOB}/markers.json`, { headers: { Accept: "application/json" } });
  if (!resp.ok) return;
  markers = (await resp.json()).markers || [];
  for (const c of charts) c.u.redraw(false, true);
  redraw();
}
function scheduleMarkers(delay) {
  if (markerFetch) return;
  markerFetch = setTimeout(() => { markerFetch = null; refetchMarkers().catch(() => {}); }, delay);
}
setInterval(() => {
  if (markers.some((m) => m.open) && document.visibilityState === "visible") scheduleMarkers(0);
}, 5000);

function onMarkerEvent(msg) {
  const kind = MARKER_EVENTS[msg.kind];
  if (!kind || (msg.kind === "rebalanced" && !(msg.payload && msg.payload.to))) return;
  const time = typeof msg.time === "number" ? msg.time : ((toDate(msg.time) || new Date()).getTime() / 1000);
  markers.push({ kind, time, end: null, open: kind === "incident", text: msg.message || kind, id: `live-${time}` });
  for (const c of charts) c.u.redraw(false, true);
  redraw();
  scheduleMarkers(1500);
}

function onEvent(msg) {
  if (msg.kind === "checkpointed") setTimeout(() => { refreshCheckpoints().catch(() => {}); }, 500);
  onMarkerEvent(msg);
  const ul = document.getElementById("timeline");
  ul.querySelector("li.empty")?.remove();
  const li = document.createElement("li");
  li.className = `kind-${msg.kind || "info"} fresh`;
  const when = toDate(msg.time) || new Date();
  const time = document.createElement("time");
  time.dateTime = when.toISOString();
  time.textContent = when.toLocaleTimeString([], { hour12: false });
  const strong = document.createElement("strong");
  strong.textContent = msg.kind || "event";
  li.append(time, " ", strong, " ", msg.message || "");
  const p = msg.payload || {};
  const reasons = [msg.reason || p.reason].concat(Array.isArray(p.reasons) ? p.reasons.slice(0, 5) : []);
  const reason = reasons.filter(Boolean).join("; ");
  if (reason) {
    const sub = document.createElement("div");
    sub.className = "sub";
    sub.textContent = reason;
    li.append(sub);
  }
  ul.prepend(li);
  while (ul.children.length > 200) ul.lastElementChild.remove();
}

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
function onJob(msg) {
  if (msg.status) {
    const badge = document.getElementById("job-status");
    setBadge(badge, msg.status);
    badge.dataset.status = msg.status;
    if (TERMINAL.has(msg.status)) {
      document.querySelectorAll(".actions button").forEach((b) => { b.disabled = true; });
    }
  }
  if (msg.status_reason !== undefined) document.getElementById("status-reason").textContent = msg.status_reason;
  if (msg.outer_steps !== undefined) document.getElementById("kpi-outer-steps").textContent = String(msg.outer_steps);
  if (msg.tokens_computed !== undefined) {
    const kpi = document.getElementById("kpi-tokens");
    kpi.textContent = fmtSI(msg.tokens_computed);
    const budget = Number(kpi.dataset.budget);
    const sub = document.getElementById("kpi-progress");
    if (budget > 0 && sub) sub.textContent = `${Math.round(Math.min(1, msg.tokens_computed / budget) * 100)} % of the budget`;
  }
  if (msg.bytes_sent !== undefined) document.getElementById("kpi-bytes").textContent = fmtBytes(msg.bytes_sent);
  if (msg.tokens_computed && msg.tokens_contributed !== undefined) {
    document.getElementById("kpi-goodput").textContent =
      `${((100 * msg.tokens_contributed) / msg.tokens_computed).toFixed(1)} %`;
  }
}

function onMessage(msg) {
  switch (msg.type) {
    case "metrics":
      for (const p of msg.points || []) addPoint(p);
      redraw();
      break;
    case "learner": onLearner(msg); break;
    case "event": onEvent(msg); break;
    case "job": onJob(msg); break;
    default: break;
  }
}

// After a reconnect, points sent while we were away are in the database: fetch them.
async function refetch() {
  const resp = await fetch(`/jobs/${JOB}/series.json`, { headers: { Accept: "application/json" } });
  if (!resp.ok) return;
  load(await resp.json());
  redraw();
  scheduleMarkers(0);
}

scheduleMarkers(0);
connectLive(`/ws/jobs/${JOB}/`, onMessage, { onReconnect: () => { refetch().catch(() => {}); } });
