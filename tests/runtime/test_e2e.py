"""End to end with real processes: daphne, pool workers, coordinator, beat, Redis, PostgreSQL."""
from __future__ import annotations

import time

import pytest

from apps.jobs import state as st
from apps.jobs.models import Checkpoint, Job, Learner, MetricPoint, OuterStep
from apps.jobs.services import submit_job

from .conftest import TINY, needs_services

pytestmark = [needs_services, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def applied_ranges(job):
    """(learner, fragment) -> list of token ranges applied, from the OuterStep rows."""
    out = {}
    for step in OuterStep.objects.filter(job=job):
        for c in step.contributors:
            for r in c.get("ranges", []):
                out.setdefault((c["learner"], step.fragment), []).append(tuple(r))
    return out


def duplicates(job) -> int:
    n = 0
    for ranges in applied_ranges(job).values():
        ranges.sort()
        for (_, e1), (s2, _) in zip(ranges, ranges[1:], strict=False):
            n += s2 < e1
    return n


def test_job_completes_and_loss_falls(stack, owner):
    job, _ = submit_job(owner, dict(TINY))
    t0 = time.monotonic()
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=120, what="job end")
    job.refresh_from_db()
    print(f"\njob took {time.monotonic() - t0:.1f}s, {job.outer_steps} outer steps, "
          f"val loss {job.initial_val_loss:.3f} -> {job.final_val_loss:.3f}")
    assert job.status == st.COMPLETED, job.status_reason
    assert job.outer_steps >= 4
    assert job.final_val_loss < job.initial_val_loss - 0.1
    assert MetricPoint.objects.filter(job=job, name="val_loss").count() >= 2
    final = Checkpoint.objects.get(job=job, kind=Checkpoint.Kind.FINAL)
    assert final.size_bytes > 0 and len(final.sha256) == 64
    assert set(Learner.objects.filter(job=job).values_list("state", flat=True)) == {Learner.State.DONE}
    assert duplicates(job) == 0
    assert job.tokens_contributed > 0
