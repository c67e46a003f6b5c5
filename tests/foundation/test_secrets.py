"""No usable default secret (issue 18, high hole 3).

Before: without SECRET_KEY every start used a key written in the source, and the coordinator's
websocket token was an HMAC of it, so anyone could compute it and write events into any job.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys

import pytest
from django.conf import settings

from tests.telemetry.conftest import agent, expect_close

PRINT = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'diloco_platform.settings'); "
         "django.setup(); from django.conf import settings as s; "
         "print(s.SECRET_KEY); print(s.COORDINATOR_TOKEN)")


def _run(tmp_path, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("SECRET_KEY", "DATABASE_URL", "COORDINATOR_TOKEN", "DJANGO_SETTINGS_MODULE")}
    base.update(DILOCO_VAR_DIR=str(tmp_path / "var"), **env)
    return subprocess.run([sys.executable, "-c", PRINT], cwd=settings.BASE_DIR, env=base,
                          capture_output=True, text=True, timeout=120)


def test_services_start_without_secret_key_refuses_with_one_line(tmp_path):
    res = _run(tmp_path, DATABASE_URL="postgres://postgres@127.0.0.1:5432/nowhere")
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "SECRET_KEY must be set" in last


def test_embedded_default_makes_a_random_key_once_and_reuses_it(tmp_path):
    first = _run(tmp_path)
    assert first.returncode == 0, first.stderr
    key, coord = first.stdout.split()
    assert len(key) >= 50 and "insecure" not in key
    path = tmp_path / "var" / "secret_key"
    assert path.read_text().strip() == key
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = _run(tmp_path)
    assert again.stdout.split() == [key, coord]  # every process of the host agrees
    other = _run(tmp_path / "elsewhere")
    assert other.stdout.split()[0] != key  # another install: another key


def test_coordinator_token_is_not_derived_from_secret_key(tmp_path):
    key, coord = _run(tmp_path).stdout.split()
    derived = "ct_" + hmac.new(key.encode(), b"diloco-coordinator-token", hashlib.sha256).hexdigest()
    assert coord != derived and len(coord) >= 40
    assert oct((tmp_path / "var" / "coordinator_token").stat().st_mode & 0o777) == "0o600"


@pytest.mark.django_db(transaction=True)
async def test_agent_socket_refuses_the_old_derived_token():
    derived = "ct_" + hmac.new(settings.SECRET_KEY.encode(), b"diloco-coordinator-token",
                               hashlib.sha256).hexdigest()
    comm, first = await agent(derived)
    assert first["code"] == "unauthorized"
    await expect_close(comm)
