"""Rate limits on signing in and on job creation (rates in REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']).

Rates are read on every request (not at import as DRF's SimpleRateThrottle does), so a
settings override in tests or a reloaded config takes effect at once. The counters live
in the default cache (Redis when REDIS_URL is set, shared by every web process).

The dashboard's sign-in and new-job pages apply these same classes through `throttle_wait`,
so a browser and an API client draw on one allowance: there is one policy, not two.
"""
from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable

from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle


class _LiveRateThrottle(SimpleRateThrottle):
    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)


class AuthRateThrottle(_LiveRateThrottle):
    """Token creation with username/password: per client address and per username."""

    scope = "auth"

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class AuthUsernameThrottle(_LiveRateThrottle):
    """Token creation per username, whatever address it comes from (distributed guessing)."""

    scope = "auth_user"

    def get_cache_key(self, request, view):
        # a DRF request parses any body into .data; a plain Django one (the dashboard's form) has .POST
        data = request.data if hasattr(request, "data") else request.POST
        username = data.get("username") if isinstance(data, dict) else None
        if not isinstance(username, str) or not username:
            return None
        ident = hashlib.sha256(username.strip().lower()[:150].encode("utf-8", "replace")).hexdigest()
        return self.cache_format % {"scope": self.scope, "ident": ident}


class _PerUserPostThrottle(_LiveRateThrottle):
    """POSTs per signed-in user (per address when anonymous); other methods are free."""

    def allow_request(self, request, view):
        if request.method != "POST":
            return True
        return super().allow_request(request, view)

    def get_cache_key(self, request, view):
        ident = request.user.pk if request.user and request.user.is_authenticated else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}


class JobCreateThrottle(_PerUserPostThrottle):
    """Job submissions per user (dry runs included)."""

    scope = "job_create"


class TokenCreateThrottle(_PerUserPostThrottle):
    """New API tokens per signed-in user (POST /api/v1/auth/tokens/ and the dashboard's tokens
    page). Rate: DEFAULT_THROTTLE_RATES["token_create"], else API_THROTTLE_TOKEN_CREATE from the
    environment, else TOKEN_CREATE_RATE."""

    scope = "token_create"

    def get_rate(self):
        return super().get_rate() or os.environ.get("API_THROTTLE_TOKEN_CREATE") or TOKEN_CREATE_RATE


TOKEN_CREATE_RATE = "60/minute"  # noqa: S105 (a rate, not a secret)
AUTH_THROTTLES = (AuthRateThrottle, AuthUsernameThrottle)
JOB_CREATE_THROTTLES = (JobCreateThrottle,)
TOKEN_CREATE_THROTTLES = (TokenCreateThrottle,)


def throttle_wait(request, throttles: Iterable[type[SimpleRateThrottle]]) -> int | None:
    """Count this request against `throttles` as a DRF view would (same rates, same cache keys).

    For views outside DRF (the dashboard). None when the request may go on, else the whole
    seconds to wait, for a Retry-After header and the message.
    """
    waits = [t.wait() for t in (cls() for cls in throttles) if not t.allow_request(request, None)]
    if not waits:
        return None
    return max(1, math.ceil(max((w for w in waits if w is not None), default=1)))
