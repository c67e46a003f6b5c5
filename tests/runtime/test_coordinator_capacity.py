"""Issue 35, High 2: no job may starve the coordinator.

A job's syncer shards are long-running tasks. They run on their own queue (`syncer`) and worker
(SYNCER_SLOTS threads), never on the coordinator queue whose threads the watchdog, the
rebalancer and placement need; placement counts the shards of running jobs against SYNCER_SLOTS
(a job that does not fit waits queued with the reason); a spec asking for more shards than the
coordinator holds is a 400 naming `syncer_shards`.
"""
from __future__ import annotations

import time

import pytest
import yaml
from rest_framework.test import APIClient

from apps.api.models import ApiToken
from apps.coordinator import capacity, control
from apps.coordinator.models import CoordinatorTick, LearnerRuntime, SyncerLease
from apps.inventory.models import AcceleratorType, Pool
from apps.jobs import state as st
from apps.jobs.models import Event, Job, Learner
from apps.jobs.services import cancel_job, submit_job
from apps.jobs.spec import SpecError
from diloco_platform import processes

from .conftest import TINY, needs_services

ROOT = processes.ROOT
WIDE = {**TINY, "inner_steps": 8, "fragments": 8}  # up to 8 syncer shards (one per fragment)


# ------------------------------------------------------------------------------- processes
def test_syncers_have_their_own_queue_and_worker():
    from diloco_platform.celery import app

    route = app.amqp.router.route
    assert route({}, "apps.coordinator.tasks.run_syncer")["queue"].name == "syncer"
    for name in ("apps.coordinator.tasks.watchdog", "apps.coordinator.tasks.rebalance",
                 "apps.coordinator.tasks.reconcile_job", "apps.inventory.tasks.fleet_tick"):
        assert route({}, name)["queue"].name == "coordinator", name
    names = [p.name for p in processes.platform()]
    assert names.index("syncer") == names.index("coordinator") + 1
    argv = processes.syncer().argv
    assert argv[argv.index("-Q") + 1] == "syncer" and argv[argv.index("-P") + 1] == "threads"
    assert argv[argv.index("--concurrency") + 1] == "${SYNCER_SLOTS:-8}" == processes.SYNCER_SLOTS
    assert "syncer: celery -A diloco_platform worker -Q syncer" in (ROOT / "Procfile").read_text()
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    # every service reads the same SYNCER_SLOTS: the syncer's threads, placement's and submission's limit
    assert services["syncer"]["environment"]["SYNCER_SLOTS"] == "${SYNCER_SLOTS:-8}"
    assert services["web"]["environment"]["SYNCER_SLOTS"] == "${SYNCER_SLOTS:-8}"


# ------------------------------------------------------------------------------- submission
@pytest.mark.django_db
def test_more_syncer_shards_than_the_coordinator_holds_is_a_400(settings, alice):
    settings.SYNCER_SLOTS = 4
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": "coordinator-capacity"}}
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {ApiToken.issue(alice, 'test')[1]}")
    r = client.post("/api/v1/jobs/", {"spec": {**WIDE, "syncer_shards": 5}}, format="json")
    assert r.status_code == 400, r.content
    msg = r.json()["errors"]["spec.syncer_shards"][0]
    assert "5 syncer shards" in msg and "4 syncer slots" in msg and "SYNCER_SLOTS" in msg
    assert not Job.objects.exists()
    with pytest.raises(SpecError) as exc:  # the service is the authority (dashboard, CLI, demo)
        submit_job(alice, {**WIDE, "syncer_shards": 5})
    assert list(exc.value.errors) == ["syncer_shards"]
    r = client.post("/api/v1/jobs/dry-run/", {"spec": {**WIDE, "syncer_shards": 5}}, format="json")
    assert r.status_code == 400 and "spec.syncer_shards" in r.json()["errors"]  # the dry run says so too
    r = client.post("/api/v1/jobs/", {"spec": {**WIDE, "syncer_shards": 4}}, format="json")
    assert r.status_code == 201, r.content


# ------------------------------------------------------------------------------- admission
@pytest.fixture
def pools(db):
    acc = AcceleratorType.objects.create(slug="t-cpu", vendor="x", model="cpu", kind="cpu", generation="g",
                                         year=2024, memory_gib=8, peak_bf16_tflops=0.5, tdp_watts=15)
    return {s: Pool.objects.create(slug=s, name=s, region="r", accelerator=acc, device_count=8, link_gbps=10)
            for s in ("alpha", "beta")}


def _job(owner, status, shards: int, name: str = "j") -> Job:
    return Job.objects.create(owner=owner, name=name, status=status,
                              spec={**WIDE, "name": name, "syncer_shards": shards})


@pytest.mark.django_db
def test_a_job_whose_shards_do_not_fit_waits_queued_with_the_reason(settings, alice, bob, pools):
    settings.SYNCER_SLOTS = 4
    big = _job(alice, st.RUNNING, 3, "big")
    waiting = _job(bob, st.QUEUED, 2, "waiting")
    assert control.start_job(waiting) == "waiting for syncer capacity"
    waiting.refresh_from_db()
    assert waiting.status == st.QUEUED and not waiting.learners.exists()
    assert waiting.status_reason == ("waiting for syncer capacity: needs 2 syncer slots, "
                                     "3 of 4 in use by other jobs (SYNCER_SLOTS)")
    control.start_job(waiting)  # the watchdog retries: one event for the whole wait
    assert Event.objects.filter(job=waiting, kind=Event.Kind.INFO,
                                message__startswith=capacity.WAITING).count() == 1
    small = _job(bob, st.QUEUED, 1, "small")  # fits beside the big one: not held up by the waiting one
    assert control.start_job(small) == "started"
    assert capacity.in_use() == 4
    SyncerLease.objects.create(job=big, shard=0, finished=True)  # a finished shard frees its slot
    assert capacity.in_use() == 3
    assert control.start_job(waiting) == "waiting for syncer capacity"
    cancel_job(big)
    assert control.start_job(waiting) == "started"
    waiting.refresh_from_db()
    assert waiting.status == st.RUNNING and waiting.learners.count() == 2
    assert SyncerLease.objects.filter(job=waiting).count() == 2


@pytest.mark.django_db
def test_a_resumed_job_waits_for_its_syncer_slots_then_resumes(settings, alice, bob, pools):
    settings.SYNCER_SLOTS = 4
    big = _job(alice, st.RUNNING, 3, "big")
    paused = _job(bob, st.PLACING, 2, "paused")  # resumed by its owner: placing again
    for i in range(2):
        learner = Learner.objects.create(job=paused, index=i, incarnation=1, pool=pools["alpha"],
                                         state=Learner.State.STOPPED, work_size=8)
        LearnerRuntime.objects.create(learner=learner)
    assert control.reconcile(paused.pk) == "waiting for syncer capacity"
    paused.refresh_from_db()
    assert paused.status == st.QUEUED and paused.status_reason.startswith(capacity.WAITING)
    assert set(paused.learners.values_list("state", flat=True)) == {Learner.State.STOPPED}
    cancel_job(big)
    assert control.reconcile(paused.pk) == "resumed"
    paused.refresh_from_db()
    assert paused.status == st.RUNNING
    assert set(paused.learners.values_list("incarnation", flat=True)) == {2}  # resumed, not placed anew
    assert set(paused.learners.values_list("state", flat=True)) == {Learner.State.STARTING}


@pytest.mark.django_db
def test_a_job_that_can_never_fit_fails_with_the_reason(settings, alice, pools):
    job = _job(alice, st.QUEUED, 4)  # submitted while SYNCER_SLOTS was larger
    settings.SYNCER_SLOTS = 2
    assert control.start_job(job) == "failed"
    job.refresh_from_db()
    assert job.status == st.FAILED and "4 syncer shards exceed the coordinator's 2 syncer slots" in \
        job.status_reason


@pytest.mark.django_db
def test_watchdog_and_rebalance_stamp_their_ticks():
    control.watchdog()
    control.watchdog()
    control.rebalance()
    ticks = {t.name: t.count for t in CoordinatorTick.objects.all()}
    assert ticks == {"watchdog": 2, "rebalance": 1}


# ------------------------------------------------------------------------------- real stack
class TickWatch:
    """Samples the watchdog's tick stamp; the longest stretch without a new tick."""

    def __init__(self):
        self.seen: list[tuple[float, object]] = []

    def poll(self) -> None:
        at = CoordinatorTick.objects.filter(name="watchdog").values_list("at", flat=True).first()
        if at is not None and (not self.seen or self.seen[-1][1] != at):
            self.seen.append((time.monotonic(), at))

    def longest_gap(self, until: float) -> float:
        times = [t for t, _ in self.seen] + [until]
        return max(b - a for a, b in zip(times, times[1:], strict=False))


def _learners_running(job: Job) -> bool:
    return Learner.objects.filter(job=job, state=Learner.State.RUNNING, last_heartbeat__isnull=False).exists()


def _shards_started(job: Job, n: int) -> bool:
    return SyncerLease.objects.filter(job=job, started_at__isnull=False).exclude(
        worker__in=("", "dispatched")).count() == n


@needs_services
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_eight_shard_job_never_stops_housekeeping(tmp_path, django_user_model):
    """The issue's reproduction: a job with syncer_shards=8 used to hold all eight coordinator
    threads, and another user's job stayed queued until it was cancelled. Now: its shards run on
    the syncer worker (9 slots here), another user's job is placed and trains within the
    watchdog's bound, a third whose two shards do not fit waits queued with the reason and
    starts when the big job ends, and the watchdog ticks all along."""
    from tests.support.stack import Stack

    users = [django_user_model.objects.create_user(n, f"{n}@example.com", f"pw-{n}-123")
             for n in ("wide", "small", "later")]
    one = {**TINY, "learners": 1, "quorum": 1, "steps": 20_000, "eval_interval": 1000,
           "checkpoint_interval": 1000}
    with Stack(tmp_path, pools={"alpha": 2, "beta": 2}, extra_env={"SYNCER_SLOTS": "9"}) as stack:
        ticks = TickWatch()

        def until(predicate):
            def check():
                ticks.poll()
                return predicate()
            return check

        wide, _ = submit_job(users[0], {**one, "name": "eight shards", "inner_steps": 8, "fragments": 8,
                                        "syncer_shards": 8})
        stack.wait_for(until(lambda: _shards_started(wide, 8)), timeout=180, what="8 syncer shards running")
        t0 = time.monotonic()
        small, _ = submit_job(users[1], {**one, "name": "another user job"})
        stack.wait_for(until(lambda: Job.objects.get(pk=small.pk).status == st.RUNNING
                             and _learners_running(small) and _shards_started(small, 1)),
                       timeout=45, what="the other user's job placed and training")
        placed_s = time.monotonic() - t0
        later, _ = submit_job(users[2], {**one, "name": "two shards", "fragments": 2, "syncer_shards": 2})
        stack.wait_for(until(lambda: "needs 2 syncer slots, 9 of 9 in use"
                             in Job.objects.get(pk=later.pk).status_reason),
                       timeout=30, what="the two-shard job waiting for syncer slots")
        t1 = time.monotonic()
        while time.monotonic() - t1 < 6:  # it keeps waiting (8 + 1 of 9 slots held), ticks go on
            ticks.poll()
            time.sleep(0.25)
        later.refresh_from_db()  # queued (or placing for a moment while the watchdog tries again)
        assert later.status in (st.QUEUED, st.PLACING) and not later.learners.exists(), later.status_reason
        assert not SyncerLease.objects.filter(job=later).exists()
        assert Job.objects.get(pk=wide.pk).status == st.RUNNING
        cancel_job(Job.objects.get(pk=wide.pk))
        t2 = time.monotonic()
        stack.wait_for(until(lambda: Job.objects.get(pk=later.pk).status == st.RUNNING
                             and _shards_started(later, 2) and _learners_running(later)),
                       timeout=60, what="the two-shard job started once the slots were free")
        started_s = time.monotonic() - t2
        gap = ticks.longest_gap(time.monotonic())
        print(f"\nother job training {placed_s:.1f} s after submission; two-shard job started "
              f"{started_s:.1f} s after the cancel; watchdog ticks seen {len(ticks.seen)}, "
              f"longest gap {gap:.1f} s")
        assert len(ticks.seen) >= 10 and gap <= 5.0
        for job in (small, later):
            cancel_job(Job.objects.get(pk=job.pk))


def test_a_syncer_message_on_the_coordinator_queue_is_forwarded_not_run(monkeypatch):
    """A run_syncer sent before the upgrade (routed to `coordinator`) must not hold a housekeeping
    thread: it is sent on to the syncer queue."""
    from apps.coordinator import tasks

    sent, ran = [], []
    monkeypatch.setattr(tasks, "send", lambda *a, **kw: sent.append((a, kw)))
    monkeypatch.setattr("apps.coordinator.syncer.run_syncer_body", lambda *a, **kw: ran.append(a) or "ran")
    for queue, want in (("coordinator", "forwarded to the syncer queue"), ("syncer", "ran")):
        tasks.run_syncer.push_request(delivery_info={"routing_key": queue}, hostname="syncer@h")
        try:
            assert tasks.run_syncer.run(7, 3, 1) == want
        finally:
            tasks.run_syncer.pop_request()
    assert sent == [((tasks.RUN_SYNCER, 7, 3, 1), {"queue": "syncer"})] and ran == [(7, 3, "syncer@h")]
