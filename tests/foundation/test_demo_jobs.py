"""`manage.py demo`'s job and chaos parts: the budget sized for about N minutes, and a worker
killed and started again on request (the job page's button) or by --chaos, through the real
supervisor and real child processes."""
from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from django.conf import settings

from apps.dashboard.demo_chaos import request_kill, take_request
from apps.inventory.demo_budget import measure_step_s, sized_for
from apps.inventory.management.commands.demo import Command, Supervisor

EXAMPLE = yaml.safe_load((Path(settings.BASE_DIR) / "examples" / "job.yaml").read_text())
FLEET = [1.0, 1.0, 0.6, 0.35]  # the demo fleet's slots, fastest first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_budget_is_sized_for_the_minutes_on_the_slowest_slot():
    spec, note = sized_for(EXAMPLE, 5, FLEET, step_s=0.05)
    # 3 learners get the slots at 1.0, 1.0, 0.6: 300 s / (0.05 s / 0.6 x 1.5 overhead) = 2400 steps
    assert spec["steps"] == 2400 and "2400 steps per learner" in note and "0.6x" in note
    assert spec["model"] == EXAMPLE["model"] and spec["learners"] == EXAMPLE["learners"]
    assert spec["name"] == "demo tiny-gpt (5 min)"
    # fewer evaluations and checkpoints per outer step, so the charts are not a wall of markers
    assert spec["eval_interval"] > EXAMPLE["eval_interval"] and spec["checkpoint_interval"] > 3
    # twice the time, twice the steps; never below the file's own budget
    assert sized_for(EXAMPLE, 10, FLEET, step_s=0.05)[0]["steps"] == 4800
    assert sized_for(EXAMPLE, 0.01, FLEET, step_s=0.05)[0]["steps"] == EXAMPLE["steps"]


def test_step_time_is_measured_on_the_real_model():
    s = measure_step_s("tiny", 2, 16, steps=2)
    assert 0 < s < 30


def _sleeper(sup: Supervisor, name: str):
    child = sup.add(name, [sys.executable, "-c", "import time; time.sleep(120)"],
                    {"PATH": "/usr/bin:/bin", "DILOCO_POOL": name})
    sup.start(child)
    return child


@pytest.mark.parametrize("how", ["button", "--chaos"])
def test_worker_is_killed_and_started_again(how, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    out = io.StringIO()
    sup = Supervisor(out)
    victim, bystander = _sleeper(sup, "cpu-mid"), _sleeper(sup, "cpu-new")
    web = sup.add("web", [sys.executable, "-c", "import time; time.sleep(120)"], {"PATH": "/usr/bin:/bin"})
    sup.start(web)
    first_pid = victim.popen.pid
    opts = {"run_for": 2.5, "chaos": how == "--chaos", "chaos_after": 0.2, "chaos_restart": 1.0,
            "chaos_pool": "cpu-mid"}
    if how == "button":
        request_kill(["web", "nonesuch", "cpu-mid", "cpu-new"], 7, "olga")  # the first pool worker it runs
    cmd = Command(stdout=io.StringIO())
    cmd.demo_job = None
    try:
        assert cmd._watch(sup, threading.Event(), opts) == 0  # nothing counted as a crash
        text = out.getvalue()
        why = "olga pressed Kill a worker" if how == "button" else "--chaos"
        assert f"{why}: killing worker cpu-mid (SIGKILL" in text, text
        assert "starting worker cpu-mid again" in text
        assert victim.alive() and victim.popen.pid != first_pid and victim.restarts == 1
        assert bystander.alive() and bystander.restarts == 0
        assert web.alive() and web.restarts == 0  # never anything but a pool worker
        assert take_request() is None  # carried out once
    finally:
        sup.stop_all(grace_s=1)


def _read_until(proc, buf: list[str], pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        buf.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no {pattern!r} within {timeout}s; output:\n{''.join(buf)[-4000:]}")


@pytest.mark.e2e
def test_demo_runs_a_job_queues_a_second_and_heals_a_killed_worker(tmp_path):
    """`manage.py demo` as a newcomer runs it (SQLite, no services): the first screen shows a
    running job, a second one waits in the queue, the banner says what to look at, and the
    staff button kills a worker: an incident opens, the learner moves, the incident heals."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DILOCO_POOL")}
    env.update(DILOCO_VAR_DIR=str(tmp_path / "var"), DEMO_ADMIN_PASSWORD="demo-pass-123",
               PYTHONUNBUFFERED="1", BLOB_STORE_URL=f"file://{tmp_path / 'blobs'}")
    proc = subprocess.Popen([sys.executable, "manage.py", "demo", "--port", str(port), "--minutes", "3"],
                            cwd=settings.BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    out: list[str] = []
    base = f"http://127.0.0.1:{port}"
    try:
        first = int(_read_until(proc, out, r"submitted job #(\d+) 'demo tiny-gpt \(3 min\)'", 240).group(1))
        queued_line = rf"submitted job #(\d+) 'queued behind job {first}'"
        second = int(_read_until(proc, out, queued_line, 90).group(1))
        _read_until(proc, out, r"Kill a worker \(demo\)", 10)
        with httpx.Client(base_url=base, timeout=20) as web:
            page = web.get("/accounts/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            web.post("/accounts/login/", data={"csrfmiddlewaretoken": token, "username": "admin",
                                               "password": "demo-pass-123"},
                     headers={"Referer": f"{base}/accounts/login/"})
            home = web.get("/")
            assert home.status_code == 200 and "demo tiny-gpt (3 min)" in home.text  # the first screen
            queued = web.get(f"/api/v1/jobs/{second}/").json()
            assert queued["status"] == "queued", queued
            deadline = time.monotonic() + 60  # a newcomer presses once the learners train
            while time.monotonic() < deadline:
                learners = web.get(f"/api/v1/jobs/{first}/learners/").json()
                if learners and all(lr["state"] == "running" for lr in learners):
                    break
                time.sleep(1)
            job_page = web.get(f"/jobs/{first}/")
            assert 'id="demo-kill-worker"' in job_page.text
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', job_page.text).group(1)
            r = web.post(f"/jobs/{first}/demo/kill-worker", data={"csrfmiddlewaretoken": token},
                         headers={"Referer": f"{base}/jobs/{first}/"})
            assert r.status_code == 302
            _read_until(proc, out, r"admin pressed Kill a worker: killing worker \S+", 15)
            deadline, kinds = time.monotonic() + 90, set()
            while time.monotonic() < deadline:
                markers = web.get(f"/jobs/{first}/markers.json").json()["markers"]
                incidents = [m for m in markers if m["kind"] == "incident"]
                kinds = {m["kind"] for m in markers}
                if incidents and not any(m["open"] for m in incidents) and "move" in kinds:
                    break
                time.sleep(1)
            else:
                raise AssertionError(f"no healed incident and move in {markers}\n{''.join(out)[-3000:]}")
            print(f"\nmarkers of the demo job: {sorted(kinds)}; {incidents[0]['text']}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        out.append(rest)
    assert proc.returncode == 0, "".join(out)[-4000:]
