"""Dry run of a job spec against the current inventory, for the /jobs/new page.

The plan comes from the same code as the API's dry run (apps.api.placement.preview, which
shows the coordinator's own plan), so the dashboard, the API and the coordinator agree on
placement, work sizes and estimates.
"""
from __future__ import annotations

from typing import Any

from trainer.spec import JobSpec


def dry_run(spec: JobSpec) -> dict[str, Any]:
    from apps.api.placement import preview

    plan = preview(spec)
    est = plan.get("estimate") or None
    if est:
        est = {**est, "energy_kwh": est["energy_j"] / 3.6e6 if est.get("energy_j") is not None else None}
    by_pool: dict[str, int] = {}
    for lr in plan.get("learners", []):
        by_pool[lr["pool"]] = by_pool.get(lr["pool"], 0) + 1
    return {
        "ok": bool(plan.get("feasible")),
        "problems": plan.get("problems", []),
        "pools": [{**p, "planned": by_pool.get(p["slug"], 0)} for p in plan.get("pools", [])],
        "learners": plan.get("learners", []),
        "estimate": est,
        "reasons": plan.get("reasons", []),
        "objective": plan.get("objective", spec.objective),
        "total_tokens": plan.get("total_tokens", spec.total_tokens),
        "model": plan.get("model", {}),
    }
