"""The coordinator's credential on the agent socket."""
from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def coordinator_token() -> str:
    """`COORDINATOR_TOKEN` from the environment; when unset, derived from SECRET_KEY.

    Every process of one deployment shares SECRET_KEY (the embedded default uses the built-in
    development key), so the coordinator and the web server agree without extra setup, and
    nobody without the SECRET_KEY can compute it.
    """
    explicit = getattr(settings, "COORDINATOR_TOKEN", "") or ""
    if explicit:
        return explicit
    key = (settings.SECRET_KEY or "").encode()
    if not key:
        return ""
    return "ct_" + hmac.new(key, b"diloco-coordinator-token", hashlib.sha256).hexdigest()
