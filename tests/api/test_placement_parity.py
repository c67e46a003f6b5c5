"""The dry run shows the placement the coordinator then makes, on the same fleet, for the same spec.

Each fleet mixes the conditions on which the two used to disagree: pools of several speeds,
prices and power draws; slots held by another job's learners (starting, running, and pending,
which hold none); a pool whose only node is lost; a draining pool; a node that measured some
other model's throughput; a pool whose devices are too small for the model.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.api.placement import preview
from apps.coordinator.dispatch import place_job
from apps.dashboard.preview import dry_run
from apps.inventory.models import AcceleratorType, Node, Pool
from apps.jobs import state as st
from apps.jobs.models import Event, Job, Learner
from trainer.placement import PlacementError
from trainer.spec import JobSpec

pytestmark = pytest.mark.django_db

SMALL = {"model": "tiny", "batch_size": 8, "seq_len": 32, "steps": 64, "inner_steps": 8, "learners": 4}
# ~0.66 GiB per learner: two devices of the 0.5 GiB "edge" accelerator, one of any other
BIG_BATCH = {**SMALL, "batch_size": 64, "seq_len": 2048, "learners": 3}


def _accel(slug: str, memory_gib: float, tflops: float, watts: int) -> AcceleratorType:
    return AcceleratorType.objects.create(slug=slug, vendor="t", model=slug, kind="gpu", generation="g",
                                          year=2024, memory_gib=memory_gib, peak_bf16_tflops=tflops,
                                          tdp_watts=watts)


def _pool(slug: str, accel: AcceleratorType, devices: int, cost: str, link: float, **kw) -> Pool:
    return Pool.objects.create(slug=slug, name=slug, region="r", accelerator=accel, device_count=devices,
                               cost_per_device_hour=cost, link_gbps=link, **kw)


def _busy(owner, pool: Pool, states: list[str]) -> None:
    """Another job's learners on `pool`, in `states`."""
    other = Job.objects.create(owner=owner, name="other", spec=JobSpec().model_dump(mode="json"),
                               status=st.RUNNING)
    for i, state in enumerate(states):
        Learner.objects.create(job=other, index=i, incarnation=1, pool=pool, state=state)


@pytest.fixture
def mixed(alice):
    """Fast and dear, slow and cheap, frugal, remote; busy slots and a dead pool."""
    fast = _accel("fast", 80, 900, 700)
    mid = _accel("mid", 40, 300, 250)
    slow = _accel("slow", 16, 20, 60)
    edge = _accel("edge", 0.5, 50, 30)
    pools = {
        "fast": _pool("fast", fast, 2, "4.0", 100),
        "mid": _pool("mid", mid, 3, "1.2", 25),
        "slow": _pool("slow", slow, 6, "0.1", 10),
        "remote": _pool("remote", mid, 4, "0.6", 0.05, latency_ms=80),
        "edge": _pool("edge", edge, 1, "0.05", 10),
        "dead": _pool("dead", fast, 4, "0.2", 100),
        "draining": _pool("draining", fast, 4, "0.2", 100, state=Pool.State.DRAINING),
    }
    old = timezone.now() - timedelta(hours=1)
    Node.objects.create(pool=pools["dead"], hostname="d", worker_name="dead-0@d", state=Node.State.LOST,
                        last_seen=old)
    # a node that measured another job's (another model's) throughput: not this spec's figure
    Node.objects.create(pool=pools["slow"], hostname="s", worker_name="slow-0@s", measured_tokens_per_s=1e9)
    _busy(alice, pools["fast"], [Learner.State.RUNNING])
    _busy(alice, pools["mid"], [Learner.State.STARTING, Learner.State.PENDING, Learner.State.DONE])
    return pools


KEYS = ("index", "pool", "work_size", "wire_dtype")  # what a placed learner row records


def _placed(owner, spec: JobSpec) -> tuple[list[dict], dict]:
    """What the coordinator does with `spec`: its learners and the estimate it logged."""
    job = Job.objects.create(owner=owner, name="parity", spec=spec.model_dump(mode="json"), status=st.PLACING)
    place_job(job)
    learners = [dict(zip(KEYS, row, strict=True)) for row in job.learners.order_by("index").values_list(
        "index", "pool__slug", "work_size", "wire_dtype")]
    payload = Event.objects.get(job=job, kind=Event.Kind.PLACED).payload
    job.delete()  # the next spec sees the same fleet
    return learners, {"time_s": payload["est_time_s"], "energy_j": payload["est_energy_j"],
                      "cost": payload["est_cost"]}


SPECS = [
    pytest.param({**SMALL}, id="time"),
    pytest.param({**SMALL, "learners": 6, "objective": "cost"}, id="cost"),
    pytest.param({**SMALL, "learners": 5, "objective": "energy"}, id="energy"),
    pytest.param({**SMALL, "learners": 3, "pools": ["slow", "remote", "dead"]}, id="restricted-pools"),
    pytest.param({**SMALL, "learners": 3, "compression": "int8", "fragments": 2}, id="compression"),
    pytest.param({**SMALL, "learners": 2, "max_tokens": 5000, "objective": "energy"}, id="token-budget"),
    pytest.param({**BIG_BATCH, "pools": ["edge", "slow"]}, id="pool-too-small"),
    pytest.param({**BIG_BATCH, "objective": "cost"}, id="big-model-cost"),
    pytest.param({**SMALL, "learners": 3, "devices_per_learner": 2}, id="learner-islands"),
]


@pytest.mark.parametrize("data", SPECS)
def test_dry_run_equals_what_the_coordinator_places(alice, mixed, data):
    spec = JobSpec.model_validate(data)
    shown = preview(spec)
    assert shown["feasible"], shown["problems"]
    learners, estimate = _placed(alice, spec)
    assert [{k: lr[k] for k in KEYS} for lr in shown["learners"]] == learners
    assert shown["estimate"] == pytest.approx(estimate)
    page = dry_run(spec)  # the dashboard's /jobs/new preview is the same plan
    assert [{k: lr[k] for k in KEYS} for lr in page["learners"]] == learners and page["ok"]


def test_fleet_state_the_old_dry_run_ignored_changes_both_alike(alice, mixed):
    """Dead and draining pools have no free slot; starting and running learners hold one, pending none."""
    spec = JobSpec.model_validate({**SMALL, "learners": 6, "pools": ["fast", "mid", "dead", "draining"]})
    free = {p["slug"]: p["devices_free"] for p in preview(spec)["pools"]}
    assert free == {"dead": 0, "draining": 0, "fast": 1, "mid": 2}
    shown = preview(spec)
    assert not shown["feasible"] and "only 3 learner slot(s) free" in shown["problems"][-1]
    job = Job.objects.create(owner=alice, name="p", spec=spec.model_dump(mode="json"), status=st.PLACING)
    with pytest.raises(PlacementError, match="only 3 learner slot"):
        place_job(job)


def test_a_pool_too_small_for_the_model_is_refused_by_both(alice, mixed):
    spec = JobSpec.model_validate({**BIG_BATCH, "learners": 1, "pools": ["edge"]})
    shown = preview(spec)
    assert not shown["feasible"]
    assert "1 free device(s), a learner needs 2" in shown["problems"][-1]
    job = Job.objects.create(owner=alice, name="p", spec=spec.model_dump(mode="json"), status=st.PLACING)
    with pytest.raises(PlacementError, match="a learner needs 2"):
        place_job(job)
