// One websocket to the dashboard's live feed, with reconnect (exponential backoff +
// jitter) and an honest indicator: "live" only while the socket is open.
const CLOSE_FOR_GOOD = new Set([4401, 4403, 4404]);

export function connectLive(path, onMessage, { onReconnect, indicator } = {}) {
  const badge = indicator || document.getElementById("live");
  let attempt = 0;
  let everOpen = false;
  let stopped = false;
  let ws;

  const show = (state, text) => {
    if (!badge) return;
    badge.dataset.state = state;
    badge.textContent = text;
    badge.title = state === "live" ? "receiving live updates" : text;
  };

  const open = () => {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(`${proto}//${location.host}${path}`);
    ws.addEventListener("open", () => {
      const wasReconnect = everOpen;
      attempt = 0;
      everOpen = true;
      show("live", "live");
      if (wasReconnect && onReconnect) onReconnect();
    });
    ws.addEventListener("message", (ev) => {
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return; // not ours
      }
      onMessage(msg);
    });
    ws.addEventListener("close", (ev) => {
      if (stopped) return;
      if (CLOSE_FOR_GOOD.has(ev.code)) {
        show("offline", `offline (${ev.reason || "not allowed"})`);
        return;
      }
      attempt += 1;
      const base = Math.min(30000, 500 * 2 ** Math.min(attempt, 6));
      const delay = Math.round(base * (0.5 + Math.random() / 2));
      show("reconnecting", `reconnecting in ${Math.max(1, Math.round(delay / 1000))} s…`);
      setTimeout(open, delay);
    });
  };

  window.addEventListener("pagehide", () => {
    stopped = true;
    if (ws) ws.close(1000, "page closed");
  });
  open();
  return { close: () => { stopped = true; ws.close(1000); } };
}

// 3 significant digits without trailing zeros after the point: 100 -> "100", 2.50 -> "2.5"
const p3 = (x) => {
  const t = x.toPrecision(3);
  return t.includes(".") && !t.includes("e") ? t.replace(/0+$/, "").replace(/\.$/, "") : String(Number(t));
};

export function fmtSI(v, unit = "") {
  if (v === null || v === undefined || Number.isNaN(Number(v))) return "—";
  const x = Number(v);
  for (const [f, p] of [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (Math.abs(x) >= f) return `${p3(x / f)} ${p}${unit}`.trim();
  }
  const t = Number.isInteger(x) ? String(x) : p3(x);
  return `${t} ${unit}`.trim();
}

export function fmtBytes(v) {
  if (v === null || v === undefined) return "—";
  let x = Number(v);
  for (const [f, u] of [[2 ** 40, "TiB"], [2 ** 30, "GiB"], [2 ** 20, "MiB"], [2 ** 10, "KiB"]]) {
    if (Math.abs(x) >= f) return `${p3(x / f)} ${u}`;
  }
  return `${Math.round(x)} B`;
}

export function toDate(t) {
  if (t === null || t === undefined || t === "") return null;
  if (typeof t === "number") return new Date(t * 1000);
  const d = new Date(t);
  return Number.isNaN(d.getTime()) ? null : d;
}

export const TONE = {
  running: "ok", completed: "ok", placing: "info", queued: "info", pausing: "warn", paused: "warn",
  failed: "bad", cancelled: "muted", active: "ok", draining: "warn", disabled: "muted", online: "ok",
  offline: "muted", lost: "bad", starting: "info", pending: "info", stopped: "muted", done: "ok",
  removed: "muted",
};

export function setBadge(el, value, label) {
  if (!el || value === undefined || value === null) return;
  el.className = `badge ${TONE[value] || "info"}`;
  el.textContent = label || String(value).charAt(0).toUpperCase() + String(value).slice(1);
}
