"""ApiToken.lookup: on PostgreSQL one hand-written statement brings the token, its user and the
user's teams (apps/api/models.py). It must load exactly what the ORM loads and refuse exactly
what the ORM path refuses."""
from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import Group
from django.db import connection
from django.forms.models import model_to_dict
from django.utils import timezone

from apps.api.models import ApiToken
from apps.jobs import access

pytestmark = pytest.mark.django_db


def _orm(key_hash: str) -> ApiToken:
    return ApiToken.objects.select_related("user").get(key_hash=key_hash)


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def test_the_token_and_its_user_are_what_the_orm_loads(alice, vision):
    alice.last_login = timezone.now()
    alice.save()
    tok, raw = ApiToken.issue(alice, "ci", expires_at=timezone.now() + dt.timedelta(days=1))
    got = ApiToken.lookup(raw)
    want = _orm(tok.key_hash)
    assert _fields(got) == _fields(want)
    assert _fields(got.user) == _fields(want.user)
    assert model_to_dict(got.user) == model_to_dict(want.user)  # groups through the ORM, as before
    assert got.user.is_authenticated and got.user.pk == alice.pk


def test_the_users_teams_come_with_the_token_in_one_query(alice, vision, django_assert_num_queries):
    Group.objects.create(name="speech").user_set.add(alice)
    Group.objects.create(name="not-alices")
    _, raw = ApiToken.issue(alice, "ci")
    with django_assert_num_queries(1):
        tok = ApiToken.lookup(raw)
        teams = access.team_names(tok.user)
    assert sorted(teams) == ["speech", "vision"]
    assert sorted(teams) == sorted(access.team_names(_orm(tok.key_hash).user))  # the ORM's answer


def test_a_user_without_teams_has_none(bob):
    _, raw = ApiToken.issue(bob, "ci")
    assert access.team_names(ApiToken.lookup(raw).user) == []


def test_revoked_expired_inactive_and_unknown_tokens_are_refused(alice, bob):
    revoked, raw_revoked = ApiToken.issue(alice, "a")
    revoked.revoke()
    _, raw_expired = ApiToken.issue(alice, "b", expires_at=timezone.now() - dt.timedelta(seconds=1))
    _, raw_inactive = ApiToken.issue(bob, "c")
    bob.is_active = False
    bob.save()
    unknown = ("dl_" + "x" * 43, "dl_", "", "pt_abc", "dl_" + "y" * 200)
    for raw in (raw_revoked, raw_expired, raw_inactive, *unknown):
        assert ApiToken.lookup(raw) is None, raw


def test_the_statement_runs_on_postgresql():
    """The suite runs on PostgreSQL (the Makefile): the hand-written path is the one tested."""
    assert connection.vendor == "postgresql"
