"""Limits on what untrusted peers of the websockets may do (docs/telemetry.md, docs/security.md).

- Pool tokens (`TokenRegistry`, one per event loop, i.e. per web process): at most
  `TELEMETRY_MAX_SOCKETS_PER_TOKEN` open agent sockets per token, a shared bucket of
  `TELEMETRY_MAX_BYTES_PER_S` bytes per second over all of them (senders are slowed down,
  not refused), and a check of every open token against the database every
  `TELEMETRY_TOKEN_CHECK_S` (one query for all of them), so a revoked token's idle socket
  is closed too. Revocation also closes them at once through the group `agent.token.<hash>`
  (`publish.close_token_sockets`).
- Pool events (`EventsGate`): at most `TELEMETRY_MAX_POOL_EVENTS_PER_MIN` per job and minute.
- Dashboard sockets (`access_allowed`): the session, the user and the job's visibility read
  again, as a request would.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections import deque
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings

log = logging.getLogger(__name__)

BURST_S = 2.0
MAX_GATED_JOBS = 10_000


def _setting(name: str, default: Any) -> Any:
    """A Django setting, else the environment variable of that name, else `default`."""
    if hasattr(settings, name):
        return getattr(settings, name)
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return type(default)(float(raw)) if isinstance(default, int) else type(default)(raw)
    except ValueError:
        log.warning("ignoring %s=%r (not a number); using %s", name, raw, default)
        return default


class TokenState:
    """The open sockets of one pool token and its bytes bucket."""

    def __init__(self) -> None:
        self.sockets: set = set()
        self.rate = float(_setting("TELEMETRY_MAX_BYTES_PER_S", 256 * 1024))
        self.bucket = BURST_S * self.rate
        self.at = time.monotonic()

    def _refill(self, now: float) -> None:
        self.bucket = min(BURST_S * self.rate, self.bucket + (now - self.at) * self.rate)
        self.at = now

    def take_bytes(self, size: int) -> float:
        """Spend `size` bytes; returns how long the sender should wait (0: not at all)."""
        if self.rate <= 0:
            return 0.0
        self._refill(time.monotonic())
        self.bucket -= size
        return -self.bucket / self.rate if self.bucket < 0 else 0.0

    def idle(self, now: float) -> bool:
        if self.sockets:
            return False
        self._refill(now)
        return self.rate <= 0 or self.bucket >= BURST_S * self.rate


class TokenRegistry:
    def __init__(self) -> None:
        self.tokens: dict[str, TokenState] = {}
        self.task: asyncio.Task | None = None

    def join(self, consumer, key_hash: str) -> TokenState | None:
        """Count a new socket of this token; None when the token has too many already."""
        state = self.tokens.get(key_hash)
        if state is None:
            state = self.tokens[key_hash] = TokenState()
        cap = int(_setting("TELEMETRY_MAX_SOCKETS_PER_TOKEN", 256))
        if cap > 0 and len(state.sockets) >= cap:
            log.warning("pool token %s...: refused a socket over the cap of %d", key_hash[:8], cap)
            return None
        state.sockets.add(consumer)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._watch())
        return state

    def leave(self, consumer) -> None:
        state = self.tokens.get(getattr(consumer, "token_hash", ""))
        if state is not None:
            state.sockets.discard(consumer)
        if not any(s.sockets for s in self.tokens.values()) and self.task is not None:
            self.task.cancel()  # nothing left to watch; the next socket starts it again
            self.task = None

    def count(self, key_hash: str) -> int:
        state = self.tokens.get(key_hash)
        return len(state.sockets) if state else 0

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(float(_setting("TELEMETRY_TOKEN_CHECK_S", 5.0)))
            now = time.monotonic()
            for h in [h for h, s in self.tokens.items() if s.idle(now)]:
                del self.tokens[h]
            hashes = [h for h, s in self.tokens.items() if s.sockets]
            if not hashes:
                return
            try:
                active = await database_sync_to_async(_active_hashes)(hashes)
            except Exception:
                log.warning("pool token check failed; trying again", exc_info=True)
                continue
            for h in hashes:
                if h in active:
                    continue
                for consumer in list(self.tokens.get(h, TokenState()).sockets):
                    with contextlib.suppress(Exception):
                        await consumer.agent_revoked({"type": "agent.revoked"})


def _active_hashes(hashes: list[str]) -> set[str]:
    from apps.inventory.models import PoolToken

    return set(PoolToken.objects.filter(key_hash__in=hashes, revoked_at__isnull=True)
               .values_list("key_hash", flat=True))


_registries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_registry() -> TokenRegistry:
    """The registry of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    reg = _registries.get(loop)
    if reg is None:
        reg = _registries[loop] = TokenRegistry()
    return reg


class EventsGate:
    """Events from pools per job and minute (sliding window)."""

    def __init__(self) -> None:
        self.jobs: dict[int, deque] = {}

    @property
    def limit(self) -> int:
        return int(_setting("TELEMETRY_MAX_POOL_EVENTS_PER_MIN", 60))

    def allow(self, job_id: int) -> bool:
        limit = self.limit
        if limit <= 0:
            return True
        now = time.monotonic()
        times = self.jobs.get(job_id)
        if times is None:
            if len(self.jobs) >= MAX_GATED_JOBS:
                self.jobs = {j: t for j, t in self.jobs.items() if t and now - t[-1] < 60.0}
            times = self.jobs[job_id] = deque()
        while times and now - times[0] > 60.0:
            times.popleft()
        if len(times) >= limit:
            return False
        times.append(now)
        return True


_gate = EventsGate()


def events_gate() -> EventsGate:
    return _gate


def access_allowed(session_key: str | None, user_pk: int, job_id: int | None) -> bool:
    """Whether a dashboard socket's user still may watch: the session still signs this user
    in (not logged out, not expired, password unchanged), the user is active, and the job
    (if any) is still visible to them (apps.jobs.access)."""
    from django.contrib.auth import get_user, get_user_model
    from django.http import HttpRequest

    from apps.jobs.access import visible_jobs
    from apps.jobs.models import Job

    if session_key is not None:
        request = HttpRequest()
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user = get_user(request)  # AnonymousUser unless the session is still valid
    else:
        user = get_user_model().objects.filter(pk=user_pk, is_active=True).first()
    if user is None or not user.is_authenticated or user.pk != user_pk or not user.is_active:
        return False
    if job_id is None:
        return True
    return visible_jobs(user, Job.objects.filter(pk=job_id)).exists()
