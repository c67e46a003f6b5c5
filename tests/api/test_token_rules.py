"""Rules for issuing personal tokens, the same through the API and the dashboard: a token
never mints one that outlives it, and a user holds at most MAX_ACTIVE_TOKENS active tokens."""
from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.api.authentication import MAX_ACTIVE_TOKENS
from apps.api.models import ApiToken

from .conftest import client_for

TOKENS = "/api/v1/auth/tokens/"


def _expiry(resp) -> datetime | None:
    value = resp.json()["expires_at"]
    return None if value is None else datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.mark.django_db
def test_a_token_never_mints_one_that_outlives_it(alice):
    minter, raw = ApiToken.issue(alice, "one-day", expires_at=timezone.now() + timedelta(days=1))
    c = client_for(token=raw)
    forever = c.post(TOKENS, {"name": "forever"}, format="json")
    assert forever.status_code == 201
    assert _expiry(forever) == minter.expires_at  # capped, not "never"
    longer = c.post(TOKENS, {"name": "a-month", "expires_in_days": 30}, format="json")
    assert longer.status_code == 201 and _expiry(longer) == minter.expires_at
    # nor through a child: the cap follows the chain
    child = client_for(token=forever.json()["token"])
    grandchild = child.post(TOKENS, {"name": "grandchild"}, format="json")
    assert grandchild.status_code == 201 and _expiry(grandchild) == minter.expires_at


@pytest.mark.django_db
def test_a_shorter_expiry_is_kept_and_unlimited_tokens_mint_freely(alice):
    _, raw = ApiToken.issue(alice, "ten-days", expires_at=timezone.now() + timedelta(days=10))
    r = client_for(token=raw).post(TOKENS, {"name": "two-days", "expires_in_days": 2}, format="json")
    assert r.status_code == 201
    assert abs(_expiry(r) - (timezone.now() + timedelta(days=2))) < timedelta(minutes=1)
    _, raw = ApiToken.issue(alice, "no-expiry")
    assert _expiry(client_for(token=raw).post(TOKENS, {"name": "free"}, format="json")) is None


@pytest.mark.django_db
def test_signing_in_with_a_password_is_not_capped(anon, alice):
    r = anon.post("/api/v1/auth/token/", {"username": "alice", "password": "pw-alice-123"}, format="json")
    assert r.status_code == 201 and _expiry(r) is None


@pytest.mark.django_db
def test_the_active_token_cap_counts_tokens_from_both_doors(alice):
    past = timezone.now() - timedelta(seconds=1)
    for i in range(3):
        ApiToken.issue(alice, f"expired-{i}", expires_at=past)  # not active: not counted
    browser = Client()
    browser.force_login(alice)
    for i in range(MAX_ACTIVE_TOKENS - 2):
        assert browser.post("/account/tokens/", {"action": "create", "name": f"d{i}"}).status_code == 201
    c = client_for(alice)  # one more through the model: MAX - 1 active
    assert c.post(TOKENS, {"name": "last-one"}, format="json").status_code == 201
    r = c.post(TOKENS, {"name": "one-too-many"}, format="json")
    assert r.status_code == 400
    refusal = f"You already have {MAX_ACTIVE_TOKENS} active tokens; revoke some."
    assert r.json()["errors"] == {"name": [refusal]}
    r = browser.post("/account/tokens/", {"action": "create", "name": "from-the-dashboard"})
    assert r.status_code == 200 and r.context["new_key"] is None
    assert f"{MAX_ACTIVE_TOKENS} active tokens" in r.content.decode()
    assert ApiToken.objects.filter(user=alice, revoked_at__isnull=True).count() == MAX_ACTIVE_TOKENS + 3
