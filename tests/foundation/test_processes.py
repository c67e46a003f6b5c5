"""One definition of the platform's processes (diloco_platform/processes.py): the Procfile and the
compose file say the same as the launcher the demo and the test Stack use."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diloco_platform import processes
from diloco_platform.db_pool import pool_options
from diloco_platform.gunicorn_conf import web_db_pool, web_workers

ROOT = Path(__file__).resolve().parents[2]


def test_procfile_is_the_generated_one():
    text = (ROOT / "Procfile").read_text()
    assert text == processes.procfile(), "regenerate: python -m diloco_platform.processes > Procfile"


def test_procfile_runs_the_demo_fleet():
    fleet = yaml.safe_load((ROOT / "apps/inventory/demo_fleet.yaml").read_text())["pools"]
    assert {p["slug"]: p["device_count"] for p in fleet} == processes.DEMO_POOLS


def test_procfile_lines_are_shell_commands():
    """Each line splits back into the spec's words; ${PORT:-8000} is left to the shell."""
    text = processes.procfile()
    lines = dict(line.split(": ", 1) for line in text.splitlines() if not line.startswith("#"))
    for spec in processes.platform():
        words = shlex.split(lines[spec.name.replace("-", "_")])
        env = [f"{k}={v}" for k, v in spec.env.items()]
        assert words == ((["env", *env] if env else []) + list(spec.argv))
    assert "-b 127.0.0.1:${PORT:-8000} " in lines["web"]


def _argv(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd if isinstance(cmd, list) else shlex.split(cmd)


def test_compose_runs_the_same_commands():
    services = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    assert _argv(services["web"]) == list(processes.web(8000, host="0.0.0.0").argv)
    assert _argv(services["coordinator"]) == list(processes.coordinator().argv)
    assert _argv(services["syncer"]) == list(processes.syncer().argv)
    assert _argv(services["beat"]) == list(processes.beat().argv)
    for slug, slots in processes.DEMO_POOLS.items():
        svc = services[f"worker-{slug}"]
        spec = processes.pool_worker(slug, slots)
        assert _argv(svc) == list(spec.argv)
        assert svc["environment"]["DILOCO_POOL"] == spec.env["DILOCO_POOL"]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    cmd = next(line for line in dockerfile.splitlines() if line.startswith("CMD "))
    assert yaml.safe_load(cmd[4:]) == list(processes.web(8000, host="0.0.0.0").argv)


def test_child_form_runs_modules_of_this_python():
    spec = processes.coordinator(python="/venv/bin/python", node="c-1@%h", extra=["--without-gossip"])
    assert spec.argv[:5] == ("/venv/bin/python", "-m", "celery", "-A", "diloco_platform")
    assert "--without-gossip" in spec.argv and spec.argv[spec.argv.index("-n") + 1] == "c-1@%h"
    worker = processes.pool_worker("alpha", 0, token="pt_x", redis=False)
    assert worker.env == {"DILOCO_POOL": "alpha", "DILOCO_POOL_TOKEN": "pt_x"}
    assert "--disable-prefetch" not in worker.argv  # a Redis transport option
    assert worker.argv[worker.argv.index("--concurrency") + 1] == "1"


@pytest.mark.parametrize(("env", "cpus", "want"), [
    ({}, 8, 1),  # in-memory channel layer: it cannot fan out between processes
    ({"WEB_CONCURRENCY": "4"}, 8, 1),
    ({"REDIS_URL": "redis://r/0"}, 2, 4),
    ({"REDIS_URL": "redis://r/0", "WEB_CONCURRENCY": "3"}, 2, 3),
    ({"REDIS_URL": "redis://r/0", "WEB_CONCURRENCY": ""}, 1, 2),
])
def test_web_workers(env, cpus, want):
    assert web_workers(env, cpus=cpus) == want


@pytest.mark.parametrize(("env", "want"), [
    ({}, ["DB_POOL=1"]),  # the web workers pool their PostgreSQL connections by default
    ({"CONN_MAX_AGE": "0"}, ["DB_POOL=1"]),
    ({"DB_POOL": "0"}, []),  # the operator's choice stands, either way
    ({"DB_POOL": "1"}, []),
    ({"CONN_MAX_AGE": "60"}, []),  # persistent connections asked for: no pool (they exclude each other)
])
def test_web_db_pool(env, want, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert web_db_pool(env) == want
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert web_db_pool(env) == []  # psycopg_pool missing: plain connections, as before


def test_pool_options(monkeypatch):
    import environ

    assert pool_options(environ.Env()) == {"min_size": 2, "max_size": 8, "timeout": 10.0}
    monkeypatch.setenv("DB_POOL_MIN_SIZE", "4")
    monkeypatch.setenv("DB_POOL_MAX_SIZE", "3")  # never below min_size
    monkeypatch.setenv("DB_POOL_TIMEOUT", "2.5")
    assert pool_options(environ.Env()) == {"min_size": 4, "max_size": 4, "timeout": 2.5}


def test_spawn_starts_a_group_with_the_spec_env(tmp_path):
    code = "import os; print(os.environ['PROBE'], os.getsid(0) == os.getpid())"
    spec = processes.ProcessSpec("probe", (sys.executable, "-c", code), {"PROBE": "from-spec"})
    proc = processes.spawn(spec, {"PATH": os.environ["PATH"], "PROBE": "base"}, stdout=subprocess.PIPE,
                           cwd=tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.decode().split() == ["from-spec", "True"]
    processes.signal_group(proc, 9)  # gone already: no error


def _settings_probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import json; from diloco_platform import settings as s; d = s.DATABASES['default']; "
            "print(json.dumps([d.get('OPTIONS', {}).get('pool'), d['CONN_MAX_AGE']]))")
    base = {k: v for k, v in os.environ.items() if k not in ("DB_POOL", "CONN_MAX_AGE")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "DATABASE_URL": "postgres://u@h/db",
                                                             "SECRET_KEY": "x" * 50, **env},
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_settings_pool_only_when_asked_and_never_with_persistent_connections():
    assert _settings_probe({}).stdout.strip() == "[null, 0]"
    on = _settings_probe({"DB_POOL": "1"})
    assert on.returncode == 0 and '"max_size": 8' in on.stdout
    both = _settings_probe({"DB_POOL": "1", "CONN_MAX_AGE": "60"})
    assert both.returncode == 1 and "exclude each other" in both.stderr


def test_web_workers_freeze_their_startup_heap_after_loading_every_view():
    """gunicorn's post_worker_init: the URLconf (every view) is imported, then gc.freeze()
    keeps the startup heap out of the collector's full collections (docs/api.md)."""
    import gc

    from diloco_platform.gunicorn_conf import post_worker_init

    assert gc.get_freeze_count() == 0
    try:
        post_worker_init(worker=None)
        assert gc.get_freeze_count() > 10_000
        assert "apps.api.views.jobs" in sys.modules
    finally:
        gc.unfreeze()


def test_node_queue_names_suit_every_broker():
    """A worker's name holds '@'; the filesystem broker (the embedded default) refuses it in an
    exchange name, and each node queue is its own exchange."""
    import re

    from diloco_platform.celery import node_queue

    name = node_queue("cpu-new", "cpu-new@vm.example")
    assert name == "pool.cpu-new.node.cpu-new_vm.example"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name)
