"""Metric time series for the API, downsampled in the database.

Each series (metric name x learner) is cut into at most `points` buckets of equal width
along `step` (tokens); each bucket is averaged in SQL (AVG of step and value, MAX of time),
so the response size is bounded by points x series however many rows the job has.
"""
from __future__ import annotations

from django.db.models import Avg, Count, F, IntegerField, Max, Min, Q, Value
from django.db.models.functions import Cast, Floor

from apps.jobs.models import Job, MetricPoint

MAX_SERIES = 200


def _scope(job: Job, names: list[str] | None, learner) -> Q:
    q = Q(job=job)
    if names:
        q &= Q(name__in=names)
    if learner == "job":
        q &= Q(learner__isnull=True)
    elif isinstance(learner, int):
        q &= Q(learner__index=learner)
    return q


def series(job: Job, names: list[str] | None = None, points: int = 500, learner="all") -> list[dict]:
    """[{name, learner, points: [[step, value, unix_time], ...]}], at most `points` per series."""
    qs = MetricPoint.objects.filter(_scope(job, names, learner))
    ranges = (
        qs.values("name", "learner__index")
        .annotate(lo=Min("step"), hi=Max("step"), n=Count("id"))
        .order_by("name", "learner__index")[:MAX_SERIES]
    )
    out = []
    for r in ranges:
        name, lidx, lo, hi, n = r["name"], r["learner__index"], r["lo"], r["hi"], r["n"]
        sq = qs.filter(name=name)
        sq = sq.filter(learner__isnull=True) if lidx is None else sq.filter(learner__index=lidx)
        if n <= points:
            rows = sq.order_by("step", "time").values_list("step", "value", "time")
            pts = [[float(s), v, t.timestamp()] for s, v, t in rows]
        else:
            span = (hi - lo) + 1
            bucket = Cast(Floor((F("step") - Value(lo)) * Value(float(points)) / Value(float(span))),
                          IntegerField())
            rows = (
                sq.annotate(b=bucket).values("b")
                .annotate(s=Avg("step"), v=Avg("value"), t=Max("time"))
                .order_by("b").values_list("s", "v", "t")
            )
            pts = [[float(s), v, t.timestamp()] for s, v, t in rows]
        out.append({"name": name, "learner": lidx, "points": pts})
    return out


def latest_values(job: Job) -> dict[str, float]:
    """The newest job-level value of each metric name (one small query per name)."""
    names = (
        MetricPoint.objects.filter(job=job, learner__isnull=True)
        .values_list("name", flat=True).distinct().order_by("name")[:20]
    )
    latest = {}
    for name in names:
        row = (MetricPoint.objects.filter(job=job, learner__isnull=True, name=name)
               .order_by("-time", "-id").values_list("value", flat=True).first())
        if row is not None:
            latest[name] = row
    return latest
