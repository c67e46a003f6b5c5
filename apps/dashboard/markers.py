"""What happened to a job, as markers on its charts: incidents (from detection to heal),
learner moves and checkpoints. Each marker has a unix time (the charts place it on their
token axis themselves, from the loss curve) and a one-line text for its tooltip.

Three queries whatever the job's age, each capped, so the job page stays fast.
"""
from __future__ import annotations

from django.db.models import Q

from apps.jobs.models import Checkpoint, Event, Incident, Job

LIMIT = 200
# a learner changing pools; the rebalancer's other events (work sizes) carry no "to"
MOVES = Q(kind__in=(Event.Kind.REASSIGNED, Event.Kind.DRAINED)) | Q(kind=Event.Kind.REBALANCED,
                                                                     payload__has_key="to")


def _ts(dt) -> float | None:
    return dt.timestamp() if dt is not None else None


def job_markers(job: Job) -> list[dict]:
    """[{kind: incident|move|checkpoint, time, end (heal time, incidents only), open, text}], oldest first."""
    out: list[dict] = []
    for inc in Incident.objects.filter(job=job).select_related("pool").order_by("-detected_at")[:LIMIT]:
        where = f" on {inc.pool.slug}" if inc.pool else ""
        heal = (f"healed after {inc.time_to_heal_s:.1f} s" if inc.healed_at else "not healed yet")
        out.append({"kind": "incident", "id": f"incident-{inc.pk}", "time": _ts(inc.detected_at),
                    "end": _ts(inc.healed_at), "open": inc.healed_at is None,
                    "text": f"{inc.kind.replace('_', ' ')}{where}: {inc.description} ({heal})"[:300]})
    for ev in Event.objects.filter(MOVES, job=job).order_by("-time")[:LIMIT]:
        out.append({"kind": "move", "id": f"event-{ev.pk}", "time": _ts(ev.time), "end": None, "open": False,
                    "text": ev.message[:300]})
    for ck in Checkpoint.objects.filter(job=job).order_by("-version")[:LIMIT]:
        out.append({"kind": "checkpoint", "id": f"checkpoint-{ck.pk}", "time": _ts(ck.created_at),
                    "end": None, "open": False,
                    "text": f"{ck.get_kind_display().lower()} checkpoint v{ck.version}"})
    out.sort(key=lambda m: m["time"])
    return out
