"""Runtime accounting without processes: contribution health, energy / cost, live tokens, goodput."""
from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
import torch
from django.utils import timezone

from apps.coordinator.models import LearnerRuntime
from apps.coordinator.syncer import SyncerRun, goodput
from apps.inventory.models import AcceleratorType, Pool
from apps.jobs import state as st
from apps.jobs.models import Job, Learner, MetricPoint
from trainer.clock import ManualClock
from trainer.config import TrainConfig
from trainer.protocol import Contribution
from trainer.syncer import Syncer

from .conftest import TINY

SHAPES = {"a.weight": (4, 3), "b.bias": (5,)}


def _contrib(learner: int, tensors: dict) -> Contribution:
    return Contribution(job="local", learner=learner, incarnation=0, fragment=0, base_version=0,
                        tokens=100, inner_steps=4, tensors=tensors)


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([d[n].reshape(-1) for n in SHAPES])


@pytest.mark.parametrize("rda", [False, True])
def test_merge_reports_each_contributions_norm_and_cosine_to_the_merged_update(rda):
    cfg = TrainConfig(learners=3, quorum=3, inner_steps=4, fragments=1, outer_lr=0.7, outer_momentum=0.9,
                      rda=rda)
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    syncer = Syncer(cfg, init, ManualClock())
    deltas = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(2)]
    deltas.append({n: -t for n, t in deltas[0].items()})  # learner 2 pulls against learner 0
    deltas[1] = {n: t * 3 + deltas[0][n] for n, t in deltas[1].items()}
    for i, d in enumerate(deltas):
        assert syncer.submit(_contrib(i, {n: t.clone() for n, t in d.items()})).accepted
    before = {n: t.clone() for n, t in syncer.params.items()}
    result = syncer.merge(0)
    by = {c["learner"]: c for c in result.contributors}
    merged = None
    if not rda:  # equal weights: the merged pseudo-gradient is the mean
        merged = sum(_flat(d) for d in deltas) / 3
        assert result.merged_norm == pytest.approx(float(merged.norm()), rel=1e-5)
    for i, d in enumerate(deltas):
        assert by[i]["norm"] == pytest.approx(float(_flat(d).norm()), rel=1e-5)
        assert -1.0 <= by[i]["cosine"] <= 1.0
        if merged is not None:
            want = float(torch.nn.functional.cosine_similarity(_flat(d), merged, dim=0))
            assert by[i]["cosine"] == pytest.approx(want, abs=1e-5)
    assert by[2]["cosine"] == pytest.approx(-by[0]["cosine"], abs=1e-5)  # exactly opposite contribution
    assert by[1]["cosine"] > 0
    assert any(not torch.equal(before[n], syncer.params[n]) for n in SHAPES)  # the outer step still ran


def test_goodput_is_a_share_never_above_one():
    assert goodput(50, 100) == 0.5
    assert goodput(120, 100) == 1.0
    assert goodput(0, 0) == 0.0


@pytest.fixture
def job_on_pools(owner):
    acc = AcceleratorType.objects.create(slug="t-gpu", vendor="x", model="g", kind="gpu", generation="g",
                                         year=2024, memory_gib=80, peak_bf16_tflops=100, tdp_watts=700)
    cheap = AcceleratorType.objects.create(slug="t-cpu", vendor="x", model="c", kind="cpu", generation="g",
                                           year=2024, memory_gib=8, peak_bf16_tflops=1, tdp_watts=100)
    gpu = Pool.objects.create(slug="gpu", name="gpu", region="r", accelerator=acc, device_count=2,
                              link_gbps=10, cost_per_device_hour=Decimal("2.5"))
    cpu = Pool.objects.create(slug="cpu", name="cpu", region="r", accelerator=cheap, device_count=2,
                              link_gbps=10, cost_per_device_hour=Decimal("0.1"))
    job = Job.objects.create(owner=owner, name="acct", spec={**TINY, "learners": 4}, status=st.RUNNING)
    t = timezone.now()
    h = timedelta(hours=1)
    specs = [  # (pool, state, started, last heartbeat, tokens computed)
        (gpu, Learner.State.RUNNING, t - 2 * h, t, 1000),  # busy the whole hour
        (cpu, Learner.State.RUNNING, t - h / 3, t, 500),  # started 20 min ago
        (gpu, Learner.State.RUNNING, t - 2 * h, t - h / 6, 300),  # silent for 10 min: dead since then
        (gpu, Learner.State.DONE, t - 2 * h, t - h / 2, 200),  # finished half an hour ago
        (gpu, Learner.State.DONE, t - 3 * h, t - 2 * h, 0),  # finished before the hour
    ]
    for i, (pool, state, started, hb, computed) in enumerate(specs):
        lr = Learner.objects.create(job=job, index=i, incarnation=1, pool=pool, state=state,
                                    started_at=started, last_heartbeat=hb)
        LearnerRuntime.objects.create(learner=lr, tokens_computed=computed)
    return job


@pytest.mark.django_db
def test_energy_and_cost_come_from_busy_learners_on_their_pools(job_on_pools):
    job = job_on_pools
    run = SyncerRun(job.pk, epoch=1, worker="w")
    run.account()  # first tick of a job not started yet: reference point only
    job.refresh_from_db()
    assert job.energy_j == 0 and job.cost == 0
    assert job.tokens_computed == 2000  # live, all learners' tokens
    run.accounted_at = timezone.now() - timedelta(hours=1)  # the previous tick, an hour ago
    run.account()
    job.refresh_from_db()
    gpu_hours = 1 + 5 / 6 + 1 / 2  # running, dead after 50 min, done after 30 min
    assert job.energy_j == pytest.approx(700 * 3600 * gpu_hours + 100 * 1200, rel=1e-3)
    assert job.cost == pytest.approx(2.5 * gpu_hours + 0.1 / 3, rel=1e-3)


@pytest.mark.django_db
def test_tokens_computed_never_below_contributed_and_goodput_series(job_on_pools):
    from apps.dashboard import data

    job = job_on_pools
    Job.objects.filter(pk=job.pk).update(tokens_contributed=2600, bytes_sent=12345)  # heartbeats lag
    run = SyncerRun(job.pk, epoch=1, worker="w")
    run.account()
    run.job_metrics()
    job.refresh_from_db()
    assert job.tokens_computed == 2600 >= job.tokens_contributed
    LearnerRuntime.objects.filter(learner__job=job, learner__index=0).update(tokens_computed=2000)
    Job.objects.filter(pk=job.pk).update(bytes_sent=20000)
    run.account()
    run.job_metrics()
    job.refresh_from_db()
    assert job.tokens_computed == 3000
    mp = MetricPoint.objects.filter(job=job).order_by("id")
    points = list(mp.filter(name="goodput").values_list("step", "value"))
    assert points == [(2600, 1.0), (2600, pytest.approx(2600 / 3000))]
    sent = list(mp.filter(name="bytes_sent").values_list("value", flat=True))
    assert sent == [12345.0, 20000.0]
    series = data.downsample([job.pk], ["goodput", "bytes_sent"], 10)[job.pk]  # what the job page reads
    assert set(series) == {"goodput", "bytes_sent"}
    assert all(0 < v <= 1 for _x, _t, v in series["goodput"])
    assert 12345.0 <= series["bytes_sent"][-1][2] <= 20000.0  # both points share one bucket: averaged
    assert not mp.filter(name="outer_step_norm").exists()  # no merge yet: no norm point

    run.last_merged_norm = 0.25  # what a commit records
    run.job_metrics()
    assert list(mp.filter(name="outer_step_norm").values_list("step", "value")) == [(2600, 0.25)]


@pytest.mark.django_db
def test_first_tick_of_a_fresh_job_counts_from_the_job_start(job_on_pools):
    job = job_on_pools
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - timedelta(minutes=30))
    SyncerRun(job.pk, epoch=1, worker="w").account()
    job.refresh_from_db()
    # 30 min: the busy gpu learner, the cpu one (started 20 min ago), the silent one (dead 10
    # min ago) and the one that finished 30 min ago (nothing)
    assert job.energy_j == pytest.approx(700 * (1800 + 1200) + 100 * 1200, rel=1e-3)
    before = job.energy_j
    SyncerRun(job.pk, epoch=2, worker="w").account()  # a restarted syncer: no double count
    job.refresh_from_db()
    assert job.energy_j == before
