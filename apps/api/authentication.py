"""API authentication: personal API tokens for people, pool tokens for workers.

Both travel as `Authorization: Bearer <key>` (`Token <key>` is accepted too). A personal
token starts with `dl_`, a pool token with `pt_`; each authenticator only looks at its own
kind, so a pool token never signs in as a user and a user token never acts as a worker.

`issue_token` holds the rules for new personal tokens, for the API and the dashboard alike.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions

from apps.inventory.models import Pool, PoolToken

from .models import TOKEN_PREFIX, ApiToken

_KEYWORDS = (b"bearer", b"token")

MAX_ACTIVE_TOKENS = 50


class TokenRefused(ValueError):
    """A new token would break a rule; the message says which, for the user."""


def issue_token(user, name: str, expires_at: datetime | None = None,
                minted_by: ApiToken | None = None) -> tuple[ApiToken, str]:
    """Issue a personal token: (row, raw key), or TokenRefused.

    A user holds at most MAX_ACTIVE_TOKENS active (neither revoked nor expired) tokens, so a
    leaked session cannot scatter credentials without bound. A token minted with another token
    (`minted_by`) expires no later than that one: a short-lived CI token cannot launder itself
    into a permanent one. The user's row is locked while counting, so concurrent requests
    cannot overshoot the cap.
    """
    if minted_by is not None and minted_by.expires_at is not None:
        expires_at = min(expires_at or minted_by.expires_at, minted_by.expires_at)
    with transaction.atomic():
        get_user_model().objects.select_for_update().filter(pk=user.pk).exists()  # lock the user row
        now = timezone.now()
        active = ApiToken.objects.filter(user=user, revoked_at__isnull=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        if active.count() >= MAX_ACTIVE_TOKENS:
            raise TokenRefused(f"You already have {MAX_ACTIVE_TOKENS} active tokens; revoke some.")
        return ApiToken.issue(user, name, expires_at=expires_at)


def _raw_key(request) -> str | None:
    """The key from the Authorization header, or None when there is no such header."""
    header = authentication.get_authorization_header(request).split()
    if not header or header[0].lower() not in _KEYWORDS:
        return None
    if len(header) != 2:
        raise exceptions.AuthenticationFailed("Invalid Authorization header: expected 'Bearer <token>'.")
    try:
        return header[1].decode("ascii")
    except UnicodeDecodeError:
        raise exceptions.AuthenticationFailed("Invalid token: must be ASCII.") from None


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """Personal API tokens (apps.api.models.ApiToken)."""

    keyword = "Bearer"
    touch_every = timedelta(minutes=1)

    def authenticate(self, request):
        raw = _raw_key(request)
        if raw is None:
            return None
        if not raw.startswith(TOKEN_PREFIX):
            raise exceptions.AuthenticationFailed("Invalid token.")
        tok = ApiToken.lookup(raw)
        if tok is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        now = timezone.now()
        if tok.last_used_at is None or now - tok.last_used_at > self.touch_every:
            ApiToken.objects.filter(pk=tok.pk).update(last_used_at=now)
        return tok.user, tok

    def authenticate_header(self, request) -> str:
        return self.keyword


class PoolPrincipal:
    """The identity of a worker: a pool, not a person."""

    is_authenticated = True
    is_active = True
    is_staff = False
    is_superuser = False
    is_anonymous = False

    def __init__(self, pool: Pool):
        self.pool = pool
        self.pk = None
        self.id = None

    def __str__(self) -> str:
        return f"pool:{self.pool.slug}"


class PoolTokenAuthentication(authentication.BaseAuthentication):
    """Worker credentials (apps.inventory.models.PoolToken); only used on /api/v1/agent/."""

    keyword = "Bearer"

    def authenticate(self, request):
        raw = _raw_key(request)
        if raw is None:
            return None
        pool = PoolToken.authenticate(raw) if raw.startswith("pt_") else None
        if pool is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked pool token.")
        return PoolPrincipal(pool), pool

    def authenticate_header(self, request) -> str:
        return self.keyword
