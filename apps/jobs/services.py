"""What users can do to jobs; the API, the dashboard and the CLI all call these.

The runtime (apps.coordinator) reacts to the status changes made here: it places a
queued job, stops learners of a cancelled or paused one, resumes a paused one.
"""
from __future__ import annotations

import logging
from typing import Any

from django.db import IntegrityError, transaction

from diloco_platform.celery import RECONCILE_JOB, send

from . import state as st
from .access import team_error
from .models import Event, Job
from .spec import validate_spec

logger = logging.getLogger(__name__)


def _kick_coordinator(job_id: int) -> None:
    """Tell the coordinator to look at this job now (its watchdog also picks up queued jobs and
    paused/cancelled learners on its own, so a broker hiccup never fails the user's request)."""
    def kick() -> None:
        try:
            send(RECONCILE_JOB, job_id)  # by name: the coordinator imports jobs, never the reverse
        except Exception:  # broker down: the coordinator's watchdog reconciles within seconds
            logger.warning("could not reach the broker to kick job %s; the watchdog will", job_id,
                           exc_info=True)

    transaction.on_commit(kick)


def submit_job(owner, spec_data: Any, idempotency_key: str | None = None, team: str = "") -> tuple[Job, bool]:
    """Validate and create a job; returns (job, created). A repeated key returns the first job.
    A team must be one the owner belongs to (callers validate it first and say so per field)."""
    if idempotency_key:
        existing = Job.objects.filter(owner=owner, idempotency_key=idempotency_key).first()
        if existing:
            return existing, False
    spec = validate_spec(spec_data)  # with the fleet's checks: islands, syncer capacity
    if error := team_error(owner, team):
        raise PermissionError(error)
    try:
        with transaction.atomic():
            job = Job.objects.create(
                owner=owner, team=team, name=spec.name, spec=spec.model_dump(mode="json"),
                idempotency_key=idempotency_key or None,
            )
            Event.objects.create(job=job, kind=Event.Kind.STATUS, message="submitted",
                                 payload={"to": st.QUEUED})
            _kick_coordinator(job.pk)
    except IntegrityError:  # a concurrent retry with the same key won the race
        return Job.objects.get(owner=owner, idempotency_key=idempotency_key), False
    return job, True


def act(job: Job, action: str, reason: str) -> Job:
    """Carry out a user's action ("cancel", "pause", "resume") under st.USER_ACTIONS, or raise
    IllegalAction. The status is read under the row lock that Job.transition takes again, so a
    stale `job` (a page rendered a while ago) cannot resume a job the runtime moved on since."""
    with transaction.atomic():
        current = Job.objects.select_for_update().values_list("status", flat=True).get(pk=job.pk)
        target = st.check_action(action, current)
        job.transition(target, reason)
        _kick_coordinator(job.pk)
    return job


def cancel_job(job: Job, reason: str = "cancelled by user") -> Job:
    return act(job, "cancel", reason)


def pause_job(job: Job, reason: str = "paused by user") -> Job:
    return act(job, "pause", reason)


def resume_job(job: Job, reason: str = "resumed by user") -> Job:
    return act(job, "resume", reason)
