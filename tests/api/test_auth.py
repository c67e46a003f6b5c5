"""Personal API tokens: obtain with username/password, list, revoke; rate limit; session auth."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.api.models import ApiToken

from .conftest import client_for

pytestmark = pytest.mark.django_db

TOKEN_URL = "/api/v1/auth/token/"


def test_obtain_token_and_use_it(anon, alice):
    r = anon.post(TOKEN_URL, {"username": "alice", "password": "pw-alice-123", "name": "ci"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["token"].startswith("dl_") and body["name"] == "ci" and body["username"] == "alice"
    row = ApiToken.objects.get(pk=body["id"])
    assert row.key_hash != body["token"] and body["token"] not in row.key_hash  # only the hash is stored
    me = client_for(token=body["token"]).get("/api/v1/auth/me/")
    assert me.status_code == 200 and me.json()["username"] == "alice"
    assert ApiToken.objects.get(pk=body["id"]).last_used_at is not None


@pytest.mark.parametrize("body", [
    {"username": "alice", "password": "wrong"},
    {"username": "nobody", "password": "x"},
])
def test_bad_credentials_are_401(anon, alice, body):
    r = anon.post(TOKEN_URL, body, format="json")
    assert r.status_code == 401
    assert r.json()["errors"]["detail"] == ["Unable to sign in with these credentials."]


def test_missing_and_unknown_fields_are_400(anon, alice):
    r = anon.post(TOKEN_URL, {"username": "alice"}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"password": ["This field is required."]}
    r = anon.post(TOKEN_URL, {"username": "alice", "password": "pw-alice-123", "admin": True}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"admin": ["Unknown field."]}


def test_inactive_user_cannot_get_or_use_tokens(anon, alice):
    tok, raw = ApiToken.issue(alice)
    alice.is_active = False
    alice.save()
    r = anon.post(TOKEN_URL, {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert r.status_code == 401
    assert client_for(token=raw).get("/api/v1/auth/me/").status_code == 401


def test_auth_is_rate_limited(anon, alice, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {
        "auth": "3/minute", "auth_user": "100/minute", "job_create": "100/minute"}}
    codes = [anon.post(TOKEN_URL, {"username": "alice", "password": "bad"}, format="json").status_code
             for _ in range(4)]
    assert codes == [401, 401, 401, 429]
    r = anon.post(TOKEN_URL, {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert r.status_code == 429 and "Retry-After" in r.headers
    # a forged X-Forwarded-For does not buy a fresh allowance (no trusted proxies configured)
    r = anon.post(TOKEN_URL, {"username": "alice", "password": "bad"}, format="json",
                  HTTP_X_FORWARDED_FOR="10.9.8.7")
    assert r.status_code == 429
    assert "throttled" in r.json()["detail"].lower()


def test_list_create_revoke_own_tokens(alice, bob):
    first, raw = ApiToken.issue(alice, "laptop")
    ApiToken.issue(bob, "bobs")
    c = client_for(token=raw)
    r = c.post("/api/v1/auth/tokens/", {"name": "ci-runner", "expires_in_days": 30}, format="json")
    assert r.status_code == 201 and r.json()["token"].startswith("dl_")
    new_id = r.json()["id"]
    names = sorted(t["name"] for t in c.get("/api/v1/auth/tokens/").json())
    assert names == ["ci-runner", "laptop"]  # not bob's, and the key is never listed again
    assert all("token" not in t for t in c.get("/api/v1/auth/tokens/").json())
    assert c.delete(f"/api/v1/auth/tokens/{new_id}/").status_code == 204
    assert ApiToken.objects.get(pk=new_id).revoked_at is not None
    assert [t["name"] for t in c.get("/api/v1/auth/tokens/").json()] == ["laptop"]
    # bob's token is invisible to alice
    bobs = ApiToken.objects.get(user=bob)
    assert c.delete(f"/api/v1/auth/tokens/{bobs.pk}/").status_code == 404
    assert ApiToken.objects.get(pk=bobs.pk).revoked_at is None


def test_password_not_accepted_on_signed_in_create(as_alice):
    r = as_alice.post("/api/v1/auth/tokens/", {"name": "x", "password": "pw"}, format="json")
    assert r.status_code == 400 and "password" in r.json()["errors"]


def test_revoked_and_expired_tokens_are_refused(alice):
    tok, raw = ApiToken.issue(alice)
    tok.revoke()
    r = client_for(token=raw).get("/api/v1/auth/me/")
    assert r.status_code == 401 and r.json()["errors"]["detail"]
    tok2, raw2 = ApiToken.issue(alice, expires_at=timezone.now() - timedelta(seconds=1))
    assert client_for(token=raw2).get("/api/v1/auth/me/").status_code == 401


@pytest.mark.parametrize("header", ["Bearer dl_nonsense", "Bearer", "Bearer a b", "Token pt_x_y",
                                    "Bearer \u00e9t\u00e9"])
def test_bad_authorization_headers(header):
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=header)
    r = c.get("/api/v1/auth/me/")
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"


def test_pool_token_is_not_a_user_token(token_a):
    assert client_for(token=token_a).get("/api/v1/jobs/").status_code == 401


def test_anonymous_gets_401(anon):
    r = anon.get("/api/v1/jobs/")
    assert r.status_code == 401
    assert r.json() == {"detail": "Authentication credentials were not provided.",
                        "errors": {"detail": ["Authentication credentials were not provided."]}}


def test_session_auth_for_the_browser(alice):
    c = APIClient(enforce_csrf_checks=True)
    c.force_login(alice)
    assert c.get("/api/v1/auth/me/").json()["username"] == "alice"
    # unsafe methods need the CSRF token with a session
    assert c.post("/api/v1/auth/tokens/", {"name": "x"}, format="json").status_code == 403


def test_auth_is_rate_limited_per_username(alice, bob, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {
        "auth": "100/minute", "auth_user": "2/minute", "job_create": "100/minute"}}
    codes = [APIClient(REMOTE_ADDR=f"10.0.0.{i}").post(TOKEN_URL, {"username": "Alice", "password": "x"},
                                                          format="json").status_code for i in range(3)]
    assert codes == [401, 401, 429]  # different addresses, same (case-folded) username
    r = APIClient(REMOTE_ADDR="10.0.0.9").post(TOKEN_URL, {"username": "bob", "password": "pw-bob-123"},
                                                format="json")
    assert r.status_code == 201  # other users are not affected
