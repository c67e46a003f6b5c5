"""The demo's "kill a worker" button: a staff member asks, `manage.py demo` does it.

The web process cannot (and must not) kill processes; it writes a request file under
VAR_DIR, and the demo's supervisor, which started the pool workers, picks it up, SIGKILLs
the worker of the named pool and starts it again later. The button exists only when
DILOCO_DEMO_CHAOS=1, which only `manage.py demo` sets: never in production by default.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from django.conf import settings

ENV = "DILOCO_DEMO_CHAOS"
REQUEST_FILE = "demo-chaos-request.json"


def demo_chaos_enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def request_path() -> Path:
    return Path(settings.VAR_DIR) / REQUEST_FILE


def kill_candidates(job_id: int) -> list[str]:
    """Pools running (else starting) a learner of the job, best victim first: a pool with few
    slots (one learner lost, free slots elsewhere for it to move to), then the fastest."""
    from apps.jobs.models import Learner

    learners = (Learner.objects.filter(job_id=job_id, pool__isnull=False,
                                       state__in=(Learner.State.RUNNING, Learner.State.STARTING))
                .select_related("pool").order_by("pool__device_count", "-pool__speed_factor", "index"))
    running = [lr.pool.slug for lr in learners if lr.state == Learner.State.RUNNING]
    return list(dict.fromkeys(running or [lr.pool.slug for lr in learners]))


def request_kill(pools: list[str], job_id: int, user: str) -> Path:
    """Ask the demo supervisor to kill the worker of the first of `pools` it runs."""
    path = request_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pools": pools, "job": job_id, "user": user, "time": time.time()}))
    tmp.replace(path)  # atomic: the supervisor never reads half a request
    return path


def take_request() -> dict | None:
    """The pending request, removed as it is read (None when there is none or it is unreadable)."""
    path = request_path()
    try:
        raw = path.read_text()
        path.unlink()
    except OSError:
        return None
    try:
        req = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(req, dict) or not isinstance(req.get("pools"), list):
        return None
    return req
