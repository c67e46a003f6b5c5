// Markers on uPlot charts: incidents (a line at detection, a band until the heal), learner
// moves and checkpoints, each a focusable element with a tooltip saying what happened and when.
// Markers carry a unix time; a chart against tokens places them with `toX` (time -> tokens).
import { toDate } from "./live.js";

export const MARKER_LABELS = { incident: "incident", move: "learner move", checkpoint: "checkpoint" };

function when(t) {
  const d = toDate(t);
  return d ? d.toLocaleTimeString([], { hour12: false }) : "";
}

// x (tokens) at unix time t on a curve {time: [], tokens: []}: linear between its points,
// clamped to its ends; null without points.
export function tokensAtTime(curve, t) {
  if (!curve || !curve.time.length) return null;
  const idx = curve.time.map((_, i) => i).sort((a, b) => curve.time[a] - curve.time[b]);
  const ts = idx.map((i) => curve.time[i]);
  const xs = idx.map((i) => curve.tokens[i]);
  if (t <= ts[0]) return xs[0];
  if (t >= ts[ts.length - 1]) return xs[xs.length - 1];
  let i = 1;
  while (ts[i] < t) i += 1;
  const f = (t - ts[i - 1]) / (ts[i] - ts[i - 1] || 1);
  return xs[i - 1] + f * (xs[i] - xs[i - 1]);
}

// A uPlot plugin; getMarkers() returns the current list, toX(time) the chart's x (or null).
export function markersPlugin(getMarkers, toX) {
  const place = (u) => {
    let layer = u.over.querySelector(":scope > .markers");
    if (!layer) {
      layer = document.createElement("div");
      layer.className = "markers";
      u.over.append(layer);
    }
    const width = u.over.clientWidth;
    // elements are kept per marker id, so a tooltip under the pointer (or focus) survives the
    // redraws that live points cause
    const old = new Map([...layer.children].map((el) => [el.dataset.id, el]));
    const items = [];
    for (const m of getMarkers()) {
      const x = toX(m.time);
      if (x === null || x === undefined) continue;
      let left = u.valToPos(x, "x");
      if (!Number.isFinite(left) || left < -1 || left > width + 1) continue;
      left = Math.min(Math.max(left, 0), width - 3);  // one at the newest point stays in view
      const key = String(m.id ?? `${m.kind}-${m.time}`);
      const el = old.get(key) || document.createElement("div");
      old.delete(key);
      el.dataset.id = key;
      el.className = `marker kind-${m.kind}${m.open ? " open" : ""}${left > width / 2 ? " tip-left" : ""}`;
      el.dataset.kind = m.kind;
      el.style.left = `${Math.round(left)}px`;
      if (m.kind === "incident") {
        const endX = m.end ? toX(m.end) : null;
        const right = endX !== null && endX !== undefined ? u.valToPos(endX, "x") : (m.open ? width : left);
        el.style.width = `${Math.max(2, Math.min(width, right) - left)}px`;
      }
      const tip = `${when(m.time)} ${MARKER_LABELS[m.kind] || m.kind}: ${m.text}`;
      el.dataset.tip = tip;
      el.tabIndex = 0;
      el.setAttribute("role", "note");
      el.setAttribute("aria-label", tip);
      items.push(el);
    }
    for (const el of old.values()) el.remove();
    for (const el of items) if (el.parentElement !== layer) layer.append(el);
    u.root.dataset.markers = String(items.length);
  };
  return { hooks: { draw: [place] } };
}

// "2 incidents · 1 learner move · 3 checkpoints" under the charts (also says the colours).
export function renderLegend(el, markers) {
  if (!el) return;
  const counts = {};
  for (const m of markers) counts[m.kind] = (counts[m.kind] || 0) + 1;
  const parts = Object.keys(MARKER_LABELS).filter((k) => counts[k]).map((k) => {
    const span = document.createElement("span");
    span.className = `key kind-${k}`;
    span.dataset.kind = k;
    span.dataset.count = String(counts[k]);
    const open = k === "incident" ? markers.filter((m) => m.kind === k && m.open).length : 0;
    span.textContent = `${counts[k]} ${MARKER_LABELS[k]}${counts[k] === 1 ? "" : "s"}${open ? ` (${open} open)` : ""}`;
    return span;
  });
  el.replaceChildren(...parts);
  el.hidden = parts.length === 0;
}
