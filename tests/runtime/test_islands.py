"""Learner islands on real Celery workers (CPU, gloo): M=2 learners x 2 processes train with every
contribution applied once; kill -9 of one rank fails its learner whole, which is placed again while
the other learner trains on (one job checks both: a live stack and an island job cost tens of
seconds each on a loaded machine)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from apps.coordinator.chaos import island_follower_pids as follower_pids
from apps.jobs import state as st
from apps.jobs.models import Event, Incident, Job, Learner, MetricPoint
from apps.jobs.services import submit_job
from tests.support.stack import Stack

from .conftest import TINY, needs_services
from .test_e2e import applied_ranges, duplicates


def live(fn):
    """The marks of a test on the live stack."""
    for mark in (needs_services, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)):
        fn = mark(fn)
    return fn


ISLANDS = {**TINY, "name": "islands", "devices_per_learner": 2, "quorum": 1}
STEPS = 160  # long enough that learner 0 is killed, placed again and resumed mid-job


@pytest.fixture
def island_stack(transactional_db, tmp_path):
    with Stack(tmp_path, pools={"alpha": 4}) as s:  # one CPU node of 4 slots: 2 learners x 2 devices
        yield s


def test_a_node_has_as_many_slots_as_its_worker_runs_tasks():
    """worker_ready sends the Consumer, which holds the worker (its concurrency) as `controller`:
    a CPU node of 4 processes has 4 slots, so a learner of 2 devices fits on it."""
    from types import SimpleNamespace

    from celery.concurrency.prefork import TaskPool as Prefork

    from apps.inventory.worker import worker_slots

    assert worker_slots(SimpleNamespace(controller=SimpleNamespace(pool_cls=Prefork, concurrency=4))) == 4


@live
def test_islands_train_on_through_a_kill_9_with_each_contribution_once(island_stack, owner):
    """One job for both properties (one stack start, one island job, instead of two of each):
    M=2 learners x 2 processes train on real workers; kill -9 of one rank of learner 0 fails that
    learner whole, which is placed again with a new island while learner 1 trains on; the job
    completes with every contribution applied once, the learners' tokens counted once."""
    job, _ = submit_job(owner, {**ISLANDS, "name": "island chaos", "steps": STEPS})
    island_stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 2
                          and all(follower_pids(job.pk, i) for i in range(2)),
                          timeout=120, what="outer steps with both islands up")
    before = {lr.index: lr.incarnation for lr in Learner.objects.filter(job=job)}
    victim = follower_pids(job.pk, 0)[0]
    os.kill(victim, signal.SIGKILL)
    island_stack.wait_for(lambda: Incident.objects.filter(job=job, kind="island_rank_lost").exists(),
                          timeout=60, what="the island's incident")
    incident = Incident.objects.get(job=job, kind="island_rank_lost")
    assert incident.learner.index == 0 and victim in incident.details["failed_pids"]
    island_stack.wait_for(
        lambda: Learner.objects.filter(job=job, index=0, incarnation__gt=before[0],
                                       state=Learner.State.RUNNING).exists() and follower_pids(job.pk, 0),
        timeout=90, what="learner 0 placed again with a new island")
    assert victim not in follower_pids(job.pk, 0)
    island_stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=300,
                          what="job end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    assert job.final_val_loss < job.initial_val_loss - 0.1
    other = Learner.objects.get(job=job, index=1)
    assert other.incarnation == before[1]  # the other learner never waited, never restarted
    per_learner = STEPS * ISLANDS["batch_size"] * ISLANDS["seq_len"]
    # each rank read half of every batch; the learner counts the whole batch once (the re-placed
    # learner too, resumed from its checkpoint's count)
    assert sorted(Learner.objects.filter(job=job).values_list("tokens", flat=True)) == [per_learner] * 2
    assert duplicates(job) == 0
    assert {learner for learner, _ in applied_ranges(job)} == {0, 1}
    ends = [e.payload for e in Event.objects.filter(job=job, payload__has_key="devices")]
    assert ends and all(p["devices"] == 2 for p in ends)
    # one telemetry stream per learner, from rank 0, with every rank's device figures in it
    ranks = set(MetricPoint.objects.filter(job=job, name__startswith="rank").values_list("name", flat=True))
    assert {"rank0_cpu", "rank1_cpu"} <= ranks, ranks
    incident.refresh_from_db()
    assert incident.healed_at is not None
    island_stack.wait_for(lambda: not follower_pids(job.pk, 0) and not follower_pids(job.pk, 1), timeout=30,
                          what="the followers to exit")


@pytest.fixture
def two_device_node(db):
    """A pool of 8 devices whose one registered node has 2 (a learner must fit on one node)."""
    from apps.inventory.models import AcceleratorType, Node, Pool

    acc = AcceleratorType.objects.create(slug="island-cpu", vendor="Test", model="CPU", kind="cpu",
                                         generation="x86", year=2024, memory_gib=16, peak_bf16_tflops=2.0,
                                         tdp_watts=200)
    pool = Pool.objects.create(slug="isl", name="isl", region="r", accelerator=acc, device_count=8,
                               link_gbps=10)
    Node.objects.create(pool=pool, hostname="h", worker_name="isl-0@h", device_count=2)
    return pool


@pytest.mark.django_db
@pytest.mark.parametrize(("over", "reason"), [
    ({"devices_per_learner": 4}, "a learner needs 4 devices on one node; the largest node (pool isl) has 2"),
    ({"devices_per_learner": 3}, "must divide batch_size"),
    ({"devices_per_learner": 2, "inner_parallelism": "gspmd"}, "'ddp' or 'fsdp'"),
    ({"devices_per_learner": 2, "inner_parallelism": "fsdp", "inner_optimizer": "muon"},
     "use inner_parallelism ddp with muon"),
])
def test_an_island_that_cannot_run_is_a_400_on_its_field(alice, two_device_node, over, reason):
    from tests.api.conftest import client_for

    field = next((f for f in ("inner_optimizer", "inner_parallelism") if f in over), "devices_per_learner")
    for path in ("/api/v1/jobs/dry-run/", "/api/v1/jobs/"):
        r = client_for(alice).post(path, {"spec": {**ISLANDS, **over}}, format="json")
        assert r.status_code == 400, r.content
        assert any(reason in m for m in r.json()["errors"][f"spec.{field}"]), r.json()


@pytest.mark.django_db
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_the_dry_run_shows_each_learners_devices(alice, two_device_node, parallelism):
    from tests.api.conftest import client_for

    spec = {**ISLANDS, "inner_parallelism": parallelism}
    r = client_for(alice).post("/api/v1/jobs/dry-run/", {"spec": spec}, format="json")
    assert r.status_code == 200, r.content
    plan = r.json()["placement"]
    assert plan["feasible"] and [lr["devices"] for lr in plan["learners"]] == [2, 2]


def test_the_cli_sends_devices_per_learner_and_shows_the_refusal(live_server, alice, two_device_node):
    from apps.api.models import ApiToken
    from tests.cli.conftest import Cli

    cli = Cli(live_server.url, ApiToken.issue(alice, "islands")[1])
    example = Path(__file__).resolve().parents[2] / "examples" / "job.yaml"
    code, body = cli.json("jobs", "submit", example, "--dry-run", "--devices-per-learner", "4")
    assert code == 2 and "largest node (pool isl) has 2" in body["errors"]["spec.devices_per_learner"][0]
    r = cli("jobs", "submit", example, "--dry-run", "--devices-per-learner", "2")
    assert r.exit_code == 0 and "3 learners x 2 devices" in r.stdout, r.stdout + r.stderr
