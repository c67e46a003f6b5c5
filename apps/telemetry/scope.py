"""Who may report for what: a short-lived cache of job -> learners -> pool placements.

A pool token may only report for learners placed on its own pool, of jobs that are not
terminal. Looking that up per heartbeat would cost a query per message, so each job's
placement is cached for `TELEMETRY_SCOPE_TTL_S` seconds (default 2). A miss that could be a
fresh placement (learner moved to this pool, new incarnation, new job) re-reads the job at
most every `REFRESH_MIN_AGE_S`, so a migration is honoured within a fraction of a second and
a client that keeps asking for someone else's learner cannot hammer the database.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from channels.db import database_sync_to_async
from django.conf import settings

REFRESH_MIN_AGE_S = 0.25
MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class LearnerPlace:
    pk: int
    pool_id: int | None
    incarnation: int
    node_id: int | None = None


@dataclass
class JobScope:
    job_id: int
    exists: bool
    status: str = ""
    terminal: bool = False
    learners: dict[int, LearnerPlace] = field(default_factory=dict)
    fetched: float = 0.0

    def serves(self, pool_id: int) -> bool:
        return any(lp.pool_id == pool_id for lp in self.learners.values())


def _load(job_id: int) -> JobScope:
    from apps.jobs import state as st
    from apps.jobs.models import Job, Learner

    status = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
    if status is None:
        return JobScope(job_id, exists=False, fetched=time.monotonic())
    learners = {
        idx: LearnerPlace(pk, pool_id, inc, node_id)
        for idx, pk, pool_id, inc, node_id in Learner.objects.filter(job_id=job_id).values_list(
            "index", "pk", "pool_id", "incarnation", "node_id"
        )
    }
    return JobScope(job_id, True, status, status in st.TERMINAL, learners, time.monotonic())


class ScopeCache:
    def __init__(self, ttl: float | None = None):
        self.ttl = float(ttl if ttl is not None else getattr(settings, "TELEMETRY_SCOPE_TTL_S", 2.0))
        self._jobs: dict[int, JobScope] = {}
        self.loads = 0

    async def get(self, job_id: int) -> JobScope:
        js = self._jobs.get(job_id)
        if js is not None and time.monotonic() - js.fetched < self.ttl:
            return js
        return await self._fetch(job_id)

    async def refresh(self, job_id: int) -> JobScope:
        """Re-read unless the cached entry is younger than REFRESH_MIN_AGE_S."""
        js = self._jobs.get(job_id)
        if js is not None and time.monotonic() - js.fetched < REFRESH_MIN_AGE_S:
            return js
        return await self._fetch(job_id)

    async def _fetch(self, job_id: int) -> JobScope:
        js = await database_sync_to_async(_load)(job_id)
        self.loads += 1
        if len(self._jobs) >= MAX_ENTRIES:
            now = time.monotonic()
            self._jobs = {k: v for k, v in self._jobs.items() if now - v.fetched < self.ttl}
            if len(self._jobs) >= MAX_ENTRIES:
                self._jobs.clear()
        self._jobs[job_id] = js
        return js

    def invalidate(self, job_id: int | None = None) -> None:
        if job_id is None:
            self._jobs.clear()
        else:
            self._jobs.pop(job_id, None)


# One per process: placements are shared by every connection.
cache = ScopeCache()
