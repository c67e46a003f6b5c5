"""Hostile input: malformed JSON, wrong types, huge numbers, unicode, unknown fields: 4xx, never 5xx."""
from __future__ import annotations

import json

import pytest

from apps.jobs.models import Job

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"


def post_raw(client, url, body: bytes | str, content_type="application/json"):
    return client.generic("POST", url, body, content_type=content_type)


@pytest.mark.parametrize("body", [
    b"{", b"", b"   ", b"null", b"[1,2", b'{"spec": }', b"\xff\xfe{}", b'{"spec": NaN}',
    b'{"spec": {"learners": Infinity}}', b"1e999999", b'{"spec": {"learners": 1' + b"0" * 5000 + b"}}",
    b"[" * 100000 + b"]" * 100000, b'{"a":' * 50 + b"1" + b"}" * 50,
])
def test_malformed_json_is_400(as_alice, body):
    r = post_raw(as_alice, JOBS, body)
    assert r.status_code == 400, (body[:40], r.status_code, r.content[:200])
    assert r.json()["detail"]
    assert Job.objects.count() == 0


@pytest.mark.parametrize(("spec", "field"), [
    ({"learners": "four"}, "spec.learners"),
    ({"learners": 10**30}, "spec.learners"),
    ({"learners": 4.5}, "spec.learners"),
    ({"learners": True, "steps": [1]}, "spec.steps"),
    ({"outer_lr": 1e308}, "spec.outer_lr"),
    ({"steps": -1}, "spec.steps"),
    ({"name": "x" * 101}, "spec.name"),
    ({"name": "\u202egnp.exe"}, "spec.name"),
    ({"name": "emoji \U0001f680"}, "spec.name"),
    ({"name": "zero\u200bwidth"}, "spec.name"),
    ({"model": "os:system"}, None),  # a factory path is syntactically allowed; it must not 500
    ({"dataset": "../../../etc/passwd"}, "spec.dataset"),
    ({"dataset": "stdlib\x01"}, "spec.dataset"),
    ({"pools": ["a" * 41]}, "spec.pools"),
    ({"pools": "pool-a"}, "spec.pools"),
    ({"pools": list(range(100))}, "spec.pools"),
    ({"unknown_field": 1}, "spec.unknown_field"),
    ({"learners": None}, "spec.learners"),
    ({"seed": -1}, "spec.seed"),
    ({"syncer_shards": 0}, "spec.syncer_shards"),
    ({"fragments": 2, "syncer_shards": 3}, "spec.syncer_shards"),  # a shard merges whole fragments
])
def test_bad_spec_fields_are_400_with_paths(as_alice, spec, field):
    r = as_alice.post(JOBS, {"spec": {"name": "h", **spec}}, format="json")
    if field is None:
        assert r.status_code in (201, 400)
        return
    assert r.status_code == 400, (spec, r.content[:300])
    assert field in r.json()["errors"], r.json()


@pytest.mark.parametrize("body", [
    '{"spec": {"name": "\\ud800"}}',          # lone surrogate
    '{"spec": {"name": "a\\u0000b"}}',        # NUL
    '{"spec": {"\\udfff": 1}}',               # bad key
    '{"spec": {}, "team": "\\u0000"}',
])
def test_unicode_oddities_are_400(as_alice, body):
    r = post_raw(as_alice, JOBS, body.encode())
    assert r.status_code == 400, r.content
    assert "not allowed" in r.json()["detail"]


def test_wrong_content_type_is_415(as_alice):
    r = post_raw(as_alice, JOBS, "spec=1", content_type="application/x-www-form-urlencoded")
    assert r.status_code == 415 and r.json()["errors"]["detail"]


def test_body_size_limit_is_413(as_alice, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    r = post_raw(as_alice, JOBS, json.dumps({"spec": {"name": "x" * 2000}}))
    assert r.status_code == 413 and "too large" in r.json()["detail"]


@pytest.mark.parametrize("url", [
    "/api/v1/jobs/?offset=99999999999999999999999",
    "/api/v1/jobs/?limit=99999999999999999999999",
    "/api/v1/jobs/?limit=-5&offset=-3",
    "/api/v1/jobs/99999999999999999/",
    "/api/v1/jobs/999999999999999999999999/",
    "/api/v1/jobs/?search=%00",
    "/api/v1/jobs/?search=%ED%A0%80",
    "/api/v1/pools/?search=" + "x" * 3000,
    "/api/v1/events/?after=99999999999999999999999999",
    "/api/v1/events/?job=-1",
    "/api/v1/checkpoints/?job=1e9",
    "/api/v1/nodes/?pool=%00",
    "/api/v1/incidents/?open=maybe",
])
def test_hostile_query_strings_never_500(as_alice, alice_job, url):
    r = as_alice.get(url)
    assert r.status_code in (200, 400, 404), (url, r.status_code)
    assert r["Content-Type"].startswith("application/json")


def test_unknown_fields_on_writes(as_staff, pool_a):
    r = as_staff.patch("/api/v1/pools/pool-a/", {"device_count": 2, "is_admin": True}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"is_admin": ["Unknown field."]}


def test_huge_numbers_on_inventory(as_staff, pool_a):
    for body in ({"device_count": 10**40}, {"link_gbps": 1e308}, {"cost_per_device_hour": "1e30"},
                 {"speed_factor": -1}, {"latency_ms": "NaN"}):
        r = as_staff.patch("/api/v1/pools/pool-a/", body, format="json")
        assert r.status_code == 400, (body, r.content)
        assert set(r.json()["errors"]) == set(body)


def test_unknown_api_paths_are_json_404(as_alice, anon):
    r = as_alice.get("/api/v1/no-such-thing/")
    assert r.status_code == 404 and r.json()["errors"] == {"detail": ["Not found."]}
    r = anon.post("/api/v1/jobs", {"spec": {}}, format="json")
    assert r.status_code == 404 and "trailing slash" in r.json()["detail"]
    r = as_alice.get("/api/v1/jobs?status=running")
    assert r.status_code == 301 and r["Location"] == "/api/v1/jobs/?status=running"
