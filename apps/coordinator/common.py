"""Shared helpers of the coordinator: blob store, settings, engine objects, events."""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

from django.conf import settings
from django.utils import timezone

log = logging.getLogger("apps.coordinator")

_local = threading.local()


def store():
    """The blob store of settings.BLOB_STORE_URL (one per thread: clients are not all thread-safe)."""
    url = settings.BLOB_STORE_URL
    cached = getattr(_local, "store", None)
    if cached is None or cached[0] != url:
        from trainer.transport import open_store

        _local.store = (url, open_store(url))
    return _local.store[1]


def hb_interval() -> float:
    return float(settings.HEARTBEAT_INTERVAL_S)


def hb_timeout() -> float:
    return float(settings.HEARTBEAT_TIMEOUT_S)


def syncer_timeout() -> float:
    return float(getattr(settings, "SYNCER_TIMEOUT_S", 0) or max(2.0, 2 * hb_timeout()))


def start_timeout() -> float:
    """How long a dispatched learner may take to show up before it is dispatched again."""
    return float(getattr(settings, "LEARNER_START_TIMEOUT_S", 0) or max(20.0, 10 * hb_timeout()))


def start_attempts() -> int:
    """Failed starts in a row after which a learner's job fails instead of trying again."""
    return max(1, int(getattr(settings, "LEARNER_START_ATTEMPTS", 5)))


def start_backoff(failures: int) -> float:
    """Seconds before the next start of a learner that failed `failures` times in a row."""
    return min(60.0, 2.0 ** failures)


def node_timeout() -> float:
    return max(15.0, 5 * hb_timeout())


def job_spec(job):
    """The job's spec, validated again with the platform's rules (model allow-list, data roots)
    every time it is used, so a spec stored before a rule tightened cannot run code or read files."""
    from apps.jobs.spec import validate_spec

    return validate_spec(job.spec, fleet=False)


def train_config(job):
    from trainer.config import TrainConfig

    return TrainConfig.from_spec(job_spec(job), cache_dir=default_cache_dir())


def default_cache_dir() -> str:
    """The engine's token cache (shared by every process on the host; built once per corpus)."""
    return os.environ.get("DILOCO_CACHE_DIR") or str(settings.BASE_DIR / "var" / "cache")


_CORPORA: OrderedDict[tuple[str, str | None], object] = OrderedDict()  # the 4 latest, by use
_CORPORA_LOCK = threading.Lock()


def corpus(source: str, cache_dir: str | None, job_id: int | None = None):
    """The job's corpus; every file read must lie inside settings.DATA_ROOTS (symlinks resolved).
    Its file selection is bounded (trainer.data.resolve_files) and, given the job, ends as soon as
    the job is cancelled or paused: a worker slot or syncer thread is never held for a job that
    is gone. A failed load is not kept (the next try walks again, within the same bounds)."""
    from trainer.data import Corpus

    key = (source, cache_dir)
    with _CORPORA_LOCK:
        if key in _CORPORA:
            _CORPORA.move_to_end(key)
            return _CORPORA[key]
    data = Corpus.load(source, cache_dir=cache_dir, roots=settings.DATA_ROOTS,
                       should_stop=None if job_id is None else job_stopped(job_id))
    with _CORPORA_LOCK:
        _CORPORA[key] = data
        while len(_CORPORA) > 4:
            _CORPORA.popitem(last=False)
    return data


def job_stopped(job_id: int):
    """A check that the job no longer wants its processes (cancelled, failed, pausing ...)."""
    from apps.jobs import state as st
    from apps.jobs.models import Job

    def stopped() -> bool:
        status = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
        return status is None or status not in (st.PLACING, st.RUNNING)

    return stopped


def event(job, kind: str, message: str, payload: dict | None = None, pool=None):
    from apps.jobs.models import Event

    ev = Event.objects.create(job=job, kind=kind, message=message[:300], payload=payload or {}, pool=pool)
    publish(job.pk if job is not None else None,
            {"type": "event", "kind": kind, "message": ev.message, "payload": ev.payload,
             "time": ev.time.timestamp()})
    return ev


def publish(job_id, msg: dict) -> None:
    """Best effort, never blocking: live updates for dashboards. With Redis the channel layer
    spans processes; in the embedded default (in-memory layer) they go to the web server over
    the agent websocket as a coordinator `publish` message (forwarded, not stored)."""
    if job_id is None:
        return
    try:
        if settings.REDIS_URL:
            from apps.telemetry.publish import publish_job

            publish_job(job_id, msg)
        else:
            client = coordinator_client()
            if client is not None:
                client.send({"type": "publish", "job": int(job_id), "message": msg})
    except Exception:
        log.debug("publish failed", exc_info=True)


_coord_client: list = []


def coordinator_client():
    """One websocket client per coordinator process, authenticated with the coordinator token."""
    if not _coord_client:
        try:
            from apps.telemetry.auth import coordinator_token
            from apps.telemetry.client import TelemetryClient

            url = settings.WEB_URL.replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
            _coord_client.append(TelemetryClient(url + "/ws/agent/", coordinator_token(), name="coordinator"))
        except Exception:
            log.warning("coordinator telemetry client unavailable", exc_info=True)
            _coord_client.append(None)
    return _coord_client[0]


def now():
    return timezone.now()
