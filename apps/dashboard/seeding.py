"""Synthetic fleet, jobs and metrics for the dashboard bench and tests (bulk inserts)."""
from __future__ import annotations

import math
import random
from datetime import timedelta

from django.utils import timezone

from apps.inventory.models import AcceleratorType, Node, Pool
from apps.jobs import state as st
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner, MetricPoint, OuterStep

POOLS = [
    # slug, vendor, model, generation, year, mem, tflops, tdp, devices, cost/device-hour
    ("h100-east", "NVIDIA", "H100 SXM", "Hopper", 2022, 80, 989, 700, 8, 2.5),
    ("a100-west", "NVIDIA", "A100 SXM", "Ampere", 2020, 80, 312, 400, 8, 1.2),
    ("v100-lab", "NVIDIA", "V100", "Volta", 2017, 32, 125, 300, 4, 0.4),
]


def seed_fleet() -> list[Pool]:
    pools = []
    for slug, vendor, model, gen, year, mem, tflops, tdp, devices, cost in POOLS:
        acc, _ = AcceleratorType.objects.get_or_create(
            slug=f"{vendor}-{model}".lower().replace(" ", "-"),
            defaults={"vendor": vendor, "model": model, "generation": gen, "year": year,
                      "memory_gib": mem, "peak_bf16_tflops": tflops, "tdp_watts": tdp})
        pool, _ = Pool.objects.get_or_create(
            slug=slug, defaults={"name": f"{model} pool", "region": slug.split("-")[1], "accelerator": acc,
                                 "device_count": devices, "cost_per_device_hour": cost, "link_gbps": 10.0})
        Node.objects.get_or_create(worker_name=f"{slug}@node1",
                                   defaults={"pool": pool, "hostname": f"{slug}-node1",
                                             "device_count": devices,
                                             "measured_tokens_per_s": 4000.0 * tflops / 312})
        pools.append(pool)
    return pools


def seed_jobs(owner, jobs: int = 50, points: int = 100_000, learners: int = 4,
              running_share: float = 0.4, seed: int = 0) -> list[Job]:
    """`jobs` jobs of `owner` with `points` MetricPoints spread over them, plus learners,
    outer steps, events, incidents and checkpoints: the shape of a busy day."""
    rng = random.Random(seed)
    pools = seed_fleet()
    now = timezone.now()
    statuses = [st.RUNNING] * int(jobs * running_share) + [st.COMPLETED, st.FAILED, st.CANCELLED, st.QUEUED]
    spec = {"name": "bench", "strategy": "decoupled", "model": "tiny", "dataset": "stdlib",
            "learners": learners}
    created = Job.objects.bulk_create([
        Job(owner=owner, name=f"bench-{i}", spec={**spec, "name": f"bench-{i}"},
            status=statuses[i % len(statuses)] if i < len(statuses) else rng.choice(statuses),
            started_at=now - timedelta(hours=2), outer_steps=rng.randint(10, 400),
            tokens_computed=rng.randint(10**6, 10**9), tokens_contributed=0,
            bytes_sent=rng.randint(10**6, 10**10),
            energy_j=rng.uniform(1e5, 1e7), cost=rng.uniform(1, 100), final_val_loss=rng.uniform(2, 4))
        for i in range(jobs)
    ])
    for j in created:
        j.tokens_contributed = int(j.tokens_computed * rng.uniform(0.8, 0.99))
    Job.objects.bulk_update(created, ["tokens_contributed"])
    lrs = Learner.objects.bulk_create([
        Learner(job=j, index=k, pool=pools[k % len(pools)], state=Learner.State.RUNNING
                if j.status == st.RUNNING else Learner.State.DONE, incarnation=1, work_size=20,
                tokens=j.tokens_computed // learners, tokens_per_s=rng.uniform(1000, 9000),
                loss=rng.uniform(2, 4), last_heartbeat=now)
        for j in created for k in range(learners)
    ])
    by_job: dict[int, list[Learner]] = {}
    for lr in lrs:
        by_job.setdefault(lr.job_id, []).append(lr)
    OuterStep.objects.bulk_create([
        OuterStep(job=j, fragment=0, version=v, merged_norm=rng.uniform(0.1, 1),
                  contributors=[{"learner": k, "incarnation": 1, "base_version": v - 1, "tokens": 1000,
                                 "weight": 1.0, "norm": rng.uniform(0.1, 1), "cosine": rng.uniform(0.2, 0.9)}
                                for k in range(learners)],
                  created_at=now - timedelta(seconds=600 - v))
        for j in created for v in range(1, 61)
    ])
    Event.objects.bulk_create([
        Event(job=j, kind=rng.choice(["placed", "merged", "rebalanced", "checkpointed"]),
              message=f"event {e}", payload={"reason": "bench"}, time=now - timedelta(seconds=e))
        for j in created for e in range(40)
    ])
    Incident.objects.bulk_create([
        Incident(job=j, pool=pools[0], kind="learner_lost", description="bench",
                 failed_at=now - timedelta(seconds=30), detected_at=now - timedelta(seconds=27),
                 healed_at=None if i % 5 == 0 else now)
        for i, j in enumerate(created)
    ])
    Checkpoint.objects.bulk_create([
        Checkpoint(job=j, version=v, blob_uri=f"memory://bench/{j.pk}/{v}", size_bytes=10**6, sha256="0" * 64)
        for j in created for v in (10, 20, 30)
    ])
    names = ["train_loss", "val_loss", "tokens_per_s", "goodput", "bytes_sent"]
    per_job = max(1, points // max(1, jobs))
    batch: list[MetricPoint] = []
    for j in created:
        learners_j = by_job[j.pk]
        for i in range(per_job):
            name = names[i % len(names)]
            lr = learners_j[i % len(learners_j)] if name in ("train_loss", "tokens_per_s") else None
            tokens = (i + 1) * 4096
            value = {"train_loss": 4 * math.exp(-i / per_job) + rng.random() * 0.1,
                     "val_loss": 4 * math.exp(-i / per_job), "tokens_per_s": rng.uniform(1000, 9000),
                     "goodput": rng.uniform(0.8, 1.0), "bytes_sent": float(i * 10**5)}[name]
            batch.append(MetricPoint(job=j, learner=lr, name=name, step=tokens, value=value,
                                     time=now - timedelta(seconds=per_job - i)))
            if len(batch) >= 5000:
                MetricPoint.objects.bulk_create(batch)
                batch = []
    if batch:
        MetricPoint.objects.bulk_create(batch)
    return created
