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


def worker_of(stack, learner) -> str:
    """Stack process name of the worker running `learner` (from its runtime record)."""
    learner.runtime.refresh_from_db()
    for name in stack.procs:
        if stack.worker_hostname(name) == learner.runtime.worker:
            return name
    raise AssertionError(f"no stack process runs {learner.runtime.worker!r}")


@pytest.fixture
def stack3(transactional_db, tmp_path):
    from tests.support.stack import Stack

    with Stack(tmp_path, pools={"alpha": 1, "beta": 1, "gamma": 1}) as s:
        yield s


def test_survives_worker_and_coordinator_kills(stack3, owner):
    stack = stack3
    job, _ = submit_job(owner, {**TINY, "steps": 200})
    stack.wait_for(lambda: Learner.objects.filter(job=job, state=Learner.State.RUNNING).count() == 2,
                   timeout=60, what="two running learners")
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 2, timeout=60, what="outer steps")
    victim = Learner.objects.get(job=job, index=0)
    name = worker_of(stack, victim)
    old_inc, old_pool = victim.incarnation, victim.pool.slug

    # 1. kill -9 the worker (main process + pool children) that runs learner 0
    t_kill = time.time()
    stack.kill_worker(name)
    back = stack.wait_for(
        lambda: Learner.objects.filter(job=job, index=0, incarnation__gt=old_inc, state=Learner.State.RUNNING,
                                       last_heartbeat__isnull=False).first(),
        timeout=30, what="learner 0 running again")
    recovery = back.last_heartbeat.timestamp() - t_kill
    from datetime import UTC, datetime

    killed_at = datetime.fromtimestamp(t_kill, tz=UTC)
    steps_during = OuterStep.objects.filter(job=job, created_at__gte=killed_at,
                                            created_at__lte=back.last_heartbeat).count()
    print(f"\nlearner 0 ran again on {back.pool.slug} (was {old_pool}) {recovery:.2f}s after the kill; "
          f"{steps_during} outer steps committed meanwhile")
    assert back.pool.slug != old_pool  # its own pool has no live node left
    assert recovery < 15
    from apps.jobs.models import Incident

    inc = Incident.objects.get(job=job, learner=back, kind="learner_lost")
    assert inc.healed_at is not None and inc.time_to_detect_s >= 0

    # 2. kill -9 the coordinator (syncer, watchdog): learners keep training; a restarted
    #    coordinator resumes the syncer from its last commit
    from apps.coordinator.models import SyncerLease

    commits_before = SyncerLease.objects.get(job=job).commits
    stack.kill("coordinator")
    stack.restart("coordinator")
    stack.wait_for(lambda: SyncerLease.objects.get(job=job).restarts >= 1, timeout=40, what="syncer restart")
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=150, what="job end")
    job.refresh_from_db()
    lease = SyncerLease.objects.get(job=job)
    print(f"syncer restarted {lease.restarts}x from commit {commits_before}; {job.outer_steps} outer steps; "
          f"val loss {job.initial_val_loss:.3f} -> {job.final_val_loss:.3f}; tokens computed "
          f"{job.tokens_computed} contributed {job.tokens_contributed} lost {job.tokens_lost}")
    assert job.status == st.COMPLETED, job.status_reason
    assert duplicates(job) == 0
    versions = list(OuterStep.objects.filter(job=job, fragment=0).order_by("version")
                    .values_list("version", flat=True))
    assert versions == list(range(1, len(versions) + 1))  # no version lost or written twice
    assert job.final_val_loss < job.initial_val_loss - 0.1
    assert Incident.objects.filter(job=job, kind="syncer_lost").exists()


def test_drain_moves_learners_and_cancel_stops_them(stack, owner):
    from apps.inventory.models import Pool

    job, _ = submit_job(owner, {**TINY, "steps": 120, "pools": ["alpha", "beta"]})
    stack.wait_for(lambda: Learner.objects.filter(job=job, state=Learner.State.RUNNING).count() == 2,
                   timeout=60, what="two running learners")
    on = {lr.pool.slug for lr in Learner.objects.filter(job=job)}
    drained = sorted(on)[0]
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 1, timeout=60, what="an outer step")
    Pool.objects.filter(slug=drained).update(state=Pool.State.DRAINING)
    t0 = time.time()
    stack.wait_for(lambda: not Learner.objects.filter(job=job, pool__slug=drained).exists()
                   and Learner.objects.filter(job=job, state=Learner.State.RUNNING).count() == 2,
                   timeout=60, what="learners off the drained pool")
    print(f"\ndrain of {drained}: learners moved and running again in {time.time() - t0:.2f}s")
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=120, what="job end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    assert duplicates(job) == 0
    assert job.events.filter(kind="drained").exists()
    Pool.objects.filter(slug=drained).update(state=Pool.State.ACTIVE)

    # cancel: every learner stops within seconds
    from apps.jobs.services import cancel_job

    job2, _ = submit_job(owner, {**TINY, "steps": 5000, "name": "to cancel"})
    stack.wait_for(lambda: Learner.objects.filter(job=job2, state=Learner.State.RUNNING).count() == 2,
                   timeout=60, what="two running learners")
    t0 = time.time()
    cancel_job(Job.objects.get(pk=job2.pk))
    stack.wait_for(lambda: not Learner.objects.filter(job=job2, state__in=("running", "starting")).exists(),
                   timeout=20, what="learners stopped")
    print(f"cancel: all learners stopped {time.time() - t0:.2f}s after the request")
    assert time.time() - t0 < 10
    assert set(Learner.objects.filter(job=job2).values_list("state", flat=True)) == {Learner.State.STOPPED}
