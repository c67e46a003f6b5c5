"""`manage.py demo`: the seeding steps, and the whole embedded stack as a real process tree."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command

from apps.inventory.models import Pool, PoolToken

ROOT = Path(settings.BASE_DIR)


@pytest.mark.django_db
def test_seed_only_creates_fleet_admin_and_tokens(monkeypatch, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    monkeypatch.delenv("DEMO_ADMIN_PASSWORD", raising=False)
    out = io.StringIO()
    call_command("demo", "--seed-only", stdout=out)
    text = out.getvalue()
    pools = {p.slug: p for p in Pool.objects.all()}
    assert set(pools) == {"cpu-new", "cpu-mid", "cpu-old"}
    assert [pools[s].speed_factor for s in ("cpu-new", "cpu-mid", "cpu-old")] == [1.0, 0.6, 0.35]
    assert all(p.accelerator.slug == "cpu" for p in pools.values())
    password = re.search(r"Login:\s+admin / (\S+)", text).group(1)
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.is_staff and admin.check_password(password)
    assert (tmp_path / "demo-admin-password").read_text().strip() == password
    assert oct((tmp_path / "demo-admin-password").stat().st_mode & 0o777) == "0o600"
    for pool in pools.values():
        assert PoolToken.objects.filter(pool=pool, revoked_at__isnull=True).count() == 1

    # Again: same password (kept), fresh tokens (the old ones revoked), fleet reset to the demo values.
    Pool.objects.filter(slug="cpu-old").update(speed_factor=0.9)
    out = io.StringIO()
    call_command("demo", "--seed-only", stdout=out)
    assert f"admin / {password}" in out.getvalue()
    assert Pool.objects.get(slug="cpu-old").speed_factor == 0.35
    for pool in pools.values():
        assert PoolToken.objects.filter(pool=pool, revoked_at__isnull=True).count() == 1
        assert PoolToken.objects.filter(pool=pool).count() == 2


@pytest.mark.django_db
def test_admin_password_from_env(monkeypatch, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    monkeypatch.setenv("DEMO_ADMIN_PASSWORD", "correct horse battery")
    out = io.StringIO()
    call_command("demo", "--seed-only", stdout=out)
    assert "admin / correct horse battery" in out.getvalue()
    assert get_user_model().objects.get(username="admin").check_password("correct horse battery")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_until(proc, buf: list[str], pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        buf.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no {pattern!r} within {timeout}s; output:\n{''.join(buf)[-4000:]}")


@pytest.mark.e2e
def test_demo_brings_up_the_embedded_stack_and_stops_cleanly(tmp_path):
    """Fresh var dir, no services (SQLite + filesystem broker): healthz 200, admin login, nodes, Ctrl-C."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DILOCO_POOL")}
    env.update(
        DILOCO_VAR_DIR=str(tmp_path / "var"),
        DEMO_ADMIN_PASSWORD="demo-pass-123",
        PYTHONUNBUFFERED="1",
        BLOB_STORE_URL=f"file://{tmp_path / 'blobs'}",
    )
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--port", str(port), "--no-job"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    out: list[str] = []
    try:
        read_until(proc, out, r"DiLoCo platform demo is up", 120)
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/healthz", timeout=10)
        assert health.status_code == 200
        assert health.json()["checks"]["broker"] == "ok (filesystem)"
        for slug in ("cpu-new", "cpu-mid", "cpu-old"):
            if not any(f"in pool {slug}" in line for line in out):
                read_until(proc, out, rf"node {slug}@\S+ online in pool {slug}", 60)

        with httpx.Client(base_url=base, timeout=10) as web:
            page = web.get("/admin/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
            resp = web.post(
                "/admin/login/?next=/admin/",
                data={
                    "csrfmiddlewaretoken": token,
                    "username": "admin",
                    "password": "demo-pass-123",
                    "next": "/admin/",
                },
                headers={"Referer": f"{base}/admin/login/"},
            )
            assert resp.status_code == 302 and resp.headers["location"] == "/admin/"
            pools = web.get("/admin/inventory/pool/")
            assert pools.status_code == 200
            for slug in ("cpu-new", "cpu-mid", "cpu-old"):
                assert slug in pools.text
            nodes = web.get("/admin/inventory/node/?state__exact=online")
            assert nodes.text.count("@") >= 3 and "cpu-old@" in nodes.text
            css = web.get("/static/admin/css/base.css")
            assert css.status_code == 200  # whitenoise serves the admin's assets
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        out.append(rest)
    text = "".join(out)
    assert proc.returncode == 0, text[-4000:]
    assert "demo        | stopped" in text
    pids = [int(p) for p in re.findall(r"started \(pid (\d+)\)", text)]
    assert len(pids) == 7  # web, coordinator, syncer, three pool workers, beat
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert text.count("offline") >= 3  # each pool worker marked its node offline
