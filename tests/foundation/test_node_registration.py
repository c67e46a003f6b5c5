"""Node self-registration, exercised with a real Celery worker process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.db import connection

from apps.inventory.models import AcceleratorType, Node, Pool, PoolToken
from apps.inventory.worker import AGENT_VERSION, NodeAgent, detect_devices

ROOT = Path(settings.BASE_DIR)


def database_url() -> str:
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def start_worker(tmp_path: Path, slug: str, name: str, token: str | None, queue: str | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_POOL")}
    env.update(
        DATABASE_URL=database_url(),
        DILOCO_POOL=slug,
        HEARTBEAT_INTERVAL_S="0.3",
        DILOCO_VAR_DIR=str(tmp_path / "var"),
        PYTHONUNBUFFERED="1",
    )
    if token:
        env["DILOCO_POOL_TOKEN"] = token
    log = tmp_path / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "diloco_platform",
        "worker",
        "-Q",
        queue or f"pool.{slug}",
        "-n",
        f"{name}@%h",
        "--pool",
        "solo",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "info",
    ]
    fh = log.open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    fh.close()
    return proc, log


def wait_for(pred, timeout: float, what: str, proc=None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log else ""
    raise AssertionError(f"timed out waiting for {what}\n--- worker log ---\n{tail}")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def cpu_pool(catalogue):
    return Pool.objects.create(
        slug="reg-pool",
        name="reg",
        region="local",
        accelerator=AcceleratorType.objects.get(slug="cpu"),
        device_count=1,
        link_gbps=10,
    )


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_worker_registers_heartbeats_and_goes_offline(tmp_path, cpu_pool):
    """Two real workers at once: one with the pool's token registers; one with another
    pool's token is refused."""
    _, token = PoolToken.issue(cpu_pool)
    other = Pool.objects.create(
        slug="other", name="o", region="r", accelerator=cpu_pool.accelerator, device_count=1, link_gbps=1
    )
    _, foreign = PoolToken.issue(other)
    proc, log = start_worker(tmp_path, "reg-pool", "reg-pool", token)
    intruder, intruder_log = start_worker(tmp_path, "reg-pool", "intruder", foreign)
    try:
        node = wait_for(
            lambda: Node.objects.filter(pool=cpu_pool).first(), 120, "the node to register", proc, log
        )
        assert node.worker_name == f"reg-pool@{socket.gethostname()}"
        assert node.hostname == socket.gethostname()
        assert node.pid == proc.pid
        assert node.state == Node.State.ONLINE
        assert node.agent_version == AGENT_VERSION
        assert node.devices == detect_devices()
        assert node.devices[0]["kind"] in ("cpu", "cuda")
        if node.devices[0]["kind"] == "cpu":
            assert node.device_count == 1  # a solo-pool worker runs one learner at a time
        first_seen = node.last_seen

        # The heartbeat moves last_seen on.
        wait_for(lambda: Node.objects.get(pk=node.pk).last_seen > first_seen, 10, "a heartbeat", proc, log)
        # A node the watchdog marked lost comes back while its worker lives.
        Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
        wait_for(lambda: Node.objects.get(pk=node.pk).state == Node.State.ONLINE, 10, "revival", proc, log)
        # An operator's drain sticks.
        Node.objects.filter(pk=node.pk).update(state=Node.State.DRAINING)
        time.sleep(1.0)
        assert Node.objects.get(pk=node.pk).state == Node.State.DRAINING

        wait_for(
            lambda: " ready." in intruder_log.read_text(errors="replace"),
            120,
            "the intruder to be ready",
            intruder,
            intruder_log,
        )
    finally:
        stop(intruder)
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-2000:]
    node.refresh_from_db()
    assert node.state == Node.State.OFFLINE
    assert "registered node reg-pool@" in log.read_text()
    assert "not a valid token of pool reg-pool" in intruder_log.read_text()
    assert list(Node.objects.values_list("worker_name", flat=True)) == [node.worker_name]


@pytest.mark.django_db
def test_agent_refuses_unknown_pool_and_wrong_queue(cpu_pool, caplog):
    assert NodeAgent("w@h", ["pool.nope"], "nope").register() is None
    assert "no such pool" in caplog.text
    assert NodeAgent("w@h", ["coordinator"], "reg-pool").register() is None
    assert "does not consume pool.reg-pool" in caplog.text
    assert not Node.objects.exists()


@pytest.mark.django_db
def test_agent_registers_and_reregisters(cpu_pool):
    agent = NodeAgent("w@h", ["pool.reg-pool"], "reg-pool", interval_s=0.05)
    pk = agent.register()
    assert Node.objects.get(pk=pk).pool == cpu_pool
    Node.objects.all().delete()
    agent.beat()  # the row was deleted by an operator: the next beat registers again
    assert Node.objects.filter(worker_name="w@h", state="online").count() == 1


@pytest.mark.django_db
def test_cpu_node_slots_follow_the_worker_concurrency(cpu_pool, monkeypatch):
    from celery.concurrency.prefork import TaskPool as Prefork
    from celery.concurrency.solo import TaskPool as Solo

    from apps.inventory import worker

    monkeypatch.setattr(worker, "detect_devices", lambda: [{"kind": "cpu", "name": "cpu"}])
    pk = NodeAgent("w@h", ["pool.reg-pool"], "reg-pool", slots=3).register()
    assert Node.objects.get(pk=pk).device_count == 3
    assert worker.worker_slots(SimpleNamespace(pool_cls=Prefork, concurrency=3)) == 3
    assert worker.worker_slots(SimpleNamespace(pool_cls=Solo, concurrency=2)) == 1
    assert worker.worker_slots(SimpleNamespace(pool_cls=Prefork, concurrency=None)) == 1
    monkeypatch.setattr(worker, "detect_devices", lambda: [{"kind": "cuda", "name": "H100"}] * 2)
    pk = NodeAgent("w2@h", ["pool.reg-pool"], "reg-pool", slots=8).register()
    assert Node.objects.get(pk=pk).device_count == 2  # accelerators: one learner per device


def test_detect_devices_reads_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho '0, NVIDIA H200, 143771, GPU-aaaa'\necho '1, NVIDIA H200, 143771, GPU-bbbb'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    devs = detect_devices()
    assert [d["name"] for d in devs] == ["NVIDIA H200", "NVIDIA H200"]
    assert devs[0] == {
        "kind": "cuda",
        "index": 0,
        "name": "NVIDIA H200",
        "memory_gib": 140.4,
        "uuid": "GPU-aaaa",
    }


def test_detect_devices_falls_back_to_cpu(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    devs = detect_devices()
    assert devs[0]["kind"] == "cpu" and devs[0]["cores"] == os.cpu_count()
