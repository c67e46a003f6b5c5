// Fleet pages: pool and node rows follow /ws/fleet/ without reloads.
import { connectLive, fmtSI, setBadge } from "./live.js";

function poolRow(msg) {
  if (msg.slug) {
    const r = document.querySelector(`tr[data-pool="${CSS.escape(String(msg.slug))}"]`);
    if (r) return r;
  }
  const id = msg.id ?? msg.pool_id ?? msg.pool;
  return id === undefined ? null : document.querySelector(`tr[data-pool-id="${CSS.escape(String(id))}"]`);
}

function onMessage(msg) {
  if (msg.type === "pool") {
    const row = poolRow(msg);
    if (!row) return;
    if (msg.state) setBadge(row.querySelector('[data-field="state"]'), msg.state, msg.state_display);
    if (typeof msg.utilisation === "number") {
      row.querySelector('[data-field="utilisation"]').textContent = `${Math.round(msg.utilisation * 100)} %`;
      const meter = row.querySelector("meter");
      if (meter) meter.value = msg.utilisation;
    }
    if (typeof msg.tokens_per_s === "number") {
      const cell = row.querySelector('[data-field="tokens_per_s"]');
      if (cell) cell.firstChild.textContent = fmtSI(msg.tokens_per_s);
    }
  } else if (msg.type === "node") {
    const id = msg.id ?? msg.node_id;
    const row = id === undefined ? null : document.querySelector(`tr[data-node="${CSS.escape(String(id))}"]`);
    if (row && msg.state) setBadge(row.querySelector('[data-field="state"]'), msg.state);
  }
}

connectLive("/ws/fleet/", onMessage);
