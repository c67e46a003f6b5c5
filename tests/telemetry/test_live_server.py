"""A real daphne server (subprocess) on the test database and the Redis channel layer, and the
real TelemetryClient: rows arrive, control comes back, an outage is buffered (bounded) and
delivered after the restart, a malformed frame closes only its own connection."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from apps.jobs.models import Learner, MetricPoint
from apps.telemetry import publish
from apps.telemetry.client import TelemetryClient, agent_url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _db_url() -> str:
    d = connection.settings_dict
    auth = d["USER"] + (f":{d['PASSWORD']}" if d.get("PASSWORD") else "")
    return f"postgres://{auth}@{d['HOST'] or '127.0.0.1'}:{d['PORT'] or 5432}/{d['NAME']}"


class Daphne:
    def __init__(self, log_path: Path):
        self.port = _free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        env = {**os.environ, "DATABASE_URL": _db_url(), "REDIS_URL": settings.REDIS_URL,
               "TELEMETRY_FLUSH_INTERVAL_S": "0.1", "DJANGO_SETTINGS_MODULE": "diloco_platform.settings",
               "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                 "diloco_platform.asgi:application"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daphne exited: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("daphne did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory):
    if connection.vendor != "postgresql" or not settings.REDIS_URL:
        pytest.skip("the real-server tests share PostgreSQL and Redis with a daphne subprocess")
    srv = Daphne(tmp_path_factory.mktemp("daphne") / "daphne.log")
    srv.start()
    yield srv
    srv.kill()


def wait_for(pred, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def hb(job, learner=0, tokens=100, step=1):
    return {"type": "heartbeat", "job": job.pk, "learner": learner, "incarnation": 1, "step": step,
            "tokens": tokens, "loss": 3.0, "tokens_per_s": 50.0, "time": time.time()}


def test_client_against_real_server_survives_restart(server, job, token_a):
    controls: list[dict] = []
    got_control = threading.Event()
    client = TelemetryClient(agent_url(server.url), token_a, hello={"worker": "w@live", "pool": "tele-a"},
                             max_buffer=50, backoff_initial=0.05, backoff_max=0.5)
    client.on_control(lambda m: (controls.append(m), got_control.set()))
    try:
        assert wait_for(lambda: client.connected)
        for i in range(1, 6):
            client.send(hb(job, tokens=i * 100, step=i))
            point = {"learner": 0, "name": "train_loss", "step": i * 100, "value": 3.0 - i / 10}
            client.send({"type": "metrics", "job": job.pk, "points": [point]})
        assert client.flush(10)
        assert wait_for(lambda: Learner.objects.get(job=job, index=0).tokens == 500)
        assert wait_for(lambda: MetricPoint.objects.filter(job=job).count() == 5)

        # control from this process (Redis layer) reaches the client through the server
        assert publish.send_control(job.pk, 0, {"action": "resize", "work_size": 7})
        assert got_control.wait(5)
        assert controls[0] == {"type": "control", "job": job.pk, "learner": 0, "action": "resize",
                               "work_size": 7}

        # outage: sends never block, the buffer is bounded (oldest dropped, counted)
        server.kill()
        assert wait_for(lambda: not client.connected)
        for i in range(80):  # each returns at once although the server is away
            client.send({"type": "metrics", "job": job.pk,
                         "points": [{"learner": 0, "name": "train_loss", "step": 10_000 + i, "value": 1.0}]})
        stats = client.stats()
        assert (stats["buffered"], stats["dropped"], stats["connected"]) == (50, 30, False)

        server.start()
        assert client.flush(20), client.stats()
        late = MetricPoint.objects.filter(job=job, step__gte=10_000)
        assert wait_for(lambda: late.count() >= 50)
        time.sleep(0.3)  # would a duplicate still come?
        steps = list(late.order_by("step").values_list("step", flat=True))
        assert steps == list(range(10_030, 10_080))  # the newest 50, each exactly once
        stats = client.stats()
        assert stats["connected"] and stats["reconnects"] >= 1 and stats["buffered"] == 0

        # the subscription is restored after the reconnect: control still arrives
        got_control.clear()
        assert wait_for(lambda: publish.send_control(job.pk, 0, {"action": "stop"})
                        and got_control.wait(0.5), 10)
        assert controls[-1]["action"] == "stop"
    finally:
        client.close()


def test_malformed_frame_closes_only_that_connection_on_real_server(server, job, token_a):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    ws_url = agent_url(server.url)
    good = TelemetryClient(ws_url, token_a)
    try:
        with connect(ws_url, additional_headers={"Authorization": f"Bearer {token_a}"}, proxy=None) as bad:
            assert json.loads(bad.recv(5))["type"] == "hello"
            bad.send('{"type":"heartbeat","job":"seven","learner":0,"incarnation":1,"step":1,"tokens":1}')
            err = json.loads(bad.recv(5))
            assert err["code"] == "malformed" and "job" in err["reason"]
            with pytest.raises(ConnectionClosed):
                bad.recv(5)
            assert bad.close_code == 4400
        good.send(hb(job, tokens=4242))
        assert good.flush(10)
        assert wait_for(lambda: Learner.objects.get(job=job, index=0).tokens == 4242)
    finally:
        good.close()


def test_bad_token_keeps_retrying_with_backoff_and_a_bounded_buffer(server, job):
    client = TelemetryClient(agent_url(server.url), "pt_wrong_token_123456", max_buffer=5,
                             backoff_initial=0.05, backoff_max=0.2)
    try:
        for i in range(20):
            client.send(hb(job, tokens=i))
        assert wait_for(lambda: client.stats()["connects"] >= 3, 10)  # it keeps trying
        stats = client.stats()
        assert not stats["connected"] and stats["buffered"] <= 5 and stats["dropped"] >= 15
        assert "unauthorized" in stats["last_error"] or "4401" in stats["last_error"]
        assert Learner.objects.get(job=job, index=0).tokens == 0
    finally:
        client.close(timeout=0.2)


def test_ingest_rate_with_batching(server, alice, pool_a, token_a, capsys):
    """Benchmark (prints, never asserts a speed): messages/s into the DB over agent sockets,
    half heartbeats, half metric points; one socket, then 4 sockets (4 workers) at once."""
    from .conftest import make_job

    for n_clients in (1, 4):
        job = make_job(alice, [pool_a] * n_clients)
        clients = [TelemetryClient(agent_url(server.url), token_a, max_buffer=100_000, max_inflight=5_000)
                   for _ in range(n_clients)]
        try:
            assert wait_for(lambda cs=clients: all(c.connected for c in cs))
            n = 2000 // n_clients
            t0 = time.perf_counter()
            for i in range(n):
                for k, c in enumerate(clients):
                    if i % 2:
                        c.send({**hb(job, learner=k, tokens=1000 + i, step=i), "incarnation": 1})
                    else:
                        c.send({"type": "metrics", "job": job.pk,
                                "points": [{"learner": k, "name": "tokens_per_s", "step": i, "value": 1.0}]})
            assert all(c.flush(60) for c in clients), [c.stats() for c in clients]
            acked_s = time.perf_counter() - t0
            rows = MetricPoint.objects.filter(job=job, name="tokens_per_s")
            expected = n_clients * (n // 2)
            assert wait_for(lambda rows=rows, expected=expected: rows.count() == expected, 30)
            stored_s = time.perf_counter() - t0
            total = n * n_clients
            with capsys.disabled():
                print(f"\n[telemetry bench] {total} messages over {n_clients} agent socket(s): acked in "
                      f"{acked_s:.2f}s ({total / acked_s:.0f} msg/s), all rows stored after {stored_s:.2f}s")
        finally:
            for c in clients:
                c.close()
