// Compare page: the loss curves of several jobs overlaid (against tokens, and against the
// time since each job started), the baseline drawn thicker. Data: #compare-data (the server's
// apps.dashboard.compare result, downsampled in the database).
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { fmtSI } from "./live.js";

const data = JSON.parse(document.getElementById("compare-data").textContent);
const css = getComputedStyle(document.documentElement);
const color = (v, fallback) => (css.getPropertyValue(v).trim() || fallback);
const PALETTE = [color("--c1", "#2563eb"), color("--c2", "#dc2626"), color("--c3", "#059669"),
  color("--c4", "#7c3aed"), color("--c5", "#d97706"), "#0891b2", "#db2777", "#65a30d"];
const axisColor = color("--muted", "#888");
const gridColor = color("--grid", "rgba(128,128,128,.15)");
const axis = (extra = {}) => ({ stroke: axisColor, grid: { stroke: gridColor, width: 1 },
  ticks: { stroke: gridColor }, ...extra });

export function fmtDuration(s) {
  if (s === null || s === undefined) return "—";
  const v = Math.round(Number(s));
  if (v < 60) return `${v} s`;
  if (v < 3600) return `${Math.floor(v / 60)}m ${String(v % 60).padStart(2, "0")}s`;
  return `${Math.floor(v / 3600)}h ${String(Math.floor((v % 3600) / 60)).padStart(2, "0")}m`;
}

function chart(elId, xKey) {
  const el = document.getElementById(elId);
  const tables = data.jobs.map((j) => {
    const xs = j.series[xKey];
    const idx = xs.map((_, i) => i).sort((a, b) => xs[a] - xs[b]);
    return [idx.map((i) => xs[i]), idx.map((i) => j.series.loss[i])];
  });
  const aligned = tables.length ? uPlot.join(tables) : [[]];
  const fmtX = xKey === "tokens" ? fmtSI : fmtDuration;
  const series = [{ label: xKey === "tokens" ? "tokens" : "time", value: (u, v) => fmtX(v) }];
  data.jobs.forEach((j, i) => {
    series.push({
      label: `#${j.id} ${j.name}${j.baseline ? " (baseline)" : ""}`,
      stroke: PALETTE[i % PALETTE.length], width: j.baseline ? 3 : 1.5, dash: j.baseline ? undefined : [6, 3],
      spanGaps: true, value: (u, v) => (v === null || v === undefined ? "—" : v.toPrecision(4)),
    });
  });
  const u = new uPlot({
    width: Math.max(240, el.clientWidth), height: 260, series,
    axes: [axis({ values: (u2, vals) => vals.map((v) => fmtX(v)) }),
      axis({ size: 60, values: (u2, vals) => vals.map((v) => fmtSI(v)) })],
    scales: { x: { time: false } }, legend: { live: true }, cursor: { drag: { x: true, y: false } },
  }, aligned, el);
  el.dataset.series = String(data.jobs.filter((j) => j.series.loss.length).length);
  el.dataset.points = String(data.jobs.reduce((a, j) => a + j.series.loss.length, 0));
  if (!data.jobs.some((j) => j.series.loss.length)) {
    const empty = document.createElement("div");
    empty.className = "nodata";
    empty.textContent = "no loss points yet";
    el.parentElement.append(empty);
  }
  return { u, el };
}

const charts = [chart("chart-compare-tokens", "tokens"), chart("chart-compare-time", "elapsed_s")];
new ResizeObserver(() => {
  for (const c of charts) c.u.setSize({ width: Math.max(240, c.el.clientWidth), height: 260 });
}).observe(document.querySelector(".charts"));
