"""The learner task body: an engine Learner on this worker slot, wired to the DB, store and websocket.

Liveness goes straight to the database (Learner.last_heartbeat, one UPDATE per heartbeat,
fenced on the incarnation), so the watchdog never depends on the web server. Rich
telemetry (loss, tokens/s) goes over the websocket through apps.telemetry.client, which never
blocks training.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
from django.db import DatabaseError, close_old_connections
from django.db.models import F

from apps.inventory.models import Node
from apps.jobs import state as st
from apps.jobs.models import Incident, Learner
from trainer.runtime.learner_loop import Control, Fenced, LearnerLoop

from .common import corpus, hb_interval, log, now, publish, store, train_config
from .control import record_start_failure
from .models import LearnerRuntime

_clients: dict = {}


def telemetry_client():
    """One websocket client per worker process (None when telemetry is not available)."""
    from django.conf import settings

    token = os.environ.get("DILOCO_POOL_TOKEN", "")
    url = settings.WEB_URL
    key = (url, token)
    if not token:
        return None
    if key not in _clients:
        try:
            from apps.telemetry.client import TelemetryClient

            ws = url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/ws/agent/"
            _clients[key] = TelemetryClient(ws, token)
        except Exception:
            log.warning("telemetry client unavailable", exc_info=True)
            _clients[key] = None
    return _clients[key]


class DjangoHost:
    """Liveness + control for LearnerLoop from the database; telemetry over the websocket."""

    def __init__(self, learner: Learner, incarnation: int, worker: str):
        self.learner_id = learner.pk
        self.job_id = learner.job_id
        self.index = learner.index
        self.incarnation = incarnation
        self.worker = worker
        self.work_size = learner.work_size
        self.last_tokens = None
        self.first = True
        self.client = telemetry_client()
        self.resume_tokens = 0
        self._pushed: Control | None = None
        self.beats = 0
        if self.client is not None:
            self.client.on_control(self._on_control)

    def _on_control(self, msg: dict) -> None:
        """Control over the websocket (faster than the next heartbeat's read of the DB, which
        stays the source of truth)."""
        if msg.get("job") != self.job_id or msg.get("learner") != self.index:
            return
        if msg.get("incarnation") not in (None, self.incarnation):
            return  # meant for another incarnation of this learner
        action = msg.get("action")
        ctl = Control(reason=f"control: {action}")
        if action in ("stop", "pause"):
            ctl.stop = True
        elif action == "migrate":
            ctl.handoff = True
        elif action == "resize" and msg.get("work_size"):
            ctl.work_size = int(msg["work_size"])
            self.work_size = ctl.work_size
        else:
            return
        self._pushed = ctl

    def take_control(self) -> Control | None:
        ctl, self._pushed = self._pushed, None
        return ctl

    def resumed(self, point: dict) -> None:
        """Record where this incarnation resumes; the work of the previous one past that point is lost."""
        resume = int(point.get("tokens", 0))
        self.resume_tokens = resume
        LearnerRuntime.objects.filter(learner_id=self.learner_id).update(resume_point=point, updated_at=now())
        last_reported = Learner.objects.filter(pk=self.learner_id) \
            .values_list("tokens", flat=True).first() or 0
        lost = max(0, int(last_reported) - resume)
        if lost:
            inc = Incident.objects.filter(learner_id=self.learner_id, healed_at__isnull=True) \
                .order_by("-detected_at").first()
            if inc is not None:
                Incident.objects.filter(pk=inc.pk).update(tokens_lost=lost)
            LearnerRuntime.objects.filter(learner_id=self.learner_id).update(
                tokens_lost=F("tokens_lost") + lost)
        self.last_tokens = resume

    def heartbeat(self, stats: dict) -> Control:
        t = now()
        fields = {"last_heartbeat": t, "tokens": stats["tokens"], "inner_steps": stats["step"],
                  "staleness": stats.get("staleness") or 0}
        if stats.get("loss") is not None:
            fields["loss"] = stats["loss"]
        if stats.get("tokens_per_s"):
            fields["tokens_per_s"] = stats["tokens_per_s"]
        if self.first:
            fields["state"] = Learner.State.RUNNING
        n = Learner.objects.filter(pk=self.learner_id, incarnation=self.incarnation) \
            .exclude(state__in=(Learner.State.LOST, Learner.State.REMOVED)).update(**fields)
        if n == 0:
            raise Fenced(f"learner {self.index} incarnation {self.incarnation} superseded")
        if self.first:
            self._healed(t)
            self.first = False
        delta = stats["tokens"] - (self.last_tokens or 0)
        self.last_tokens = stats["tokens"]
        if delta > 0:
            LearnerRuntime.objects.filter(learner_id=self.learner_id).update(
                tokens_computed=F("tokens_computed") + delta)
        self.beats += 1
        if self.beats % 10 == 1:
            Node.objects.filter(worker_name=self.worker).update(last_seen=t, state=Node.State.ONLINE)
        row = Learner.objects.filter(pk=self.learner_id).values(
            "state", "work_size", "job__status", "runtime__move_to", "runtime__move_reason").first()
        self._telemetry(stats, t)
        ctl = Control()
        if row is None:
            ctl.stop, ctl.reason = True, "learner removed"
            return ctl
        if row["job__status"] != st.RUNNING:
            ctl.stop, ctl.reason = True, f"job {row['job__status']}"
        elif row["state"] in (Learner.State.STOPPED, Learner.State.REMOVED):
            ctl.stop, ctl.reason = True, f"learner {row['state']}"
        elif row["runtime__move_to"]:
            ctl.handoff, ctl.reason = True, row["runtime__move_reason"] or "move"
        if row["work_size"] and row["work_size"] != self.work_size:
            self.work_size = ctl.work_size = row["work_size"]
        return ctl

    def _healed(self, t) -> None:
        """First sign of life of a new incarnation closes the incidents that caused it."""
        Incident.objects.filter(learner_id=self.learner_id, healed_at__isnull=True).update(healed_at=t)

    def _telemetry(self, stats: dict, t) -> None:
        msg = {"type": "heartbeat", "job": self.job_id, "learner": self.index,
               "incarnation": self.incarnation,
               "step": stats["step"], "tokens": stats["tokens"], "loss": stats.get("loss"),
               "tokens_per_s": stats.get("tokens_per_s"), "util": stats.get("util"),
               "power_w": stats.get("power_w"),
               "staleness": stats.get("staleness") or 0, "time": t.timestamp()}
        if self.client is not None:
            try:
                self.client.send(msg)
                if stats.get("loss") is not None:
                    self.client.send({"type": "metrics", "job": self.job_id, "points": [
                        {"learner": self.index, "name": "train_loss", "step": stats["tokens"],
                         "value": stats["loss"], "time": t.timestamp()}]})
            except Exception:
                log.debug("telemetry send failed", exc_info=True)
        else:
            publish(self.job_id, {"type": "learner", "index": self.index, "incarnation": self.incarnation,
                                  "state": "running", "tokens": stats["tokens"], "loss": stats.get("loss"),
                                  "tokens_per_s": stats.get("tokens_per_s")})

    def close(self) -> None:
        """Called by the heartbeat thread when it ends: its DB connection is its own."""
        from django.db import connection

        connection.close()

    def telemetry(self, msg: dict) -> None:
        if self.client is not None:
            self.client.send(msg)


def _start(job, learner: Learner, index: int, incarnation: int, worker: str) -> LearnerLoop:
    """Everything a learner does before its first step: config, data, model, resume point."""
    from trainer.learner import Learner as EngineLearner

    config = train_config(job)
    data = corpus(config.dataset, config.cache_dir)
    spec = job.spec
    shards = max(int(spec.get("max_learners") or 0), int(spec.get("learners") or 1), index + 1)
    engine = EngineLearner(config, index, incarnation=incarnation, corpus=data, job=str(job.pk),
                           num_learners=shards)
    if learner.work_size:
        engine.set_work_size(learner.work_size)
    host = DjangoHost(learner, incarnation, worker)
    loop = LearnerLoop(
        engine, store(), job=job.pk, index=index, incarnation=incarnation, host=host,
        compression=learner.wire_dtype or config.compression, heartbeat_interval=hb_interval(),
        # a checkpoint follows a contribution batch at most every 2 heartbeats: each one copies
        # and writes ~5x the model (weights, AdamW moments, bases); a successor resuming from an
        # older one recomputes a little, and the ledger refuses any overlap with what was applied
        poll_interval=min(0.25, hb_interval()), checkpoint_interval=max(1.0, 2 * hb_interval()),
        speed_factor=learner.pool.speed_factor if learner.pool else 1.0,
        syncer_shards=int(spec.get("syncer_shards") or 1),
    )
    loop.resume()
    return loop


def run_learner_body(job_id: int, index: int, incarnation: int, hostname: str | None = None) -> str:
    torch.set_num_threads(1)
    close_old_connections()
    learner = Learner.objects.select_related("job", "pool").filter(job_id=job_id, index=index).first()
    if learner is None or learner.incarnation != incarnation:
        return "fenced: not the current incarnation"
    job = learner.job
    if job.status != st.RUNNING or learner.state not in (Learner.State.STARTING, Learner.State.PENDING):
        if job.status != st.RUNNING:  # paused or ended before this slot picked the task up
            Learner.objects.filter(pk=learner.pk, incarnation=incarnation,
                                   state=Learner.State.STARTING).update(state=Learner.State.STOPPED)
        return f"not started: job {job.status}, learner {learner.state}"
    worker = hostname or socket.gethostname()
    node = None
    if learner.pool_id:
        node, _ = Node.objects.update_or_create(
            worker_name=worker,
            defaults={"pool": learner.pool, "hostname": socket.gethostname(), "pid": os.getppid(),
                      "last_seen": now(), "state": Node.State.ONLINE})
    Learner.objects.filter(pk=learner.pk, incarnation=incarnation).update(node=node, started_at=now())
    LearnerRuntime.objects.update_or_create(learner=learner, defaults={"worker": worker, "pid": os.getpid()})

    try:
        loop = _start(job, learner, index, incarnation, worker)
    except Fenced as exc:
        return f"fenced: {exc}"
    except DatabaseError:
        raise
    except Exception as exc:  # its spec, model or data: counted, backed off, capped (control)
        log.warning("learner %s.%s of job %s failed to start", index, incarnation, job_id, exc_info=True)
        n = Learner.objects.filter(pk=learner.pk, incarnation=incarnation,
                                   state__in=(Learner.State.STARTING, Learner.State.RUNNING)) \
            .update(state=Learner.State.PENDING)
        if n:
            record_start_failure(learner, f"{type(exc).__name__}: {exc}")
        return "failed to start"
    LearnerRuntime.objects.filter(learner_id=learner.pk).update(start_failures=0, retry_after=None)
    host, engine = loop.host, loop.learner
    try:
        result = loop.run()
    except Fenced as exc:
        return f"fenced: {exc}"
    close_old_connections()
    final = {"tokens": result.tokens, "inner_steps": int(getattr(engine, "inner_steps", 0)),
             "last_heartbeat": now()}
    if result.outcome == "done":
        final["state"] = Learner.State.DONE
    elif result.outcome == "handoff":
        final["state"] = Learner.State.PENDING  # the reconciler sends it to its new pool
    elif result.outcome == "stopped":
        final["state"] = Learner.State.STOPPED
    if result.outcome != "fenced":
        n = Learner.objects.filter(pk=learner.pk, incarnation=incarnation) \
            .exclude(state=Learner.State.REMOVED).update(**final)
        if n and result.outcome == "handoff" or n and result.outcome == "done":
            from .tasks import reconcile_job

            reconcile_job.delay(job_id)
    delta = result.tokens - (host.last_tokens or 0)
    if delta > 0:
        LearnerRuntime.objects.filter(learner_id=learner.pk).update(
            tokens_computed=F("tokens_computed") + delta)
    log.info("learner %s.%s of job %s: %s%s, %d steps in %.1fs", index, incarnation, job_id, result.outcome,
             f" ({result.reason})" if result.reason else "", result.steps, result.seconds)
    if result.outcome != "fenced":
        from apps.jobs.models import Event

        from .common import event

        active = result.active_seconds or result.seconds
        tps = (result.tokens - (host.resume_tokens or 0)) / active if active > 0 else None
        event(job, Event.Kind.INFO,
              f"learner {index}.{incarnation} {result.outcome} after {result.steps} steps"
              + (f" ({result.reason})" if result.reason else ""),
              {"learner": index, "incarnation": incarnation, "outcome": result.outcome, "steps": result.steps,
               "tokens": result.tokens, "seconds": round(result.seconds, 3),
               "active_seconds": round(result.active_seconds, 3),
               "train_seconds": round(result.train_seconds, 3), "tokens_per_s": tps,
               "contributions": result.contributions, "bytes_sent": result.bytes_sent,
               "bytes_received": result.bytes_received, "updates_received": result.updates_received,
               "blob_write_seconds": round(loop.writer.write_seconds, 3),
               "speed_factor": loop.speed_factor, "pool": learner.pool.slug if learner.pool else None})
    return result.outcome


def stale_before(seconds: float):
    return now() - timedelta(seconds=seconds)
