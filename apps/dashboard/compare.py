"""Several jobs side by side: loss curves on one token axis and one elapsed-time axis, and the
gap of each to a pinned baseline at equal tokens.

One module for the dashboard page, the API (`/api/v1/compare/`) and through it the CLI, so
all three show the same numbers. Jobs are read through `apps.jobs.access`: an id the user may
not see is reported exactly like one that does not exist.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

from django.utils import timezone

from apps.jobs import access
from apps.jobs.models import Job

from . import data

MAX_JOBS = 8
BUCKETS = 200
METRICS = ("val_loss", "train_loss")


class CompareError(ValueError):
    """Bad input: `field` is the query parameter at fault, `reason` says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def parse_ids(values: Iterable[str]) -> list[int]:
    """`["1,2", "3"]` -> [1, 2, 3] (order kept, repeats dropped); at least 1, at most MAX_JOBS."""
    ids: list[int] = []
    for raw in values:
        for part in str(raw).split(","):
            part = part.strip().lstrip("#")
            if not part:
                continue
            if not (part.isascii() and part.isdigit()) or len(part) > 18:
                raise CompareError("jobs", f"{part[:20]!r} is not a job id (comma-separated integers)")
            if int(part) not in ids:
                ids.append(int(part))
    if not ids:
        raise CompareError("jobs", "give one or more job ids, e.g. jobs=1,2,3")
    if len(ids) > MAX_JOBS:
        raise CompareError("jobs", f"at most {MAX_JOBS} jobs at once ({len(ids)} given)")
    return ids


def parse_baseline(raw: str | None, ids: list[int]) -> int:
    """The pinned job: one of `ids` (default the first)."""
    if raw is None or str(raw).strip() == "":
        return ids[0]
    raw = str(raw).strip().lstrip("#")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise CompareError("baseline", f"{raw[:20]!r} is not a job id")
    if int(raw) not in ids:
        raise CompareError("baseline", f"job {raw} is not one of the compared jobs {ids}")
    return int(raw)


def parse_metric(raw: str | None) -> str | None:
    if raw is None or raw == "":
        return None
    if raw not in METRICS:
        raise CompareError("metric", f"{raw[:40]!r} is not one of {', '.join(METRICS)}")
    return raw


def loss_at(tokens: list[float], loss: list[float], at: float) -> float | None:
    """Linear interpolation of a curve sorted by tokens; None outside its range."""
    if not tokens or at < tokens[0] or at > tokens[-1]:
        return None
    i = bisect.bisect_left(tokens, at)
    if tokens[i] == at or i == 0:
        return loss[i]
    x0, x1, y0, y1 = tokens[i - 1], tokens[i], loss[i - 1], loss[i]
    return y0 + (y1 - y0) * (at - x0) / (x1 - x0) if x1 > x0 else y1


def _curve(points: list[tuple[int, float, float]], start: float | None) -> dict:
    pts = sorted(points, key=lambda p: (p[0], p[1]))
    t0 = start if start is not None else (min(p[1] for p in pts) if pts else 0.0)
    return {"tokens": [int(p[0]) for p in pts], "elapsed_s": [round(max(0.0, p[1] - t0), 3) for p in pts],
            "loss": [float(p[2]) for p in pts]}


def compare(user, ids: list[int], baseline: int | None = None, metric: str | None = None) -> dict:
    """Curves and the gap table of the jobs in `ids` that `user` may see.

    Raises CompareError when none of them is visible, or when the baseline is not. The loss
    compared is `metric`, else the validation loss when every job has at least two points of
    it, else the training loss. A job's gap is its loss minus the baseline's, over the
    baseline's, both at the tokens the shorter of the two reached (interpolated on the curves).
    """
    baseline = ids[0] if baseline is None else baseline
    visible = access.visible_jobs(user, Job.objects.select_related("owner")).filter(pk__in=ids)
    jobs = {j.pk: j for j in visible}
    missing = [i for i in ids if i not in jobs]
    if not jobs:
        raise CompareError("jobs", f"no job {', '.join(map(str, ids))} exists that you may see")
    if baseline not in jobs:
        raise CompareError("baseline", f"job {baseline} does not exist or you may not see it")
    order = [i for i in ids if i in jobs]
    series = data.downsample(order, METRICS, BUCKETS)
    if metric is None:
        metric = "val_loss" if all(len(series[i].get("val_loss", [])) >= 2 for i in order) else "train_loss"
    now = timezone.now()
    curves = {}
    for i in order:
        started = jobs[i].started_at.timestamp() if jobs[i].started_at else None
        curves[i] = _curve(series[i].get(metric, []), started)
    base = curves[baseline]
    rows = []
    for i in order:
        job, c = jobs[i], curves[i]
        end = job.finished_at or now
        wall = (end - job.started_at).total_seconds() if job.started_at else None
        tokens = max(job.tokens_computed, c["tokens"][-1] if c["tokens"] else 0)
        common = min(c["tokens"][-1], base["tokens"][-1]) if c["tokens"] and base["tokens"] else None
        mine = loss_at(c["tokens"], c["loss"], common) if common is not None else None
        theirs = loss_at(base["tokens"], base["loss"], common) if common is not None else None
        gap = 100.0 * (mine - theirs) / theirs if mine is not None and theirs else None
        rows.append({
            "id": i, "name": job.name, "status": job.status, "owner": job.owner.username,
            "strategy": (job.spec or {}).get("strategy", ""), "baseline": i == baseline,
            "final_loss": c["loss"][-1] if c["loss"] else None, "tokens": int(tokens),
            "wall_time_s": round(wall, 1) if wall is not None else None,
            "common_tokens": common, "loss_at_common_tokens": mine, "baseline_loss_at_common_tokens": theirs,
            "gap_pct": 0.0 if i == baseline and gap is not None else gap,
            "series": c,
        })
    return {"metric": metric, "baseline": baseline, "missing": missing, "jobs": rows}
