"""/healthz, and `manage.py check --deploy` with production settings."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db


def dead_redis_url() -> str:
    """A redis:// URL on a local port where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_healthz_ok(client):
    resp = client.get("/healthz")
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["status"] == "ok"
    assert set(body["checks"]) == {"database", "broker", "channel_layer"}
    assert all(v.startswith("ok") for v in body["checks"].values())
    kind = "redis" if settings.REDIS_URL else "filesystem"
    assert kind in body["checks"]["broker"]


def test_healthz_needs_no_login_and_is_json(client):
    resp = client.get("/healthz")
    assert resp["Content-Type"] == "application/json"


def test_channel_layer_probe_holds_under_concurrent_calls():
    """Concurrent /healthz calls (several threads of one web worker) each get their own layer:
    one shared layer would fail with "Two event loops are trying to receive()"."""
    from concurrent.futures import ThreadPoolExecutor

    from apps.inventory.health import _channel_layer

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _channel_layer(), range(16)))
    assert all(r.startswith("ok") for r in results), results


def test_healthz_503_when_redis_is_unreachable(client, settings):
    url = dead_redis_url()
    settings.REDIS_URL = url
    settings.CELERY_BROKER_URL = url
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [url]}}
    }
    resp = client.get("/healthz")
    assert resp.status_code == 503
    body = resp.json()
    assert body["status"] == "degraded"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["broker"].startswith("down:")
    assert body["checks"]["channel_layer"].startswith("down:")


def test_healthz_503_when_the_filesystem_broker_folder_is_missing(client, settings, tmp_path):
    settings.REDIS_URL = ""
    settings.CELERY_BROKER_URL = "filesystem://"
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(tmp_path / "gone"),
        "data_folder_out": str(tmp_path / "gone"),
    }
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    resp = client.get("/healthz")
    assert resp.status_code == 503
    assert "gone" in resp.json()["checks"]["broker"]
    (tmp_path / "gone").mkdir()
    assert client.get("/healthz").status_code == 200


def run_check(tmp_path, **env_overrides):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "DJANGO_ALLOW_ASYNC_UNSAFE")
    }
    env.update(
        DILOCO_PRODUCTION="1",
        DEBUG="0",
        ALLOWED_HOSTS="diloco.example.com",
        SECRET_KEY=secrets.token_urlsafe(50),
        DILOCO_VAR_DIR=str(tmp_path / "var"),
    )
    env.update(env_overrides)
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    res = run_check(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no issues" in res.stdout


def test_check_deploy_catches_a_weak_secret_key(tmp_path):
    res = run_check(tmp_path, SECRET_KEY="short")
    assert res.returncode != 0
    assert "security.W009" in res.stderr + res.stdout


def test_production_refuses_to_start_without_secret_key(tmp_path):
    res = run_check(tmp_path, SECRET_KEY=None)
    assert res.returncode != 0
    assert "SECRET_KEY must be set" in res.stderr
