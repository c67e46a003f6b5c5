"""Read side of the dashboard: who sees what, and metrics downsampled in the database.

Every function here runs a fixed, small number of queries whatever the size of the
tables, so page render time stays flat with many jobs and many metric points.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from apps.inventory.models import Node, Pool, estimated_watts, visible_nodes_q
from apps.jobs import access
from apps.jobs import state as st
from apps.jobs.models import Job, Learner, MetricPoint
from apps.telemetry.protocol import JOB_SERIES

# Series whose per-learner points add up to a job figure (the others are averaged).
SUMMED = frozenset({"tokens_per_s", "bytes_sent"})
CHART_SERIES = ("train_loss", "val_loss", "tokens_per_s", "goodput", "bytes_sent", "outer_step_norm")
RANK_FIGURES = ("cpu", "util")  # per-rank device figures an island's rank 0 reports (trainer.island)


def rank_series(job: Job) -> list[str]:
    """The per-rank series of a job whose learners are islands (rank0_cpu, rank1_util, ...)."""
    try:
        ranks = int((job.spec or {}).get("devices_per_learner") or 1)
    except (TypeError, ValueError):
        return []
    if ranks < 2:
        return []
    return [f"rank{r}_{fig}" for fig in RANK_FIGURES for r in range(ranks)]


def job_chart_series(job: Job) -> tuple[str, ...]:
    """Every series the job page charts: the job's figures, and its islands' ranks if any."""
    return CHART_SERIES + tuple(rank_series(job))


def visible_jobs(user) -> QuerySet[Job]:
    """Staff see every job; everyone else their own and their teams' (apps.jobs.access)."""
    return access.visible_jobs(user)


def _ends_sql(job_ids: list[int], names: list[str], recent: int | None) -> tuple[str, list]:
    """One query of index probes on (job, name, time): per series, the step of its first
    (or `recent`-th newest) and newest point, and the time where the window starts."""
    qn = connection.ops.quote_name
    t, tm = qn(MetricPoint._meta.db_table), qn("time")
    # identifiers only; every value is a %s placeholder
    probe = "(SELECT {col} FROM " + t + " WHERE job_id = %s AND name = %s{only} ORDER BY " + tm  # noqa: S608
    probe += " {order} LIMIT 1{off})"
    parts, params = [], []
    for j in job_ids:
        for n in names:
            # a job-level series is the coordinator's rows only (learner null), see _job_level_sql
            only = " AND learner_id IS NULL" if n in JOB_SERIES else ""
            first = probe.format(col="step", order="ASC", off="", only=only)
            last = probe.format(col="step", order="DESC", off="", only=only)
            if recent:
                win = probe.format(col="step", order="DESC", off=f" OFFSET {int(recent) - 1}", only=only)
                cut = probe.format(col=tm, order="DESC", off=f" OFFSET {int(recent) - 1}", only=only)
                parts.append(f"SELECT %s, %s, {first}, {last}, {win}, {cut}")
                params += [j, n, j, n, j, n, j, n, j, n]
            else:
                parts.append(f"SELECT %s, %s, {first}, {last}, NULL, NULL")
                params += [j, n, j, n, j, n]
    return " UNION ALL ".join(parts), params


def downsample(job_ids: Iterable[int], names: Iterable[str], buckets: int = 200,
               recent: int | None = None) -> dict:
    """{job_id: {name: [(tokens, unix_time, value), ...]}} with at most `buckets` points per series.

    Two queries in all, whatever the number of points:
    1. index probes on (job, name, time) for the ends of each series (no scan), giving each
       job's token range (with `recent`, only the newest `recent` points of each series
       are kept: the overview's sparklines cost the same for a job of any age);
    2. one hash aggregate over (job, name, learner, bucket), where a point's bucket is its
       position in its job's token range.
    Python then folds learners together: within a bucket each learner's points are
    averaged; a SUMMED series adds the learners up (per-learner tokens/s make the job's
    tokens/s), the others take the mean over learners.
    """
    job_ids = [int(j) for j in job_ids]
    names = list(names)
    out: dict[int, dict[str, list[tuple[int, float, float]]]] = {j: {} for j in job_ids}
    if not job_ids or not names:
        return out
    qn = connection.ops.quote_name
    table, tm = qn(MetricPoint._meta.db_table), qn("time")
    ends_sql, ends_params = _ends_sql(job_ids, names, recent)
    ranges: dict[int, list[int]] = {}
    windows: list[tuple[int, str, object]] = []  # (job, name, cutoff time or None)
    with transaction.atomic(savepoint=False), connection.cursor() as cur:
        steer = connection.vendor == "postgresql"
        if steer:
            # Both queries are shaped for the (job, name, time) index and a hash aggregate,
            # but the planner cannot estimate the bucket count, and rows of a job newer
            # than the last ANALYZE look like one row: it would pick the job_id index plus
            # a sort (100k rows, on disk under the default 4 MB). Steer it for these two
            # queries only: SET LOCAL ends with this transaction.
            cur.execute("SET LOCAL enable_sort = off")
            cur.execute("SET LOCAL work_mem = '64MB'")
        cur.execute(ends_sql, ends_params)
        for job_id, name, first, last, win_first, cutoff in cur.fetchall():
            if last is None:
                continue
            lo = win_first if win_first is not None else first
            r = ranges.setdefault(int(job_id), [lo, last])
            r[0], r[1] = min(r[0], lo, last), max(r[1], lo, last)
            windows.append((int(job_id), name, cutoff))
        if not ranges:
            if steer:
                cur.execute("SET LOCAL enable_sort TO DEFAULT")
                cur.execute("SET LOCAL work_mem TO DEFAULT")
            return out
        case_sql, params = [], []
        # In floating point: a step is a bigint, and (step - lo) * (buckets - 1) of a stored
        # step near 2^63 would overflow it (a 500 on every page showing the job). Exact for
        # any step below 2^53 (the bound at intake), so the buckets are the integer ones.
        floor = "FLOOR" if connection.vendor == "postgresql" else "CAST"
        as_int = "" if floor == "FLOOR" else " AS INTEGER"
        for jid, (lo, hi) in ranges.items():
            case_sql.append(f"WHEN %s THEN {floor}((CAST(step AS DOUBLE PRECISION) - %s) * %s / %s{as_int})")
            params += [jid, float(lo), float(buckets - 1), float(max(hi - lo, 1))]
        if recent:
            # one index range per series: only its newest `recent` points are read
            conds = []
            for jid, name, cutoff in windows:
                only = " AND learner_id IS NULL" if name in JOB_SERIES else ""
                if cutoff is None:
                    conds.append(f"(job_id = %s AND name = %s{only})")
                    params += [jid, name]
                else:
                    conds.append(f"(job_id = %s AND name = %s{only} AND {tm} >= %s)")
                    params += [jid, name, cutoff]
            where = "(" + " OR ".join(conds) + ")"
        else:
            where = "job_id IN ({}) AND name IN ({})".format(", ".join(["%s"] * len(ranges)),
                                                            ", ".join(["%s"] * len(names)))
            params += list(ranges) + names
            job_level = sorted(JOB_SERIES & set(names))
            if job_level:  # learners' points under a job-level name are not the job's figure
                marks = ", ".join(["%s"] * len(job_level))
                where += f" AND (learner_id IS NULL OR name NOT IN ({marks}))"
                params += job_level
        epoch = ("EXTRACT(EPOCH FROM MAX({t}))" if connection.vendor == "postgresql"
                 else "CAST(strftime('%%s', MAX({t})) AS REAL)").format(t=tm)
        # Only %s placeholders and quoted identifiers are formatted into the text.
        sql = f"""
            SELECT job_id, name, learner_id, CASE job_id {' '.join(case_sql)} ELSE 0 END AS bucket,
                   MAX(step), {epoch}, AVG(value), COUNT(*)
            FROM {table}
            WHERE {where}
            GROUP BY job_id, name, learner_id, bucket
        """  # noqa: S608
        cur.execute(sql, params)
        rows = cur.fetchall()
        if steer:  # inside an outer transaction, leave the planner as we found it
            cur.execute("SET LOCAL enable_sort TO DEFAULT")
            cur.execute("SET LOCAL work_mem TO DEFAULT")
    return _fold(rows, buckets, names, out)


def _job_x(learners_seen: dict, job_id: int, name: str, groups: dict) -> int:
    """A bucket's x in job tokens (see _fold)."""
    if None in groups or not learners_seen[(job_id, name)]:
        return int(groups[None][2] if None in groups else max(g[2] for g in groups.values()))
    mean_step = sum(g[2] for g in groups.values()) / len(groups)
    return int(mean_step * len(learners_seen[(job_id, name)]))


def _fold(rows, buckets: int, names: list[str], out: dict) -> dict:
    """Per-learner groups -> one point per (job, name, bucket).

    x is in job tokens: a job-level point's step already is; a learner-level point's step
    counts that learner's tokens, so a bucket's x is the mean of its learners' newest steps
    times the number of learners that report the series (equal progress, which dynamic
    local updates aim for). When a job sends no tokens_per_s series, it is derived from the
    learners' own progress (_derive_tokens_per_s).
    """
    # (job, name, bucket) -> {"t": newest time, "l": {learner: [value sum, count, newest step]}}
    acc: dict[tuple, dict] = {}
    learners_seen: dict[tuple, set] = defaultdict(set)
    for job_id, name, learner_id, bucket, x, t, mean, n in rows:
        b = min(max(int(bucket), 0), buckets - 1)  # points outside the probed range go to the ends
        a = acc.setdefault((job_id, name, b), {"t": float(t), "l": {}})
        a["t"] = max(a["t"], float(t))
        g = a["l"].setdefault(learner_id, [0.0, 0, x, float(t)])
        g[0] += mean * n
        g[1] += n
        g[2], g[3] = max(g[2], x), max(g[3], float(t))
        if learner_id is not None:
            learners_seen[(job_id, name)].add(learner_id)

    for (job_id, name, _b), a in sorted(acc.items(), key=lambda kv: kv[0]):
        means = [v / n for v, n, _x, _t in a["l"].values()]
        y = sum(means) if name in SUMMED else sum(means) / len(means)
        x = _job_x(learners_seen, job_id, name, a["l"])
        out[job_id].setdefault(name, []).append((x, a["t"], float(y)))

    if "tokens_per_s" in names and "train_loss" in names:
        for job_id, series in out.items():
            if "tokens_per_s" in series or not learners_seen[(job_id, "train_loss")]:
                continue
            derived = _derive_tokens_per_s(acc, learners_seen, job_id, buckets)
            if derived:
                series["tokens_per_s"] = derived
    return out


def _derive_tokens_per_s(acc: dict, learners_seen: dict, job_id: int, buckets: int) -> list[tuple]:
    """A job's tokens/s from its learners' train_loss points: each learner's tokens gained
    between consecutive buckets over the time between them, added up over learners."""
    last: dict = {}  # learner -> (step, time) at its previous bucket
    derived = []
    for b in range(buckets):
        a = acc.get((job_id, "train_loss", b))
        if not a:
            continue
        rate = 0.0
        for lid, (_v, _n, x, t) in a["l"].items():
            if lid is None:
                continue
            prev = last.get(lid)
            if prev and t > prev[1] and x >= prev[0]:
                rate += (x - prev[0]) / (t - prev[1])
            last[lid] = (x, t)
        if rate > 0:
            derived.append((_job_x(learners_seen, job_id, "train_loss", a["l"]), a["t"], rate))
    return derived


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
        Node.objects.filter(visible_nodes_q(), pool_id__in=ids)  # purged nodes are not shown
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
            "watts": round(estimated_watts(p.accelerator.tdp_watts, p.device_count, busy)),
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


HISTORY_SERIES = ("utilisation", "tokens_per_s", "watts")


def fleet_history(since: datetime, buckets: int = 200, *, pool_id: int | None = None,
                  node_id: int | None = None) -> dict[str, list[tuple[float, float]]]:
    """{series: [(unix_time, mean), ...]}: a pool's samples (node_id None) or a node's since
    `since`, cut in the database into at most `buckets` equal spans of time, each averaged.

    One query on the (pool, time) or (node, time) index, however many samples there are.
    """
    from apps.inventory.models import FleetSample

    out: dict[str, list[tuple[float, float]]] = {name: [] for name in HISTORY_SERIES}
    qn = connection.ops.quote_name
    table, tm = qn(FleetSample._meta.db_table), qn("time")
    epoch = ("EXTRACT(EPOCH FROM {t})" if connection.vendor == "postgresql"
             else "CAST(strftime('%%s', {t}) AS REAL)").format(t=tm)
    start = since.timestamp()
    width = max((timezone.now().timestamp() - start) / max(buckets, 1), 1e-3)
    if node_id is not None:
        where, params = "node_id = %s", [node_id]
    else:
        where, params = "pool_id = %s AND node_id IS NULL", [pool_id]
    floor = "FLOOR" if connection.vendor == "postgresql" else "CAST"  # SQLite: CAST(x AS INTEGER), x >= 0
    bucket = f"{floor}(({epoch} - %s) / %s{' AS INTEGER' if floor == 'CAST' else ''})"
    # Only %s placeholders and quoted identifiers are formatted into the text.
    sql = f"""
        SELECT {bucket} AS bucket, MAX({epoch}),
               AVG(utilisation), AVG(tokens_per_s), AVG(watts)
        FROM {table}
        WHERE {where} AND {tm} >= %s
        GROUP BY bucket ORDER BY bucket
    """  # noqa: S608
    with connection.cursor() as cur:
        cur.execute(sql, [start, width, *params, since])
        for _b, t, util, tps, watts in cur.fetchall():
            for name, v in zip(HISTORY_SERIES, (util, tps, watts), strict=True):
                out[name].append((float(t), float(v)))
    return out
