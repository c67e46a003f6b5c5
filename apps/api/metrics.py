"""Metric time series for the API, downsampled in the database.

Each series (metric name x learner) is cut into at most `points` buckets of equal width
along `step` (tokens); each bucket is averaged in SQL (AVG of step and value, MAX of time),
so the response size is bounded by points x series however many rows the job has. A series
with no more rows than `points` comes back as it is (rows at the same step are averaged).
One query for all series: window functions give each series its step range and size; the
bucket arithmetic is in floating point (numeric is several times slower in PostgreSQL, and no
stored step, however large, overflows it), the learner's index comes from a join and, on
PostgreSQL, the time as Unix seconds from the database, so Python only reshapes rows
(profiled for issue 19: parsing 1,200 timestamps per request cost more than the query).
Job-level series (val_loss, goodput...) are read from the coordinator's rows (learner null)
only: a learner-level row with such a name is nobody's figure.
"""
from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection

from apps.jobs.models import Job, Learner, MetricPoint
from apps.telemetry.protocol import JOB_SERIES

MAX_SERIES = 200
qn = connection.ops.quote_name


def _as_unix(t) -> float:
    if isinstance(t, str):  # SQLite returns the aggregate as text
        t = datetime.fromisoformat(t)
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def series(job: Job, names: list[str] | None = None, points: int = 500, learner="all") -> list[dict]:
    """[{name, learner, points: [[step, value, unix_time], ...]}], at most `points` per series."""
    mp, lt = MetricPoint._meta.db_table, Learner._meta.db_table
    # job-level series (val_loss, goodput...) are the coordinator's rows (learner null) only
    where = ["m.job_id = %s", "(m.learner_id IS NULL OR m.name NOT IN ("
             + ", ".join(["%s"] * len(JOB_SERIES)) + "))"]
    params: list = [job.pk, *sorted(JOB_SERIES)]
    if names:
        where.append("m.name IN (" + ", ".join(["%s"] * len(names)) + ")")
        params += list(names)
    if learner == "job":
        where.append("m.learner_id IS NULL")
    elif isinstance(learner, int):
        where.append(f"m.learner_id = (SELECT l.id FROM {lt} l "  # noqa: S608 (model names only)
                     f"WHERE l.job_id = %s AND l.{qn('index')} = %s)")
        params += [job.pk, learner]
    postgres = connection.vendor == "postgresql"
    # EXTRACT gives numeric, which psycopg would load as a Decimal per row: ask for a double
    newest = "CAST(EXTRACT(EPOCH FROM MAX(k.time)) AS DOUBLE PRECISION)" if postgres else "MAX(k.time)"
    least = "LEAST" if postgres else "MIN"  # steps near 2^63 round up to the last bucket in doubles
    sql = f"""
        WITH s AS (
            SELECT m.name AS name, m.learner_id AS lid, m.step AS step, m.value AS value, m.time AS time,
                   CAST(MIN(m.step) OVER w AS DOUBLE PRECISION) AS lo,
                   CAST(MAX(m.step) OVER w AS DOUBLE PRECISION) AS hi, COUNT(*) OVER w AS n,
                   DENSE_RANK() OVER (ORDER BY m.name, m.learner_id) AS sr
            FROM {mp} m
            WHERE {" AND ".join(where)}
            WINDOW w AS (PARTITION BY m.name, m.learner_id)
        ), k AS (
            SELECT s.name, s.lid, s.step, s.value, s.time,
                   CASE WHEN s.n <= %s THEN s.step
                        ELSE {least}(CAST(FLOOR((CAST(s.step AS DOUBLE PRECISION) - s.lo) * %s
                                                  / (s.hi - s.lo + 1)) AS BIGINT), %s) END AS b
            FROM s
            WHERE s.sr <= %s
        )
        SELECT k.name, l.{qn('index')}, AVG(CAST(k.step AS DOUBLE PRECISION)), AVG(k.value), {newest}
        FROM k LEFT JOIN {lt} l ON l.id = k.lid
        GROUP BY k.name, k.lid, l.{qn('index')}, k.b
        ORDER BY k.name, k.lid, k.b
    """  # noqa: S608  (table names from the models; every value is a parameter)
    params += [points, float(points), points - 1, MAX_SERIES]
    with connection.cursor() as cur:
        cur.execute(sql, params)
        rows = cur.fetchall()
    out: list[dict] = []
    key = None
    points: list = []
    for name, index, step, value, t in rows:  # a series is (name, learner index): unique in a job
        if (name, index) != key:
            key = (name, index)
            points = []
            out.append({"name": name, "learner": index, "points": points})
        # a tuple of floats, not a list: the cyclic collector untracks it (issue 19: fewer tracked
        # objects per response, shorter collections); JSON writes it as the same array.
        # PostgreSQL's columns are doubles already (AVG and the casts above).
        points.append((step, value, t) if postgres else (float(step), float(value), _as_unix(t)))
    out.sort(key=lambda s: (s["name"], -1 if s["learner"] is None else s["learner"]))
    return out


def latest_values(job: Job) -> dict[str, float]:
    """The newest value of each metric: the job-level one (val_loss, goodput...), else the mean of
    the learners' newest values (train_loss, tokens_per_s... are reported per learner)."""
    qs = MetricPoint.objects.filter(job=job)
    if connection.vendor == "postgresql":  # one query: DISTINCT ON (name, learner), newest first
        rows = list(qs.order_by("name", "learner_id", "-time", "-id").distinct("name", "learner_id")
                    .values_list("name", "learner_id", "value")[:2000])
    else:
        rows = []
        for name, lid in qs.values_list("name", "learner_id").distinct().order_by("name")[:2000]:
            value = (qs.filter(name=name, learner_id=lid).order_by("-time", "-id")
                     .values_list("value", flat=True).first())
            rows.append((name, lid, value))
    job_level: dict[str, float] = {}
    per_learner: dict[str, list[float]] = {}
    for name, lid, value in rows:
        if value is None or (lid is not None and name in JOB_SERIES):
            continue
        if lid is None:
            job_level[name] = value
        else:
            per_learner.setdefault(name, []).append(value)
    latest = {name: sum(v) / len(v) for name, v in per_learner.items()}
    latest.update(job_level)
    return dict(sorted(latest.items()))
