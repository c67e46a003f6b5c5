"""docker/compose.yaml against the Compose Specification schema, plus structural checks
(no Docker engine runs here), the Dockerfile and the Procfile."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
COMPOSE = ROOT / "docker" / "compose.yaml"
DEMO_POOLS = [
    p["slug"] for p in yaml.safe_load((ROOT / "apps/inventory/demo_fleet.yaml").read_text())["pools"]
]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def schema():
    return json.loads((ROOT / "docker" / "compose-spec.json").read_text())


def test_compose_file_matches_the_compose_spec_schema(compose, schema):
    jsonschema.Draft201909Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft201909Validator(schema).iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_catches_mistakes(compose, schema):
    """The schema is not a rubber stamp: typical mistakes are refused."""
    v = jsonschema.Draft201909Validator(schema)
    for break_it in (
        lambda c: c["services"]["web"].update(prots=["8000:8000"]),
        lambda c: c["services"]["web"].update(depends_on={"redis": {"condition": "healthy"}}),
        lambda c: c["services"]["redis"]["healthcheck"].update(retries="many"),
        lambda c: c.update(service={}),
    ):
        bad = json.loads(json.dumps(compose))
        break_it(bad)
        assert list(v.iter_errors(bad)), break_it


def test_services_present(compose):
    services = compose["services"]
    for name in ("postgres", "redis", "migrate", "web", "coordinator", "beat"):
        assert name in services
    for slug in DEMO_POOLS:
        assert f"worker-{slug}" in services


def argv(service) -> list[str]:
    cmd = service["command"]
    return cmd if isinstance(cmd, list) else shlex.split(cmd)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("slug", DEMO_POOLS)
def test_pool_workers_consume_their_queue(compose, slug):
    svc = compose["services"][f"worker-{slug}"]
    args = argv(svc)
    assert args[:4] == ["celery", "-A", "diloco_platform", "worker"]
    assert flag(args, "-Q") == f"pool.{slug}"
    assert flag(args, "-n").startswith(f"{slug}@")
    assert flag(args, "--prefetch-multiplier") == "1"
    assert svc["environment"]["DILOCO_POOL"] == slug
    assert svc["environment"]["NODE_PREFIX"] == slug
    assert "DATABASE_URL" in svc["environment"] and "REDIS_URL" in svc["environment"]


def test_coordinator_and_beat(compose):
    args = argv(compose["services"]["coordinator"])
    assert flag(args, "-Q") == "coordinator"
    assert "DILOCO_POOL" not in compose["services"]["coordinator"]["environment"]
    assert argv(compose["services"]["beat"])[:4] == ["celery", "-A", "diloco_platform", "beat"]
    assert argv(compose["services"]["web"])[-1] == "diloco_platform.asgi:application"


def test_every_long_running_service_has_a_health_check(compose):
    for name, svc in compose["services"].items():
        hc = svc.get("healthcheck")
        assert hc, name
        if name == "migrate":
            assert hc.get("disable") is True
            continue
        assert hc["test"] and not hc.get("disable"), name


def test_dependencies_exist_and_wait_for_health(compose):
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            assert dep != name
            want = "service_completed_successfully" if dep == "migrate" else "service_healthy"
            assert cond["condition"] == want, (name, dep)
    assert services["web"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_named_volumes_are_declared(compose):
    declared = set(compose["volumes"])
    used = set()
    for svc in compose["services"].values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0] if isinstance(vol, str) else vol["source"]
            if not src.startswith((".", "/")):
                used.add(src)
    assert used == declared
    assert {"pgdata", "redisdata"} <= used


def test_app_services_share_the_same_image_and_settings(compose):
    app = [s for n, s in compose["services"].items() if n not in ("postgres", "redis")]
    assert {s["image"] for s in app} == {"diloco-platform:latest"}
    for s in app:
        env = s["environment"]
        assert env["DATABASE_URL"].startswith("postgres://") and "@postgres:5432/" in env["DATABASE_URL"]
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        assert env["SECRET_KEY"].startswith("${SECRET_KEY:?")  # refuses to start without one


def test_migrate_imports_an_existing_fleet_file(compose):
    cmd = " ".join(argv(compose["services"]["migrate"]))
    path = re.search(r"import_inventory (?:--only-new )?(\S+)", cmd).group(1)
    assert (ROOT / path).is_file()


def test_dockerfile():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11" in text
    pins = re.findall(r"torch==([\d.]+)", text)
    assert pins and set(pins) == set(re.findall(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()))
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        if src != ".":
            assert (ROOT / src).exists(), src
    assert "USER diloco" in text


def test_procfile_has_every_process():
    lines = dict(
        line.split(":", 1)
        for line in (ROOT / "Procfile").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"web", "coordinator", "beat"} <= set(lines)
    for slug in DEMO_POOLS:
        cmd = lines[slug.replace("-", "_")]
        assert f"DILOCO_POOL={slug}" in cmd and f"-Q pool.{slug}" in cmd


def test_durations_are_compose_durations(compose):
    """The schema marks durations with a format it does not check; check them here."""
    duration = re.compile(r"^(\d+(\.\d+)?(us|ms|s|m|h))+$")
    for name, svc in compose["services"].items():
        for key in ("interval", "timeout", "start_period"):
            value = (svc.get("healthcheck") or {}).get(key)
            if value is not None:
                assert duration.match(value), (name, key, value)
