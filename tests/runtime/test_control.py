"""Coordinator decisions against the database (no processes): watchdog, fencing, leases, placement."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.coordinator import control
from apps.coordinator.learner import DjangoHost
from apps.coordinator.models import LearnerRuntime, SyncerLease
from apps.inventory.models import AcceleratorType, Node, Pool
from apps.jobs import state as st
from apps.jobs.models import Event, Incident, Job, Learner
from trainer.runtime.learner_loop import Fenced

from .conftest import TINY

pytestmark = pytest.mark.django_db


@pytest.fixture
def pools():
    acc = AcceleratorType.objects.create(slug="t-cpu", vendor="x", model="cpu", kind="cpu", generation="g",
                                         year=2024, memory_gib=8, peak_bf16_tflops=0.5, tdp_watts=15)
    return {s: Pool.objects.create(slug=s, name=s, region="r", accelerator=acc, device_count=1, link_gbps=10)
            for s in ("alpha", "beta")}


@pytest.fixture
def running_job(owner, pools):
    job = Job.objects.create(owner=owner, name="j", spec={**TINY}, status=st.RUNNING)
    node = Node.objects.create(pool=pools["alpha"], hostname="h", worker_name="alpha-0@h")
    old = timezone.now() - timedelta(seconds=30)
    learner = Learner.objects.create(job=job, index=0, incarnation=1, pool=pools["alpha"], node=node,
                                     state=Learner.State.RUNNING, last_heartbeat=old, tokens=5000,
                                     started_at=old)
    LearnerRuntime.objects.create(learner=learner, worker="alpha-0@h",
                                  resume_point={"tokens": 0, "frag_pos": {}})
    return job


def test_watchdog_declares_lost_and_redispatches_elsewhere(running_job, pools):
    out = control.watchdog()
    assert out["lost"] == 1
    learner = Learner.objects.get(job=running_job, index=0)
    assert learner.incarnation == 2 and learner.state == Learner.State.STARTING
    assert learner.pool.slug == "beta"  # alpha's only node is lost now
    assert Node.objects.get(worker_name="alpha-0@h").state == Node.State.LOST
    inc = Incident.objects.get(job=running_job, kind="learner_lost")
    assert inc.healed_at is None and inc.time_to_detect_s >= 29
    assert Event.objects.filter(job=running_job, kind="reassigned").exists()
    # a second tick changes nothing (idempotent)
    control.watchdog()
    assert Learner.objects.get(job=running_job, index=0).incarnation == 2


def test_zombie_heartbeat_is_fenced_and_successor_heals_incident(running_job):
    learner = Learner.objects.get(job=running_job, index=0)
    control.watchdog()
    zombie = DjangoHost(learner, incarnation=1, worker="alpha-0@h")
    with pytest.raises(Fenced):
        zombie.heartbeat({"step": 1, "tokens": 6000, "loss": 3.0, "tokens_per_s": 10.0, "staleness": 0})
    fresh = Learner.objects.get(pk=learner.pk)
    host = DjangoHost(fresh, incarnation=2, worker="beta-0@h")
    host.resumed({"tokens": 4096, "frag_pos": {"0": 4096}, "from_incarnation": 1})
    ctl = host.heartbeat({"step": 17, "tokens": 4352, "loss": 3.0, "tokens_per_s": 10.0, "staleness": 0})
    assert not ctl.stop
    inc = Incident.objects.get(job=running_job, kind="learner_lost")
    assert inc.healed_at is not None
    assert inc.tokens_lost == 5000 - 4096  # computed after the last checkpoint
    assert Learner.objects.get(pk=learner.pk).state == Learner.State.RUNNING


def test_heartbeat_carries_stop_and_move(running_job, pools):
    learner = Learner.objects.get(job=running_job, index=0)
    host = DjangoHost(learner, incarnation=1, worker="alpha-0@h")
    stats = {"step": 1, "tokens": 6000, "loss": 3.0, "tokens_per_s": 10.0, "staleness": 0}
    LearnerRuntime.objects.filter(learner=learner).update(move_to=pools["beta"], move_reason="drain: test")
    ctl = host.heartbeat(stats)
    assert ctl.handoff and ctl.reason == "drain: test"
    Job.objects.filter(pk=running_job.pk).update(status=st.CANCELLED)
    ctl = host.heartbeat(stats)
    assert ctl.stop and "cancelled" in ctl.reason


def test_stale_syncer_lease_restarts_with_incident_clean_stop_without(running_job):
    lease = SyncerLease.objects.create(job=running_job, epoch=3, worker="coordinator@h",
                                       last_heartbeat=timezone.now() - timedelta(seconds=60), commits=7)
    control.ensure_syncer(running_job)
    lease.refresh_from_db()
    assert lease.epoch == 4 and lease.restarts == 1 and lease.worker == "dispatched"
    assert Incident.objects.filter(job=running_job, kind="syncer_lost").count() == 1
    # fresh lease: nothing happens
    control.ensure_syncer(running_job)
    assert SyncerLease.objects.get(pk=lease.pk).epoch == 4
    # a syncer that stopped cleanly (pause) is restarted without an incident
    SyncerLease.objects.filter(pk=lease.pk).update(worker="", last_heartbeat=None)
    control.ensure_syncer(running_job)
    assert SyncerLease.objects.get(pk=lease.pk).epoch == 5
    assert Incident.objects.filter(job=running_job, kind="syncer_lost").count() == 1


def test_no_capacity_sends_the_job_back_to_the_queue_with_the_reason(owner, pools):
    Pool.objects.update(state=Pool.State.DISABLED)
    job = Job.objects.create(owner=owner, name="j", spec={**TINY})
    assert control.reconcile(job.pk) == "waiting for capacity"
    job.refresh_from_db()
    assert job.status == st.QUEUED and "capacity" in job.status_reason
    assert not job.learners.exists()


def test_placement_creates_learners_with_reasons(owner, pools):
    job = Job.objects.create(owner=owner, name="j", spec={**TINY})
    assert control.reconcile(job.pk) == "started"
    job.refresh_from_db()
    assert job.status == st.RUNNING
    assert sorted(job.learners.values_list("pool__slug", flat=True)) == ["alpha", "beta"]
    assert set(job.learners.values_list("state", flat=True)) == {Learner.State.STARTING}
    placed = Event.objects.get(job=job, kind="placed")
    assert placed.payload["reasons"] and placed.payload["assignments"]


def test_elastic_job_grows_on_free_slots_and_shrinks_without_capacity(owner, pools):
    spec = {**TINY, "learners": 1, "quorum": 1, "min_learners": 1, "max_learners": 2}
    job = Job.objects.create(owner=owner, name="e", spec=spec, status=st.RUNNING, outer_steps=1)
    first = Learner.objects.create(job=job, index=0, incarnation=1, pool=pools["alpha"],
                                   state=Learner.State.RUNNING, last_heartbeat=timezone.now())
    LearnerRuntime.objects.create(learner=first)
    control.rebalance()
    grown = Learner.objects.get(job=job, index=1)
    assert grown.state == Learner.State.STARTING and grown.pool.slug == "beta"
    assert Event.objects.filter(job=job, kind="joined").exists()
    # beta's node dies and nothing else is free: the pending learner is removed (min is 1)
    Learner.objects.filter(pk=grown.pk).update(state=Learner.State.PENDING)
    Pool.objects.filter(slug="beta").update(state=Pool.State.DISABLED)
    control.dispatch_pending(job)
    assert Learner.objects.get(pk=grown.pk).state == Learner.State.REMOVED
    assert Event.objects.filter(job=job, kind="left").exists()
    # never below min_learners: the last one waits instead
    Learner.objects.filter(pk=first.pk).update(state=Learner.State.PENDING)
    Pool.objects.update(state=Pool.State.DISABLED)
    control.dispatch_pending(job)
    assert Learner.objects.get(pk=first.pk).state == Learner.State.PENDING


def test_synchronous_diloco_waits_for_every_learner(owner):
    from apps.coordinator.common import train_config

    job = Job.objects.create(owner=owner, name="d", spec={**TINY, "learners": 3, "quorum": 1,
                                                          "strategy": "diloco"})
    assert train_config(job).quorum == 3
    job.spec = {**TINY, "learners": 3, "quorum": 1}
    assert train_config(job).quorum == 1


@pytest.mark.parametrize("left_beta_recently", [False, True])
def test_rebalancer_does_not_send_a_learner_back_to_a_pool_it_just_left(owner, pools, left_beta_recently):
    """beta measures ten times alpha's speed and has a free slot: learner 0 moves there, unless it
    left beta a moment ago (no ping-pong between pools whose measured speeds wobble)."""
    Pool.objects.filter(slug="beta").update(device_count=2)
    job = Job.objects.create(owner=owner, name="m", spec={**TINY, "learners": 2, "quorum": 1},
                             status=st.RUNNING, outer_steps=3)
    old = timezone.now() - timedelta(seconds=60)
    for index, slug, speed in ((0, "alpha", 100.0), (1, "beta", 1000.0)):
        lr = Learner.objects.create(job=job, index=index, incarnation=1, pool=pools[slug], started_at=old,
                                    state=Learner.State.RUNNING, last_heartbeat=timezone.now(),
                                    tokens_per_s=speed)
        LearnerRuntime.objects.create(learner=lr)
    if left_beta_recently:
        Event.objects.create(job=job, kind=Event.Kind.REBALANCED, message="learner 0 moves beta → alpha",
                             payload={"learner": 0, "from": "beta", "to": "alpha"},
                             time=timezone.now() - timedelta(seconds=control.MOVE_COOLDOWN_S + 5))
    out = control.rebalance()
    moved = LearnerRuntime.objects.get(learner__job=job, learner__index=0).move_to
    if left_beta_recently:
        assert out["moves"] == 0 and moved is None
    else:
        assert out["moves"] == 1 and moved.slug == "beta"
