"""Agent-side client of the telemetry websocket, for learner workers and the coordinator.

Plain Python: no Django settings, no torch; only the `websockets` package.

    client = TelemetryClient("ws://127.0.0.1:8000/ws/agent/", token,
                             hello={"worker": "celery@host", "pool": "a100"})
    client.on_control(lambda msg: ...)       # {"type": "control", "job", "learner", "action", ...}
    client.send({"type": "heartbeat", "job": 7, "learner": 0, "incarnation": 1, ...})
    client.close()

`send()` never blocks and never raises: messages go into a bounded buffer (`max_buffer`; when
it is full the OLDEST message is dropped and counted) that a background thread writes to the
socket. The server acknowledges what it processed (`{"type": "ack", "n": ...}`); messages sent
but not yet acknowledged when a connection breaks are sent again after the reconnect (at least
once; the server treats repeated heartbeats idempotently). Reconnects use exponential backoff
with jitter. Non-finite floats are sent as null (metric points with a non-finite value are
dropped and counted as invalid) because the server closes the connection on NaN.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .protocol import MAX_POINTS, parse_frame, parse_message  # Django-free

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 64 * 1024
SUBSCRIPTION_TTL_S = 120.0


def agent_url(web_url: str) -> str:
    """`http://host:8000` -> `ws://host:8000/ws/agent/` (https -> wss)."""
    parts = urlsplit(web_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    if not path.endswith("/ws/agent"):
        path += "/ws/agent"
    return urlunsplit((scheme, parts.netloc, path + "/", "", ""))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class TelemetryClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        hello: dict | None = None,
        max_buffer: int = 10_000,
        max_inflight: int = 2_000,
        backoff_initial: float = 0.25,
        backoff_max: float = 10.0,
        connect_timeout: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        name: str = "telemetry",
        start: bool = True,
    ):
        self.url, self._token = url, token
        self.hello = dict(hello or {})
        parse_message({"type": "hello", **self.hello})  # a bad hello would loop: fail right here
        self.max_buffer, self.max_inflight = max(1, int(max_buffer)), max(1, int(max_inflight))
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.connect_timeout = connect_timeout
        self.max_frame_bytes = max_frame_bytes
        self._buf: deque[str] = deque()
        # Frames written on the current connection and not yet acknowledged: (text, replay?)
        self._inflight: deque[tuple[str, bool]] = deque()
        self._conn_acked = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flush_on_close = True
        self._control_cbs: list[Callable[[dict], Any]] = []
        self._error_cbs: list[Callable[[dict], Any]] = []
        self._subs: dict[tuple[int, int], float] = {}
        self._ws = None
        self._connected = False
        self._counts = dict.fromkeys(
            ("sent", "acked", "dropped", "invalid", "refused", "controls", "connects", "rejected_frames"), 0
        )
        self.last_error: str | None = None
        self.server_hello: dict | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self._thread.start()

    # -- public API ---------------------------------------------------------------------------

    def send(self, msg: dict) -> bool:
        """Queue `msg` for the server; never blocks. False when it could not be encoded."""
        try:
            frames = self._encode(msg)
        except Exception as exc:  # never let telemetry break training
            self._count("invalid")
            log.warning("telemetry: not sending an invalid %s message: %s",
                        msg.get("type") if isinstance(msg, dict) else type(msg).__name__, exc)
            return False
        if not frames:
            return False
        if msg.get("type") in ("heartbeat", "subscribe"):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self._subs[(int(msg["job"]), int(msg["learner"]))] = time.monotonic()
        with self._lock:
            for text in frames:
                if len(self._buf) + len(self._inflight) >= self.max_buffer:
                    if self._buf:
                        self._buf.popleft()
                    else:
                        self._inflight.popleft()
                        self._conn_acked += 1  # the server still counts it in its acks
                    self._counts["dropped"] += 1
                self._buf.append(text)
        self._wake.set()
        return True

    def on_control(self, callback: Callable[[dict], Any]) -> None:
        """Call `callback(msg)` (in the client's thread) for every server -> agent control message."""
        self._control_cbs.append(callback)

    def on_error(self, callback: Callable[[dict], Any]) -> None:
        """Call `callback(msg)` for every `{"type": "error"}` reply (refused or malformed message)."""
        self._error_cbs.append(callback)

    def unsubscribe(self, job: int, learner: int) -> None:
        """Stop re-subscribing to the learner's control messages after reconnects."""
        self._subs.pop((int(job), int(learner)), None)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            # queued + sent-but-unacknowledged messages (not the per-connection hello/subscribe)
            out["buffered"] = len(self._buf) + sum(1 for _, replay in self._inflight if replay)
        out["connected"] = self._connected
        out["reconnects"] = max(0, out["connects"] - 1)
        out["last_error"] = self.last_error
        return out

    @property
    def connected(self) -> bool:
        return self._connected

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued has been acknowledged by the server (or timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._buf and not self._inflight:
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 2.0, flush: bool = True) -> None:
        """Stop the thread; with `flush`, first try for up to `timeout` s to deliver what is queued."""
        if flush and self._connected:
            self.flush(timeout)
        self._stop.set()
        self._wake.set()
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                ws.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout + 1.0)

    def __enter__(self) -> TelemetryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _dumps(self, msg: dict) -> str:
        try:
            return json.dumps(msg, allow_nan=False, separators=(",", ":"))
        except ValueError:
            return json.dumps(_finite(msg), allow_nan=False, separators=(",", ":"))

    def _encode(self, msg: dict) -> list[str]:
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise TypeError("a message is a dict with a string 'type'")
        if msg["type"] == "metrics" and isinstance(msg.get("points"), list):
            points = [p for p in msg["points"]
                      if not (isinstance(p, dict) and isinstance(p.get("value"), float)
                              and not math.isfinite(p["value"]))]
            if len(points) != len(msg["points"]):
                self._count("invalid", len(msg["points"]) - len(points))
            if not points:
                return []
            msg = {**msg, "points": points}
            text = self._dumps(msg)
            if len(points) > 1 and (len(points) > MAX_POINTS or len(text.encode()) > self.max_frame_bytes):
                half = len(points) // 2
                return (self._encode({**msg, "points": points[:half]})
                        + self._encode({**msg, "points": points[half:]}))
        else:
            text = self._dumps(msg)
        # The server's own validation, here: a bad message is refused at send() (counted as
        # invalid, logged) instead of costing the connection (4400) and everything in flight.
        parse_frame(text, self.max_frame_bytes)
        return [text]

    def _run(self) -> None:
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        delay = self.backoff_initial
        while not self._stop.is_set():
            headers = {"Authorization": f"Bearer {self._token}"}
            try:
                conn = connect(self.url, additional_headers=headers, open_timeout=self.connect_timeout,
                               proxy=None, compression=None, max_size=2**22, close_timeout=1.0,
                               ping_interval=20, ping_timeout=20)
                # The context-manager protocol (closed below): the non-legacy use on websockets >= 17.
                ws = conn.__enter__()
            except InvalidStatus as exc:
                self.last_error = f"handshake refused: HTTP {exc.response.status_code}"
            except Exception as exc:
                self.last_error = f"connect failed: {exc}"
            else:
                self._ws = ws
                with self._lock:
                    self._counts["connects"] += 1
                    # Whatever was in flight on the old connection goes first, in order.
                    self._buf.extendleft(reversed([t for t, replay in self._inflight if replay]))
                    self._inflight.clear()
                    self._conn_acked = 0
                healthy = False
                try:
                    healthy = self._session(ws)
                except Exception as exc:
                    self.last_error = f"connection lost: {exc}"
                finally:
                    self._connected = False
                    self._ws = None
                    with contextlib.suppress(Exception):
                        ws.close()
                if healthy:
                    delay = self.backoff_initial
            if self._stop.is_set():
                break
            log.debug("telemetry: %s; retrying in ~%.2fs", self.last_error, delay)
            self._stop.wait(delay * random.uniform(0.5, 1.0))
            delay = min(self.backoff_max, delay * 2)
        self._connected = False

    def _session(self, ws) -> bool:
        """Serve one connection until it breaks or the client stops; True if the server said hello."""
        state = {"healthy": False, "closed": False}
        receiver = threading.Thread(target=self._receive, args=(ws, state), daemon=True,
                                    name=self._thread.name + "-rx")
        receiver.start()
        if self.hello:
            self._write(ws, {"type": "hello", **self.hello}, replay=False)
        now = time.monotonic()
        for (job, learner), used in list(self._subs.items()):
            if now - used < SUBSCRIPTION_TTL_S:
                self._write(ws, {"type": "subscribe", "job": job, "learner": learner}, replay=False)
        while not state["closed"]:
            if self._stop.is_set():
                with self._lock:
                    if not self._buf:
                        break
            with self._lock:
                text = self._buf.popleft() if self._buf and len(self._inflight) < self.max_inflight else None
                if text is not None:
                    self._inflight.append((text, True))
            if text is None:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            ws.send(text)
            self._count("sent")
        receiver.join(0.1 if not state["closed"] else 2.0)
        return state["healthy"]

    def _write(self, ws, msg: dict, replay: bool) -> None:
        text = self._dumps(msg)
        with self._lock:
            self._inflight.append((text, replay))
        ws.send(text)

    def _receive(self, ws, state: dict) -> None:
        try:
            for raw in ws:
                try:
                    msg = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(msg, dict):
                    self._handle(msg, state)
        except Exception as exc:
            self.last_error = f"connection lost: {exc}"
        finally:
            code = getattr(ws, "close_code", None)
            if code is not None and code != 1000:
                reason = getattr(ws, "close_reason", "") or self.last_error or ""
                self.last_error = f"closed by server ({code}): {reason}"
            state["closed"] = True
            self._wake.set()

    def _handle(self, msg: dict, state: dict) -> None:
        kind = msg.get("type")
        if kind == "ack":
            n = msg.get("n")
            if isinstance(n, int):
                with self._lock:
                    k = max(0, min(n - self._conn_acked, len(self._inflight)))
                    for _ in range(k):
                        self._inflight.popleft()
                    self._conn_acked += k
                    self._counts["acked"] += k
                self._wake.set()
        elif kind == "control":
            self._count("controls")
            for cb in list(self._control_cbs):
                try:
                    cb(msg)
                except Exception:
                    log.exception("telemetry control callback failed")
        elif kind == "error":
            if msg.get("fatal"):
                self.last_error = f"{msg.get('code')}: {msg.get('reason')}"
                if msg.get("code") == "malformed":
                    # The server acked everything before the offending frame: drop that one.
                    with self._lock:
                        if self._inflight:
                            self._inflight.popleft()
                            self._counts["rejected_frames"] += 1
                log.warning("telemetry: server closes the connection: %s", self.last_error)
            else:
                self._count("refused")
                log.debug("telemetry: refused: %s", msg.get("reason"))
            for cb in list(self._error_cbs):
                try:
                    cb(msg)
                except Exception:
                    log.exception("telemetry error callback failed")
        elif kind == "hello":
            self.server_hello = msg
            state["healthy"] = True
            self._connected = True  # connected *and* authenticated
            limit = msg.get("max_frame_bytes")
            if isinstance(limit, int) and limit > 0:
                self.max_frame_bytes = min(self.max_frame_bytes, limit)
