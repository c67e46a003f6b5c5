"""Jobs that can never run fail with their reason; one bad job never stops a tick for the others.

Before: a job whose model failed at placement stayed in `placing` forever and the tick that met it
aborted (later queued jobs in that tick were not started), and a learner that failed at start was
re-dispatched forever.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.coordinator import control
from apps.coordinator.dispatch import model_figures as coordinator_figures
from apps.coordinator.models import LearnerRuntime
from apps.inventory.models import AcceleratorType, Pool
from apps.jobs import state as st
from apps.jobs.models import Job, Learner
from trainer.spec import JobSpec

from .conftest import TINY

pytestmark = pytest.mark.django_db


@pytest.fixture
def pools():
    acc = AcceleratorType.objects.create(slug="t-cpu", vendor="x", model="cpu", kind="cpu", generation="g",
                                         year=2024, memory_gib=16, peak_bf16_tflops=0.5, tdp_watts=15)
    return {s: Pool.objects.create(slug=s, name=s, region="r", accelerator=acc, device_count=2, link_gbps=10)
            for s in ("alpha", "beta")}


def _queued(owner, **spec) -> Job:
    old = timezone.now() - timedelta(seconds=60)
    job = Job.objects.create(owner=owner, name="j", spec={**TINY, **spec}, status=st.QUEUED)
    Job.objects.filter(pk=job.pk).update(updated_at=old)
    return job


def test_stored_hostile_model_fails_without_running_and_the_tick_goes_on(owner, pools, tripwire):
    """A spec stored before the allow-list (or written straight into the database)."""
    bad = [_queued(owner, model=m) for m in ("os:abort", "tests.support.tripwire:build", "pdb:set_trace")]
    good = _queued(owner)
    control.watchdog()
    for job in bad:
        job.refresh_from_db()
        assert job.status == st.FAILED, job.status
        assert "MODEL_FACTORIES" in job.status_reason
    good.refresh_from_db()
    assert good.status == st.RUNNING
    assert not tripwire.exists()


def test_stored_dataset_outside_roots_fails(owner, pools):
    job = _queued(owner, dataset="stdlib,/etc/passwd")
    control.watchdog()
    job.refresh_from_db()
    assert job.status == st.FAILED and "data root" in job.status_reason


def test_running_job_with_hostile_spec_is_failed_by_the_tick(owner, pools):
    job = Job.objects.create(owner=owner, name="j", spec={**TINY, "model": "os:abort"}, status=st.RUNNING)
    Learner.objects.create(job=job, index=0, incarnation=1, pool=pools["alpha"], state=Learner.State.PENDING)
    good = _queued(owner)
    control.watchdog()
    job.refresh_from_db()
    good.refresh_from_db()
    assert job.status == st.FAILED
    assert good.status == st.RUNNING


def test_job_that_fits_nowhere_fails_with_the_reason(owner, pools):
    """32 GiB of activations on 16 GiB devices: the dry run says infeasible, and now so does the
    coordinator (it used to place it, counting parameters only)."""
    job = _queued(owner, batch_size=1024, seq_len=8192, steps=1)
    spec = JobSpec.model_validate(job.spec)
    mem, _flops, _frag = coordinator_figures(spec)
    assert mem > 16
    control.watchdog()
    job.refresh_from_db()
    assert job.status == st.FAILED
    assert "cannot be placed on any pool" in job.status_reason and "a learner needs 3" in job.status_reason


def test_job_waiting_for_capacity_stays_queued(owner, pools):
    """Busy is not broken: a job that fits an empty fleet waits for capacity."""
    jobs = [_queued(owner, learners=3, quorum=2) for _ in range(2)]  # 4 devices: one at a time
    control.watchdog()
    for job in jobs:
        job.refresh_from_db()
    assert sorted(j.status for j in jobs) == [st.QUEUED, st.RUNNING]
    waiting = next(j for j in jobs if j.status == st.QUEUED)
    assert "capacity" in waiting.status_reason


def test_learner_start_failures_back_off_then_fail_the_job(owner, pools, settings):
    settings.LEARNER_START_ATTEMPTS = 3
    job = Job.objects.create(owner=owner, name="j", spec={**TINY}, status=st.RUNNING)
    learner = Learner.objects.create(job=job, index=0, incarnation=1, pool=pools["alpha"],
                                     state=Learner.State.PENDING)
    LearnerRuntime.objects.create(learner=learner)
    assert control.record_start_failure(learner, "ValueError: no such file") is False
    rt = LearnerRuntime.objects.get(learner=learner)
    assert rt.start_failures == 1 and rt.retry_after > timezone.now()
    assert control.dispatch_pending(job) == 0  # backing off
    LearnerRuntime.objects.filter(pk=rt.pk).update(retry_after=timezone.now() - timedelta(seconds=1))
    assert control.dispatch_pending(job) == 1
    Learner.objects.filter(pk=learner.pk).update(state=Learner.State.PENDING)  # as run_learner_body does
    assert control.record_start_failure(learner, "ValueError: no such file") is False
    assert control.record_start_failure(learner, "ValueError: no such file") is True
    job.refresh_from_db()
    assert job.status == st.RUNNING  # the worker only counts; the coordinator fails the job
    control.watchdog()
    job.refresh_from_db()
    assert job.status == st.FAILED
    assert "failed to start 3 times" in job.status_reason and "no such file" in job.status_reason


def test_never_started_learner_counts_as_a_failed_start(owner, pools):
    job = Job.objects.create(owner=owner, name="j", spec={**TINY}, status=st.RUNNING)
    learner = Learner.objects.create(job=job, index=0, incarnation=1, pool=pools["alpha"],
                                     state=Learner.State.STARTING)
    LearnerRuntime.objects.create(learner=learner, dispatched_at=timezone.now() - timedelta(hours=1))
    control.watchdog()
    rt = LearnerRuntime.objects.get(learner=learner)
    assert rt.start_failures == 1 and "no heartbeat" in rt.last_error


def test_service_errors_in_a_tick_are_retried_not_blamed_on_the_job(owner, pools, monkeypatch):
    """The broker or Redis down (the chaos drill kills Redis) must not fail a healthy job."""
    from kombu.exceptions import OperationalError

    job = Job.objects.create(owner=owner, name="j", spec={**TINY}, status=st.RUNNING)
    for exc in (ConnectionError("redis down"), OperationalError("broker down")):
        def boom(j, exc=exc):
            raise exc

        monkeypatch.setattr(control, "dispatch_pending", boom)
        control.watchdog()
        job.refresh_from_db()
        assert job.status == st.RUNNING
    monkeypatch.setattr(control, "dispatch_pending", lambda j: (_ for _ in ()).throw(ValueError("bad spec")))
    control.watchdog()
    job.refresh_from_db()
    assert job.status == st.FAILED and "bad spec" in job.status_reason
