// Fleet pages: pool and node rows follow /ws/fleet/ without reloads. A pool's state comes
// in the message itself; utilisation, throughput and watts are recomputed by the server
// (/fleet/live.json), fetched at most every few seconds while messages keep coming.
import { connectLive, fmtSI, setBadge } from "./live.js";

const REFRESH_MS = 3000;
let refreshTimer = null;

function poolRow(msg) {
  if (msg.slug) {
    const r = document.querySelector(`tr[data-pool="${CSS.escape(String(msg.slug))}"]`);
    if (r) return r;
  }
  const id = msg.id ?? msg.pool_id;
  return id === undefined ? null : document.querySelector(`tr[data-pool-id="${CSS.escape(String(id))}"]`);
}

function applyPool(p) {
  const row = poolRow(p);
  if (!row) return;
  if (p.state) setBadge(row.querySelector('[data-field="state"]'), p.state, p.state_display);
  if (typeof p.utilisation === "number") {
    row.querySelector('[data-field="utilisation"]').textContent = `${Math.round(p.utilisation * 100)} %`;
    const meter = row.querySelector("meter");
    if (meter) meter.value = p.utilisation;
  }
  if (typeof p.busy === "number") {
    const busy = row.querySelector('[data-field="busy"]');
    if (busy) busy.textContent = `(${p.busy} busy)`;
  }
  if (typeof p.tokens_per_s === "number") {
    const cell = row.querySelector('[data-field="tokens_per_s"]');
    if (cell && cell.firstChild) cell.firstChild.textContent = fmtSI(p.tokens_per_s);
  }
  if (typeof p.watts === "number") {
    const cell = row.querySelector('[data-field="watts"]');
    if (cell) cell.textContent = fmtSI(p.watts, "W");
  }
}

async function refresh() {
  refreshTimer = null;
  const resp = await fetch("/fleet/live.json", { headers: { Accept: "application/json" } });
  if (!resp.ok) return;
  const body = await resp.json();
  for (const p of body.pools || []) applyPool(p);
}

function scheduleRefresh() {
  if (refreshTimer === null) refreshTimer = setTimeout(() => { refresh().catch(() => {}); }, REFRESH_MS);
}

function onMessage(msg) {
  if (msg.type === "pool") {
    applyPool(msg);
    scheduleRefresh();
  } else if (msg.type === "node") {
    const id = msg.id ?? msg.node_id;
    const row = id === undefined ? null : document.querySelector(`tr[data-node="${CSS.escape(String(id))}"]`);
    if (row && msg.state) setBadge(row.querySelector('[data-field="state"]'), msg.state);
    if (row && typeof msg.measured_tokens_per_s === "number") {
      const cell = row.querySelector('[data-field="measured"]');
      if (cell) cell.textContent = fmtSI(msg.measured_tokens_per_s);
    }
    scheduleRefresh();
  }
}

connectLive("/ws/fleet/", onMessage, { onReconnect: () => { refresh().catch(() => {}); } });
