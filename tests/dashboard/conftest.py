"""Fixtures for the dashboard tests: a small fleet and jobs with metrics."""
from __future__ import annotations

import pytest
from django.utils import timezone

from apps.dashboard.seeding import seed_fleet
from apps.jobs.models import Job, Learner


@pytest.fixture
def fleet(db):
    return {p.slug: p for p in seed_fleet()}


def make_job(owner, name="job", status="running", learners=2, pools=None, **kw) -> Job:
    spec = {"name": name, "strategy": "decoupled", "model": "tiny", "dataset": "stdlib", "learners": learners}
    job = Job.objects.create(owner=owner, name=name, spec=spec, status=status,
                             started_at=timezone.now() if status != "queued" else None, **kw)
    for i in range(learners):
        Learner.objects.create(job=job, index=i, pool=(pools or [None])[i % len(pools or [None])],
                               state=Learner.State.RUNNING if status == "running" else Learner.State.PENDING,
                               incarnation=1, tokens_per_s=1000.0 * (i + 1), tokens=10_000 * (i + 1))
    return job


@pytest.fixture
def job_factory(fleet):
    def factory(owner, **kw):
        kw.setdefault("pools", [fleet["h100-east"], fleet["a100-west"]])
        return make_job(owner, **kw)

    return factory
