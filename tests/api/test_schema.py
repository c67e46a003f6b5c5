"""The OpenAPI schema, and schemathesis against it in-process: no 5xx, responses match the schema."""
from __future__ import annotations

import os

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from apps.api.models import ApiToken

from .conftest import make_job

MAX_EXAMPLES = int(os.environ.get("API_FUZZ_EXAMPLES", "8"))  # raise it for a deeper local run
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture
def _keep_test_connection():
    """Like Django's test client: requests must not close the test transaction's connection."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(db, alice, pool_a, settings, _keep_test_connection):
    # generous limits: the fuzzer should explore, not hit the rate limits
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                               "DEFAULT_THROTTLE_RATES": {"auth": "100000/minute",
                                                          "job_create": "100000/minute"}}
    make_job(alice, pool=pool_a)
    return schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())


def test_schema_is_served(client, db):
    r = client.get("/api/schema/?format=json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    paths = set(doc["paths"])
    for p in ("/api/v1/jobs/", "/api/v1/jobs/{id}/metrics/", "/api/v1/jobs/dry-run/",
              "/api/v1/pools/{slug}/drain/",
              "/api/v1/auth/token/", "/api/v1/agent/jobs/{job_id}/learners/{index}/",
              "/api/v1/checkpoints/{id}/download/"):
        assert p in paths, p
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    page = docs.content.decode()
    assert "drf_spectacular_sidecar/swagger-ui-dist" in page and "cdn." not in page  # works offline


def test_nullable_relations_are_nullable_in_the_schema(client, db):
    """A learner not yet placed has no pool or node, a job's event or incident may name no pool:
    the schema must allow the nulls the API sends (the fuzzer found `node: null` against it)."""
    schemas = client.get("/api/schema/?format=json").json()["components"]["schemas"]
    for name, field in (("Learner", "pool"), ("Learner", "node"), ("Event", "pool"), ("Incident", "pool")):
        assert schemas[name]["properties"][field].get("nullable") is True, (name, field)


def _runner(op, auth: str, max_examples: int = MAX_EXAMPLES):
    @given(case=op.as_strategy())
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case):
        case.call_and_validate(headers={"Authorization": f"Bearer {auth}"}, checks=CHECKS)

    return run


def test_api_fuzz(api_schema, staff_user, token_a):
    """Every operation gets MAX_EXAMPLES generated cases. (schemathesis' pytest plugin does not
    run under pytest 9, so the operations are walked here with hypothesis directly.)"""
    user_token = ApiToken.issue(staff_user, "fuzz")[1]
    failures, ran = [], 0
    for result in api_schema.get_all_operations():
        op = result.ok()
        auth = token_a if "/agent/" in op.path else user_token

        run = _runner(op, auth)
        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # collect every operation's failure
            failures.append(f"{op.method.upper()} {op.path}: {str(exc)[:1500]}")
        ran += 1
    assert ran >= 40
    assert not failures, "\n\n".join(failures)


def test_schema_generates_without_warnings(tmp_path):
    from django.core.management import call_command

    out = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    assert "/api/v1/jobs/{id}/cancel/" in out.read_text()


def test_api_fuzz_as_a_regular_user(api_schema, bob):
    """The same walk with a user who owns nothing and may not write the fleet: 403/404, never 5xx."""
    token = ApiToken.issue(bob, "fuzz")[1]
    failures = []
    for result in api_schema.get_all_operations():
        op = result.ok()
        if "/agent/" in op.path or op.method.upper() == "GET":
            continue  # reads are covered above; here: every write as someone without rights
        try:
            _runner(op, token, max_examples=3)()
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{op.method.upper()} {op.path}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
