"""Issue 35, Low findings on the HTTP side: Unicode digits and NUL in query strings, unknown keys
echoed one by one, the token endpoints' body size and rate.

A "²" is a digit to str.isdigit() and not to int(): each parameter below was a 500.
"""
from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from django.test import Client

from apps.api.models import ApiToken

from .conftest import client_for, make_job

pytestmark = pytest.mark.django_db

SUP2 = quote("²")  # U+00B2 SUPERSCRIPT TWO


def _signed_in(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


# ---------------------------------------------------------------------------- Unicode digits
@pytest.mark.parametrize("query", [f"jobs={SUP2}", f"jobs=1,{SUP2}", "jobs=1&baseline=" + SUP2,
                                   f"jobs=%23{SUP2}"])
def test_api_compare_refuses_unicode_digits_with_400(as_alice, alice_job, query):
    query = query.replace("jobs=1", f"jobs={alice_job.pk}")
    r = as_alice.get(f"/api/v1/compare/?{query}")
    assert r.status_code == 400, r.content[:300]


@pytest.mark.parametrize("query", [f"jobs={SUP2}", "jobs=1&baseline=" + SUP2])
def test_dashboard_compare_refuses_unicode_digits(alice, alice_job, query):
    query = query.replace("jobs=1", f"jobs={alice_job.pk}")
    r = _signed_in(alice).get(f"/compare/?{query}")
    assert r.status_code in (200, 400), r.status_code


@pytest.mark.parametrize("q", [SUP2, f"%23{SUP2}", "%23" + "1" * 30])
def test_dashboard_job_filter_unicode_digit_is_text(alice, alice_job, q):
    r = _signed_in(alice).get(f"/jobs/?q={q}")
    assert r.status_code == 200


@pytest.mark.parametrize("param", ["q", "owner", "team", "pool", "status"])
def test_dashboard_job_filter_nul_is_ignored(alice, alice_job, param):
    r = _signed_in(alice).get(f"/jobs/?{param}=a%00b")
    assert r.status_code == 200
    assert alice_job.name in r.content.decode()  # the filter was dropped, not applied


def test_api_job_search_unicode_digit(as_alice, alice_job):
    r = as_alice.get(f"/api/v1/jobs/?search={SUP2}")
    assert r.status_code == 200
    assert r.json()["count"] == 0


def test_api_metrics_learner_unicode_digit_is_400(as_alice, alice_job):
    r = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/metrics/?learner={SUP2}")
    assert r.status_code == 400
    assert "learner" in r.json()["errors"]


def test_api_checkpoints_job_unicode_digit_is_empty(as_alice, alice_job):
    r = as_alice.get(f"/api/v1/checkpoints/?job={SUP2}")
    assert r.status_code == 200
    assert r.json()["count"] == 0


def test_agent_global_version_unicode_digit_is_400(alice, pool_a, token_a):
    job = make_job(alice, pool=pool_a, fragments=2, inner_steps=4)
    r = client_for(token=token_a).get(f"/api/v1/agent/jobs/{job.pk}/learners/0/global/1/?version={SUP2}")
    assert r.status_code == 400


# ---------------------------------------------------------------------------- unknown keys
def test_unknown_keys_are_named_at_most_ten_times(as_alice):
    body = {f"junk{i:05d}": 1 for i in range(3000)}
    r = as_alice.post("/api/v1/auth/tokens/", body, format="json")
    assert r.status_code in (400, 413)
    r = as_alice.post("/api/v1/pools/", body, format="json")
    assert r.status_code in (400, 403)
    if r.status_code == 400:
        errors = r.json()["errors"]
        named = [k for k, v in errors.items() if v == ["Unknown field."]]
        assert len(named) <= 10
        assert any("more unknown fields" in m for m in errors.get("non_field_errors", []))
        assert len(r.content) < 10_000


def test_unknown_keys_capped_in_a_serializer():
    from rest_framework import serializers

    from apps.api.serializers import MAX_UNKNOWN_NAMED, TokenCreateSerializer

    ser = TokenCreateSerializer(data={**{f"k{i:04d}": 1 for i in range(500)}, "name": "ok"})
    with pytest.raises(serializers.ValidationError) as exc:
        ser.is_valid(raise_exception=True)
    detail = exc.value.detail
    assert sum(1 for k in detail if k.startswith("k")) == MAX_UNKNOWN_NAMED
    assert "k0000" in detail and "k0009" in detail
    assert detail["non_field_errors"] == ["... and 490 more unknown fields."]


def test_a_few_unknown_keys_are_all_named(as_alice):
    r = as_alice.post("/api/v1/auth/tokens/", {"name": "x", "colour": 1, "size": 2}, format="json")
    assert r.status_code == 400
    errors = r.json()["errors"]
    assert errors["colour"] == ["Unknown field."] and errors["size"] == ["Unknown field."]
    assert "non_field_errors" not in errors


def test_error_responses_name_at_most_fifty_fields():
    from rest_framework import exceptions

    from apps.api.exceptions import MAX_ERROR_FIELDS, api_exception_handler

    exc = exceptions.ValidationError({f"f{i}": ["bad"] for i in range(400)})
    resp = api_exception_handler(exc, {})
    errors = resp.data["errors"]
    assert len([k for k in errors if k.startswith("f")]) == MAX_ERROR_FIELDS
    assert errors["non_field_errors"] == ["... and 350 more errors."]


# ---------------------------------------------------------------------------- token endpoints
@pytest.mark.parametrize("path", ["/api/v1/auth/token/", "/api/v1/auth/tokens/"])
def test_token_endpoints_refuse_a_large_body_before_decoding(as_alice, path):
    body = json.dumps({f"junk{i}": "x" for i in range(2000)})
    assert len(body) > 8192
    r = as_alice.post(path, body, content_type="application/json")
    assert r.status_code == 413, r.content[:300]
    assert len(r.content) < 1000


def test_obtain_token_still_works(anon, alice):
    r = anon.post("/api/v1/auth/token/", {"username": "alice", "password": "pw-alice-123", "name": "cli"},
                  format="json")
    assert r.status_code == 201


def test_token_creation_is_throttled_per_user(alice, settings):
    rf = dict(settings.REST_FRAMEWORK)
    rf["DEFAULT_THROTTLE_RATES"] = {**rf["DEFAULT_THROTTLE_RATES"], "token_create": "3/minute"}
    settings.REST_FRAMEWORK = rf
    c = client_for(alice)
    codes = [c.post("/api/v1/auth/tokens/", {"name": f"t{i}"}, format="json").status_code for i in range(5)]
    assert codes[:3] == [201, 201, 201]
    assert codes[3:] == [429, 429]
    assert c.get("/api/v1/auth/tokens/").status_code == 200  # reading is not counted
    # the dashboard's tokens page draws on the same counter
    page = _signed_in(alice)
    before = ApiToken.objects.filter(user=alice).count()
    r = page.post("/account/tokens/", {"action": "create", "name": "web"})
    assert "Too many new tokens" in r.content.decode()
    assert ApiToken.objects.filter(user=alice).count() == before


def test_a_spec_with_many_unknown_keys_names_ten_and_counts_the_rest(as_alice):
    """40,000 unknown spec keys were one pydantic error each (seconds of CPU); now the first ten
    are named before pydantic runs, the rest counted."""
    spec = {"name": "h", **{f"junk{i:05d}": 1 for i in range(40_000)}}
    r = as_alice.post("/api/v1/jobs/", {"spec": spec}, format="json")
    assert r.status_code == 400, r.content[:300]
    errors = r.json()["errors"]
    named = [k for k in errors if k.startswith("spec.junk")]
    assert named == [f"spec.junk{i:05d}" for i in range(10)]
    counted = errors.get("spec", errors.get("spec.non_field_errors", []))
    assert any("39990 more unknown fields" in m for m in counted)
    assert len(r.content) < 10_000
