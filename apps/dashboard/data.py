"""Read side of the dashboard: who sees what, and metrics downsampled in the database.

Every function here runs a fixed, small number of queries whatever the size of the
tables, so page render time stays flat with many jobs and many metric points.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Count, Max, Min, Q, QuerySet, Sum
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

    Two queries in all, whatever the number of points: the step (token) range of each job,
    then one aggregate where a point's bucket is its position in its job's step range.
    Inside a bucket each learner's points are averaged first; then a SUMMED series adds
    the learners up (per-learner tokens/s become the job's tokens/s) and the others take
    the mean over learners. Both levels are hash aggregates (no sort, no DISTINCT), so
    100k points of one job aggregate in tens of milliseconds.
    """
    job_ids = [int(j) for j in job_ids]
    names = list(names)
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
    table = MetricPoint._meta.db_table
    qn = connection.ops.quote_name
    case_sql, params = [], []
    for jid, (lo, hi) in ranges.items():
        case_sql.append("WHEN %s THEN (step - %s) * %s / %s")
        params += [jid, lo, buckets - 1, max(hi - lo, 1)]
    # epoch seconds of the bucket's last point, converted once per bucket (not per row)
    epoch = ("EXTRACT(EPOCH FROM MAX(t))" if connection.vendor == "postgresql"
             else "CAST(strftime('%%s', MAX(t)) AS REAL)" if connection.vendor == "sqlite"
             else "UNIX_TIMESTAMP(MAX(t))")
    jobs_in = ", ".join(["%s"] * len(ranges))
    names_in = ", ".join(["%s"] * len(names))
    # Only %s placeholders and quoted identifiers are formatted into the text.
    sql = f"""
        SELECT job_id, name, bucket, AVG(x), {epoch}, AVG(y), SUM(y)
        FROM (
            SELECT job_id, name, learner_id, CASE job_id {' '.join(case_sql)} ELSE 0 END AS bucket,
                   AVG(step) AS x, MAX({qn("time")}) AS t, AVG(value) AS y
            FROM {qn(table)}
            WHERE job_id IN ({jobs_in}) AND name IN ({names_in})
            GROUP BY job_id, name, learner_id, bucket
        ) per_learner
        GROUP BY job_id, name, bucket
        ORDER BY job_id, name, bucket
    """  # noqa: S608
    params += list(ranges) + names
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        if connection.vendor == "postgresql":
            # The planner cannot estimate the bucket count and would sort 100k rows on disk
            # under the default 4 MB; a little more memory for this one query keeps it a
            # hash aggregate (or an in-memory sort). SET LOCAL ends with the transaction.
            cur.execute("SET LOCAL work_mem = '64MB'")
        cur.execute(sql, params)
        for job_id, name, _bucket, x, t, mean, total in cur.fetchall():
            y = total if name in SUMMED else mean
            out[job_id].setdefault(name, []).append((int(x), float(t), float(y)))
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
