"""Placement preview for a dry run: where a spec would run on today's inventory, and at what price.

The plan is the coordinator's own (`apps.coordinator.dispatch.plan`: its pool view, free-slot
rule and model figures, then `trainer.placement.place_spec`), so a job submitted right after
a dry run is placed exactly as previewed.
"""
from __future__ import annotations

from typing import Any

from apps.coordinator.dispatch import figures, pool_infos
from apps.inventory.models import Pool
from trainer.placement import PlacementError, place_spec
from trainer.spec import JobSpec


def preview(spec: JobSpec) -> dict[str, Any]:
    """{"feasible", "problems", "pools", "learners", "estimate", "reasons", "model"}."""
    known = set(Pool.objects.filter(slug__in=spec.pools).values_list("slug", flat=True))
    problems = [f"pool {s!r} does not exist" for s in spec.pools if s not in known]
    infos = pool_infos(spec)
    model = figures(spec)
    out: dict[str, Any] = {
        "feasible": False,
        "problems": problems,
        "model": {"memory_gib": round(model.memory_gib, 4), "flops_per_token": model.flops_per_token,
                  "fragment_bytes": model.fragment_bytes},
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
        p = place_spec(spec, model, infos)  # dispatch.plan(spec), without reading the fleet twice
    except PlacementError as exc:
        problems.append(str(exc))
        return out
    out.update(
        feasible=not problems,
        learners=[{"index": i, "pool": slug, "work_size": p.work_sizes[slug],
                   "wire_dtype": p.wire_dtype[slug], "devices": p.devices_per_learner.get(slug, 1),
                   **({"nodes": p.nodes[i]} if i in p.nodes else {})}
                  for i, slug in p.assignments],
        work_sizes=p.work_sizes,
        wire_dtype=p.wire_dtype,
        estimate={"time_s": p.est_time_s, "energy_j": p.est_energy_j, "cost": p.est_cost},
        reasons=p.reasons,
    )
    return out
