"""Read side of the dashboard: who sees what, and metrics downsampled in the database.

Every function here runs a fixed, small number of queries whatever the size of the
tables, so page render time stays flat with many jobs and many metric points.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from django.db.models import Avg, Case, Count, F, IntegerField, Max, Min, Q, QuerySet, Sum, Value, When
from django.utils import timezone

from apps.inventory.models import Node, Pool
from apps.jobs import state as st
from apps.jobs.models import Job, Learner, MetricPoint

# Series whose per-learner points add up to a job figure (the others are averaged).
SUMMED = frozenset({"tokens_per_s", "bytes_sent"})
CHART_SERIES = ("train_loss", "val_loss", "tokens_per_s", "goodput", "bytes_sent", "outer_step_norm")


def visible_jobs(user) -> QuerySet[Job]:
    """Staff see every job; everyone else only their own."""
    qs = Job.objects.all()
    return qs if user.is_staff else qs.filter(owner=user)


def downsample(job_ids: Iterable[int], names: Iterable[str], buckets: int = 200) -> dict:
    """{job_id: {name: [(tokens, unix_time, value), ...]}} with at most `buckets` points per series.

    Two queries in all: the step range of each job, then one GROUP BY over
    (job, name, bucket) where the bucket is the point's position in its job's step range.
    A bucket's value is the mean of its points; for SUMMED series the mean times the
    number of distinct learners reporting in the bucket (a per-learner rate becomes the
    job's rate).
    """
    job_ids, names = list(job_ids), list(names)
    out: dict[int, dict[str, list[tuple[int, float, float]]]] = {j: {} for j in job_ids}
    if not job_ids or not names:
        return out
    base = MetricPoint.objects.filter(job_id__in=job_ids, name__in=names)
    ranges = {
        r["job_id"]: (r["lo"], r["hi"])
        for r in base.values("job_id").annotate(lo=Min("step"), hi=Max("step")).order_by()
    }
    if not ranges:
        return out
    whens = [
        When(job_id=jid, then=(F("step") - Value(lo)) * Value(buckets - 1) / Value(max(hi - lo, 1)))
        for jid, (lo, hi) in ranges.items()
    ]
    rows = (
        base.annotate(bucket=Case(*whens, default=Value(0), output_field=IntegerField()))
        .values("job_id", "name", "bucket")
        .annotate(x=Avg("step"), t=Max("time"), y=Avg("value"),
                  n=Count("learner_id", distinct=True), anon=Count("id", filter=Q(learner_id=None)))
        .order_by("job_id", "name", "bucket")
    )
    for r in rows:
        y = r["y"]
        if r["name"] in SUMMED and r["n"] > 1 and not r["anon"]:
            y = y * r["n"]
        out[r["job_id"]].setdefault(r["name"], []).append((int(r["x"]), r["t"].timestamp(), y))
    return out


def start_of_today() -> datetime:
    return timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)


def pool_rows(pools: Iterable[Pool] | None = None) -> list[dict]:
    """Pools with live figures from their running learners (3 queries)."""
    pools = list(pools if pools is not None else Pool.objects.select_related("accelerator"))
    ids = [p.pk for p in pools]
    live = {
        r["pool_id"]: r
        for r in Learner.objects.filter(pool_id__in=ids, state=Learner.State.RUNNING)
        .values("pool_id")
        .annotate(busy=Count("id"), tps=Sum("tokens_per_s"))
        .order_by()
    }
    nodes = defaultdict(lambda: {"online": 0, "total": 0, "measured": 0.0})
    for r in (
        Node.objects.filter(pool_id__in=ids)
        .values("pool_id", "state")
        .annotate(n=Count("id"), measured=Sum("measured_tokens_per_s"))
        .order_by()
    ):
        d = nodes[r["pool_id"]]
        d["total"] += r["n"]
        if r["state"] == "online":
            d["online"] += r["n"]
            d["measured"] += r["measured"] or 0.0
    rows = []
    for p in pools:
        lv = live.get(p.pk, {})
        busy = lv.get("busy", 0)
        util = min(1.0, busy / p.device_count) if p.device_count else 0.0
        rows.append({
            "pool": p,
            "busy": busy,
            "utilisation": util,
            "tokens_per_s": lv.get("tps") or 0.0,
            "measured_peak_tokens_per_s": nodes[p.pk]["measured"] or None,
            "nodes_online": nodes[p.pk]["online"],
            "nodes_total": nodes[p.pk]["total"],
            # TDP-based estimate: devices running learners draw their TDP, idle ones ~15 %.
            "watts": round(p.accelerator.tdp_watts * (busy + 0.15 * max(p.device_count - busy, 0))),
            "peak_tflops": p.total_peak_tflops,
            "cost_per_hour": p.cost_per_hour,
        })
    return rows


def energy_cost_today(jobs: QuerySet[Job]) -> dict:
    """Energy and cost of jobs that ran today (their running totals), one query."""
    agg = jobs.filter(Q(finished_at__isnull=True, started_at__isnull=False)
                      | Q(finished_at__gte=start_of_today())).aggregate(
        energy=Sum("energy_j"), cost=Sum("cost"), n=Count("id"))
    return {"kwh": (agg["energy"] or 0.0) / 3.6e6, "cost": agg["cost"] or 0.0, "jobs": agg["n"]}


ACTIVE = (st.PLACING, st.RUNNING, st.PAUSING)
