// Pool and node pages: utilisation, tokens/s and power history, downsampled by the server
// (apps.dashboard.data.fleet_history), drawn with uPlot in the job charts' style and
// refetched every 30 s (the coordinator samples every few seconds).
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { fmtSI } from "./live.js";

const REFRESH_MS = 30000;
const box = document.querySelector(".charts.history");
const css = getComputedStyle(document.documentElement);
const color = (v, fallback) => (css.getPropertyValue(v).trim() || fallback);
const axisColor = color("--muted", "#888");
const gridColor = color("--grid", "rgba(128,128,128,.15)");
const SERIES = {
  utilisation: { label: "utilisation", stroke: color("--c1", "#2563eb"), fmt: (v) => `${Math.round(v * 100)} %` },
  tokens_per_s: { label: "tokens/s", stroke: color("--c3", "#059669"), fmt: (v) => fmtSI(v) },
  watts: { label: "watts", stroke: color("--c5", "#d97706"), fmt: (v) => fmtSI(v, "W") },
};

function axis(extra = {}) {
  return { stroke: axisColor, grid: { stroke: gridColor, width: 1 }, ticks: { stroke: gridColor }, ...extra };
}

// As on the job page: one point (or none) would give uPlot a zero-width time range.
function xRange(u, min, max) {
  const xs = u.data && u.data[0];
  if (!xs || !xs.length || min === null || max === null) return [Date.now() / 1000 - 30, Date.now() / 1000 + 30];
  if (xs[0] === xs[xs.length - 1]) return [xs[0] - 30, xs[0] + 30];
  return [min, max];
}

const charts = {};

function toData(pts) {
  return [pts.map((p) => p[0]), pts.map((p) => p[1])];
}

function draw(raw) {
  for (const [name, spec] of Object.entries(SERIES)) {
    const pts = (raw && raw[name]) || [];
    const el = document.getElementById(`chart-${name}`);
    if (!el) continue;
    if (!charts[name]) {
      const yRange = name === "utilisation" ? { range: [0, 1] } : {};
      const u = new uPlot({
        width: Math.max(240, el.clientWidth), height: 200,
        series: [{ label: "time" }, {
          label: spec.label, stroke: spec.stroke, width: 1.5, spanGaps: true,
          value: (self, v) => (v === null || v === undefined ? "—" : spec.fmt(v)),
        }],
        axes: [axis(), axis({ values: (self, vals) => vals.map((v) => spec.fmt(v)), size: 60 })],
        scales: { x: { time: true, range: xRange }, y: yRange },
        legend: { live: true },
      }, toData(pts), el);
      const empty = document.createElement("div");
      empty.className = "nodata";
      empty.textContent = "no samples yet";
      el.parentElement.append(empty);
      charts[name] = { u, el, empty };
    } else {
      charts[name].u.setData(toData(pts));
    }
    charts[name].empty.hidden = pts.length > 0;
    el.dataset.points = String(pts.length);
  }
}

async function refresh() {
  const resp = await fetch(box.dataset.url, { headers: { Accept: "application/json" } });
  if (resp.ok) draw(await resp.json());
}

if (box) {
  draw(JSON.parse(document.getElementById("history-data").textContent));
  new ResizeObserver(() => {
    for (const c of Object.values(charts)) c.u.setSize({ width: Math.max(240, c.el.clientWidth), height: 200 });
  }).observe(box);
  setInterval(() => { if (!document.hidden) refresh().catch(() => {}); }, REFRESH_MS);
}
