"""TelemetryClient without a server: never blocks, bounded buffer, clean frames, no Django."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from apps.telemetry.client import TelemetryClient, agent_url

ROOT = Path(__file__).resolve().parents[2]


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"ws://127.0.0.1:{port}/ws/agent/"  # nothing listens there


def test_agent_url():
    assert agent_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws/agent/"
    assert agent_url("https://diloco.example.com/") == "wss://diloco.example.com/ws/agent/"
    assert agent_url("ws://h:1/ws/agent/") == "ws://h:1/ws/agent/"


def test_send_never_blocks_and_drops_oldest_when_full():
    c = TelemetryClient(_dead_url(), "tok", max_buffer=10, backoff_initial=0.05, backoff_max=0.2)
    try:
        for i in range(1000):  # nothing listens: every send returns at once
            assert c.send({"type": "metrics", "job": 1, "points": [{"name": "x", "step": i, "value": 1.0}]})
        s = c.stats()
        assert (s["buffered"], s["dropped"], s["sent"], s["connected"]) == (10, 990, 0, False)
        deadline = time.monotonic() + 5
        while c.stats()["last_error"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "connect failed" in c.stats()["last_error"]
        kept = [json.loads(t)["points"][0]["step"] for t in c._buf]
        assert kept == list(range(990, 1000))  # the newest survive
    finally:
        c.close(timeout=0.5)
        assert not c._thread.is_alive()


def test_non_finite_values_are_cleaned_not_fatal():
    c = TelemetryClient(_dead_url(), "tok", start=False)
    assert c.send({"type": "heartbeat", "job": 1, "learner": 0, "incarnation": 1, "step": 1, "tokens": 1,
                   "loss": float("nan"), "tokens_per_s": float("inf")})
    hb = json.loads(c._buf[-1])
    assert hb["loss"] is None and hb["tokens_per_s"] is None
    assert c.send({"type": "metrics", "job": 1, "points": [
        {"name": "train_loss", "value": float("nan")}, {"name": "train_loss", "value": 2.0}]})
    assert json.loads(c._buf[-1])["points"] == [{"name": "train_loss", "value": 2.0}]
    assert not c.send({"type": "metrics", "job": 1, "points": [{"name": "x", "value": float("-inf")}]})
    assert not c.send({"type": "event", "job": 1, "kind": "info", "payload": {"o": object()}})
    assert not c.send({"no": "type"})
    assert c.stats()["invalid"] == 4


def test_big_metrics_are_split_into_frames_under_the_limit():
    c = TelemetryClient(_dead_url(), "tok", start=False, max_frame_bytes=4096, max_buffer=1000)
    points = [{"learner": 0, "name": "train_loss", "step": i, "value": 1.0 + i} for i in range(500)]
    assert c.send({"type": "metrics", "job": 3, "points": points})
    frames = [json.loads(t) for t in c._buf]
    assert len(frames) > 1 and all(len(t.encode()) <= 4096 for t in c._buf)
    assert [p for f in frames for p in f["points"]] == points
    # a single oversized non-metrics message is refused, not sent to be rejected by the server
    assert not c.send({"type": "event", "job": 3, "kind": "info", "message": "x" * 5000})


def test_client_imports_without_django_or_torch():
    code = ("import sys; import apps.telemetry.client as c; "
            "assert 'django' not in sys.modules and 'torch' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('django', 'torch'))]; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_invalid_messages_are_refused_locally_not_sent():
    """The client applies the server's rules: a bug in a producer costs one message, never the
    connection (the server would close it with 4400)."""
    c = TelemetryClient(_dead_url(), "tok", start=False)
    good = {"type": "heartbeat", "job": 1, "learner": 0, "incarnation": 1, "step": 1, "tokens": 1}
    assert c.send(good)
    assert c.send({**good, "staleness": -1})  # a learner ahead of the head it knows: allowed
    for bad in ({**good, "job": "1"}, {**good, "step": 1.5}, {**good, "extra": 1},
                {"type": "event", "job": 1, "kind": "exploded"}, {"type": "nope"},
                {"type": "metrics", "job": 1, "points": [{"name": "Bad Name", "value": 1.0}]}):
        assert not c.send(bad), bad
    assert c.stats()["invalid"] == 6 and c.stats()["buffered"] == 2
    points = [{"name": "x", "step": i, "value": 1.0} for i in range(2500)]  # > 2000 per frame
    assert c.send({"type": "metrics", "job": 1, "points": points})
    assert c.stats()["buffered"] > 3


def test_bad_hello_fails_at_construction():
    import pytest

    with pytest.raises(ValueError, match="unknown field"):
        TelemetryClient(_dead_url(), "tok", hello={"worker": "w", "colour": "blue"}, start=False)
