"""The coordinator's capacity as a resource: syncer slots.

Every syncer shard of a running job is a long-running Celery task. They run on their own queue
(`syncer`), served by syncer workers with settings.SYNCER_SLOTS threads
(diloco_platform.processes.syncer), so the `coordinator` queue keeps its threads for short
housekeeping (placement, dispatch, watchdog, rebalance) whatever the jobs ask for.

Placement counts those slots: a job holds one per syncer shard not yet finished from the moment
it leaves the queue (placing) until it pauses or ends (running, pausing). A job whose shards do
not fit beside the others' waits queued with the reason (control.start_job), and one that could
never fit (syncer_shards > SYNCER_SLOTS) is refused at submission (apps.jobs.services) or, if
the operator lowered the limit since, fails with the reason.

No lock is needed for the count: a job is counted by its status, and it moves to placing (a
committed row) before it counts the others, so of two jobs admitted at the same time the later
count always sees the earlier one (both may step back and retry; neither overcommits).
"""
from __future__ import annotations

from django.conf import settings
from django.db.models import Count

from apps.jobs import state as st
from apps.jobs.models import Job

from .models import SyncerLease

HOLDING = (st.PLACING, st.RUNNING, st.PAUSING)  # statuses whose job holds its syncer slots
WAITING = "waiting for syncer capacity"


def syncer_slots() -> int:
    """Syncer shards the coordinator runs at once (settings.SYNCER_SLOTS, at least 1)."""
    return max(1, int(getattr(settings, "SYNCER_SLOTS", 8) or 1))


def _shards(value) -> int:
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return 1  # a spec stored before syncer_shards existed: one syncer


def spec_problem(syncer_shards: int) -> str | None:
    """Why a job with `syncer_shards` can never run here (None: it can): the submission's check
    (a 400 naming syncer_shards), asked again at placement in case SYNCER_SLOTS was lowered."""
    from apps.jobs.spec import syncer_shards_problem

    return syncer_shards_problem(syncer_shards)


def needed(job: Job) -> int:
    """Slots `job` holds while it runs: its syncer shards that have not finished."""
    shards = _shards((job.spec or {}).get("syncer_shards") if isinstance(job.spec, dict) else None)
    done = SyncerLease.objects.filter(job=job, finished=True).count()
    return max(0, shards - done)


def in_use(exclude: int | None = None) -> int:
    """Slots held by the jobs that are placing, running or pausing (but `exclude`)."""
    jobs = Job.objects.filter(status__in=HOLDING)
    if exclude is not None:
        jobs = jobs.exclude(pk=exclude)
    rows = list(jobs.order_by().values_list("pk", "spec__syncer_shards"))
    if not rows:
        return 0
    done = dict(SyncerLease.objects.filter(job_id__in=[pk for pk, _ in rows], finished=True)
                .order_by().values_list("job_id").annotate(n=Count("id")))
    return sum(max(0, _shards(shards) - done.get(pk, 0)) for pk, shards in rows)


def wait_reason(job: Job) -> str | None:
    """Why `job` (placing, so already counted by the others) must wait for syncer slots, or None."""
    need = needed(job)
    if need == 0:
        return None
    used, slots = in_use(exclude=job.pk), syncer_slots()
    if used + need <= slots:
        return None
    return (f"{WAITING}: needs {need} syncer slot{'s' if need != 1 else ''}, "
            f"{used} of {slots} in use by other jobs (SYNCER_SLOTS)")


def usage() -> dict:
    """{"slots": SYNCER_SLOTS, "in_use": held by running jobs} (for health and the docs' checks)."""
    return {"slots": syncer_slots(), "in_use": in_use()}
