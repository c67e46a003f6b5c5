"""Placement preview for a dry run: where a spec would run on today's inventory, and at what price.

Builds `trainer.placement.PoolInfo` rows from the inventory (free devices = devices minus
learners already placed there; measured throughput from the pool's nodes when known) and
asks the platform's placement policy, `trainer.placement.place`, for a plan.
"""
from __future__ import annotations

import inspect
from typing import Any

from django.db.models import Avg, Count, Q

from apps.inventory.models import Pool
from apps.jobs.models import Learner
from trainer.spec import JobSpec

BUSY = [Learner.State.PENDING, Learner.State.STARTING, Learner.State.RUNNING]


def model_figures(spec: JobSpec) -> tuple[float, float, int]:
    """The coordinator's figures (trainer.models.spec_model_figures), so the preview matches it."""
    from trainer.models import spec_model_figures

    return spec_model_figures(spec)


def pool_infos(spec: JobSpec) -> tuple[list[Any], list[str]]:
    from trainer.placement import PoolInfo

    pools = (
        Pool.objects.select_related("accelerator")
        .annotate(busy=Count("learners", filter=Q(learners__state__in=BUSY), distinct=True),
                  measured=Avg("nodes__measured_tokens_per_s"))
        .order_by("slug")
    )
    if spec.pools:
        pools = pools.filter(slug__in=spec.pools)
    problems = []
    known = {p.slug for p in pools}
    problems += [f"pool {s!r} does not exist" for s in spec.pools if s not in known]
    infos = []
    for p in pools:
        a = p.accelerator
        infos.append(PoolInfo(
            slug=p.slug, accelerator=a.slug, peak_tflops_per_device=a.peak_bf16_tflops,
            memory_gib=a.memory_gib, watts_per_device=float(a.tdp_watts),
            cost_per_device_hour=float(p.cost_per_device_hour), devices_free=max(0, p.device_count - p.busy),
            link_gbps=p.link_gbps, latency_ms=p.latency_ms, measured_tokens_per_s=p.measured,
            speed_factor=p.speed_factor, state=p.state,
        ))
    return infos, problems


def preview(spec: JobSpec) -> dict[str, Any]:
    """{"feasible", "problems", "pools", "learners", "estimate", "reasons", "model"}."""
    from trainer.placement import PlacementError, place

    infos, problems = pool_infos(spec)
    memory_gib, flops_per_token, fragment_bytes = model_figures(spec)
    tokens_per_step = spec.batch_size * spec.seq_len
    tokens_per_learner = spec.total_tokens // spec.learners
    out: dict[str, Any] = {
        "feasible": False,
        "problems": problems,
        "model": {"memory_gib": round(memory_gib, 4), "flops_per_token": flops_per_token,
                  "fragment_bytes": fragment_bytes},
        "total_tokens": spec.total_tokens,
        "objective": spec.objective,
        "pools": [{"slug": i.slug, "accelerator": i.accelerator, "state": i.state,
                   "devices_free": i.devices_free} for i in infos],
        "learners": [],
        "work_sizes": {},
        "wire_dtype": {},
        "estimate": None,
        "reasons": [],
    }
    if not infos:
        problems.append("no pool in the inventory matches this spec")
        return out
    try:
        kwargs = {"model_memory_gib": memory_gib, "model_flops_per_token": flops_per_token,
                  "tokens_per_learner": max(1, tokens_per_learner), "base_inner_steps": spec.inner_steps,
                  "fragment_bytes": fragment_bytes, "fragments": spec.fragments,
                  "tokens_per_step": tokens_per_step}
        accepted = inspect.signature(place).parameters
        plan = place(spec.learners, infos, spec.objective,
                     **{k: v for k, v in kwargs.items() if k in accepted})
    except PlacementError as exc:
        problems.append(str(exc))
        return out
    out.update(
        feasible=not problems,
        learners=[{"index": i, "pool": slug, "work_size": plan.work_sizes[slug],
                   "wire_dtype": plan.wire_dtype[slug]} for i, slug in plan.assignments],
        work_sizes=plan.work_sizes,
        wire_dtype=plan.wire_dtype,
        estimate={"time_s": plan.est_time_s, "energy_j": plan.est_energy_j, "cost": plan.est_cost},
        reasons=plan.reasons,
    )
    return out
