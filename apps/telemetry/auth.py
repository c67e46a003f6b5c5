"""The coordinator's credential on the agent socket."""
from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def coordinator_token() -> str:
    """The coordinator's token: `COORDINATOR_TOKEN`, else the random one settings made in var/.

    Never derived from SECRET_KEY, so knowing (or guessing) the key gives no way onto the
    agent socket as the coordinator.
    """
    return getattr(settings, "COORDINATOR_TOKEN", "") or ""


def is_coordinator_token(presented: str) -> bool:
    """Constant-time check of a presented token against the coordinator's (compared as hashes)."""
    expected = coordinator_token()
    if not expected or not presented:
        return False
    return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(),
                               hashlib.sha256(expected.encode()).digest())
