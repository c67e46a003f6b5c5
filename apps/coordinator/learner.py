"""The learner task body: an engine Learner on this worker slot, wired to the DB, store and websocket.

Liveness goes straight to the database (Learner.last_heartbeat, one UPDATE per heartbeat,
fenced on the incarnation), so the watchdog never depends on the web server. Rich
telemetry (loss, tokens/s) goes over the websocket through apps.telemetry.client, which never
blocks training.
"""
from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import torch
from django.db import DatabaseError, close_old_connections
from django.db.models import F

from apps.inventory.models import Node
from apps.jobs import state as st
from apps.jobs.models import Event, Incident, Learner
from trainer.runtime.learner_loop import Control, Fenced, LearnerLoop

from .common import corpus, hb_interval, job_spec, log, now, publish, store, train_config
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

    def __init__(self, learner: Learner, incarnation: int, worker: str, followers=None):
        self.learner_id = learner.pk
        self.island = None
        if followers is not None:  # rank 0 of an island reports every rank's device figures
            from trainer.island import RankStats

            self.island = RankStats(followers.pids, torch.device(followers.spec.device))
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
                points = [] if stats.get("loss") is None else [
                    {"learner": self.index, "name": "train_loss", "step": stats["tokens"],
                     "value": stats["loss"], "time": t.timestamp()}]
                if self.island is not None:
                    points += [{"learner": self.index, "name": name, "step": stats["tokens"], "value": value,
                                "time": t.timestamp()} for name, value in self.island.read().items()]
                if points:
                    self.client.send({"type": "metrics", "job": self.job_id, "points": points})
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


def _shards(spec, index: int) -> int:
    """Data shards of the job: every learner the job may ever have reads its own slice."""
    return max(spec.max_learners or 0, spec.learners, index + 1)


def _island_spec(job, spec, config, index: int, incarnation: int):
    """What the followers of an island learner need (trainer.runtime.island_rank)."""
    from django.conf import settings

    from trainer.island import island_device
    from trainer.runtime.island_rank import IslandSpec

    return IslandSpec(
        config=config.to_dict(), islands=[(index, list(range(spec.devices_per_learner)))],
        num_learners=_shards(spec, index), job=str(job.pk), incarnation=incarnation,
        roots=[str(r) for r in settings.DATA_ROOTS], parallelism=spec.inner_parallelism,
        timeout_s=float(settings.ISLAND_TIMEOUT_S), device=island_device(config.device, 0),
        nodes=spec.nodes_per_learner)


def _announcer(learner: Learner, incarnation: int, worker: str, ispec):
    """For an island over several nodes: the callback that, once rank 0's store listens on `port`,
    sends each other node of the island (reserved at dispatch) the task that starts its ranks,
    with the rendezvous at this node's registered address. None for an island on one node."""
    if ispec.nodes <= 1:
        return None
    from diloco_platform.celery import RUN_ISLAND_RANKS, node_queue, send

    nodes = list(LearnerRuntime.objects.filter(learner=learner).values_list("island_nodes", flat=True).first()
                 or [])
    if len(nodes) != ispec.nodes or nodes[0] != worker:
        raise RuntimeError(f"island nodes {nodes} reserved for this learner do not start with this node "
                           f"{worker}")
    address = Node.objects.filter(worker_name=worker).values_list("address", flat=True).first()
    if not address:
        raise RuntimeError(f"node {worker} registered no address (DILOCO_NODE_ADDRESS): its island's other "
                           "nodes cannot reach its rendezvous")
    slug = learner.pool.slug

    def announce(port: int) -> None:
        for j, node in enumerate(nodes[1:], start=1):
            send(RUN_ISLAND_RANKS, learner.job_id, learner.index, incarnation, j, address, port,
                 ispec.payload(), queue=node_queue(slug, node))
        log.info("learner %s.%s: island rendezvous at %s:%s, ranks started on %s", learner.index, incarnation,
                 address, port, ", ".join(nodes[1:]))

    return announce


def _engine(job, spec, config, data, index: int, incarnation: int, announcer=None):
    """The engine learner of this task: plain, or rank 0 of an island (then with its followers)."""
    from trainer.learner import Learner as EngineLearner

    kwargs = {"incarnation": incarnation, "corpus": data, "job": str(job.pk),
              "num_learners": _shards(spec, index)}
    if spec.devices_per_learner <= 1:
        return EngineLearner(config, index, **kwargs), None
    from trainer.island import island_device, teardown
    from trainer.island_kind import make_island
    from trainer.runtime.island_rank import start

    ispec = _island_spec(job, spec, config, index, incarnation)
    with _starting(job.pk, index, incarnation):
        # rendezvous here; `announce` starts other nodes' ranks; returns once every rank has joined
        followers = start(ispec, announcer(ispec) if announcer else None)
        try:
            engine = make_island(config.replace(device=island_device(config.device, 0)), index,
                                 ranks=list(range(ispec.world)), parallelism=spec.inner_parallelism,
                                 timeout_s=ispec.timeout_s, **kwargs)
        except Exception:
            teardown()
            followers.kill()
            raise
    return engine, followers


@contextlib.contextmanager
def _starting(job_id: int, index: int, incarnation: int):
    """While an island starts (W-1 Python processes importing torch: seconds each, longer on a busy
    host) its task is alive: keep moving its start deadline (the watchdog's start timeout counts
    from `dispatched_at`). The rendezvous's own timeout bounds a start that hangs."""
    import threading

    stop = threading.Event()

    def beat() -> None:
        from django.db import connection

        try:
            while not stop.wait(hb_interval()):
                LearnerRuntime.objects.filter(
                    learner__job_id=job_id, learner__index=index, learner__incarnation=incarnation,
                    learner__state=Learner.State.STARTING).update(dispatched_at=now())
        except DatabaseError:
            log.debug("start keep-alive failed", exc_info=True)
        finally:
            connection.close()

    thread = threading.Thread(target=beat, name=f"island-start-{index}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _start(job, learner: Learner, index: int, incarnation: int, worker: str):
    """Everything a learner does before its first step: config, data, model (and island), resume
    point. Returns (loop, followers of its island or None)."""
    from trainer.island import teardown

    spec = job_spec(job)
    config = train_config(job)
    data = corpus(config.dataset, config.cache_dir, job.pk)
    engine, followers = _engine(job, spec, config, data, index, incarnation,
                                announcer=lambda ispec: _announcer(learner, incarnation, worker, ispec))
    try:
        if learner.work_size:
            engine.set_work_size(learner.work_size)
        host = DjangoHost(learner, incarnation, worker, followers=followers)
        loop = LearnerLoop(
            engine, store(), job=job.pk, index=index, incarnation=incarnation, host=host,
            compression=learner.wire_dtype or config.compression, heartbeat_interval=hb_interval(),
            # a checkpoint follows a contribution batch at most every 2 heartbeats: each one copies
            # and writes ~5x the model (weights, AdamW moments, bases); a successor resuming from an
            # older one recomputes a little, and the ledger refuses any overlap with what was applied
            poll_interval=min(0.25, hb_interval()), checkpoint_interval=max(1.0, 2 * hb_interval()),
            speed_factor=learner.pool.speed_factor if learner.pool else 1.0,
            syncer_shards=spec.syncer_shards,
        )
        loop.resume()
    except BaseException:
        if followers is not None:
            teardown()
            followers.kill()
        raise
    return loop, followers


def _current(job_id: int, index: int, incarnation: int) -> Learner | str:
    """The learner row this task runs, or why it does not run (fenced, job not running)."""
    learner = Learner.objects.select_related("job", "pool").filter(job_id=job_id, index=index).first()
    if learner is None or learner.incarnation != incarnation:
        return "fenced: not the current incarnation"
    job = learner.job
    if job.status != st.RUNNING or learner.state not in (Learner.State.STARTING, Learner.State.PENDING):
        if job.status != st.RUNNING:  # paused or ended before this slot picked the task up
            Learner.objects.filter(pk=learner.pk, incarnation=incarnation,
                                   state=Learner.State.STARTING).update(state=Learner.State.STOPPED)
        return f"not started: job {job.status}, learner {learner.state}"
    return learner


def _register(learner: Learner, incarnation: int, worker: str) -> None:
    """This worker's node and process run the learner now."""
    node = None
    if learner.pool_id:
        node, _ = Node.objects.update_or_create(
            worker_name=worker,
            defaults={"pool": learner.pool, "hostname": socket.gethostname(), "pid": os.getppid(),
                      "last_seen": now(), "state": Node.State.ONLINE})
    Learner.objects.filter(pk=learner.pk, incarnation=incarnation).update(node=node, started_at=now())
    LearnerRuntime.objects.update_or_create(learner=learner, defaults={"worker": worker, "pid": os.getpid()})


def _start_failed(learner: Learner, incarnation: int, exc: Exception) -> str:
    """Its spec, model or data: counted, backed off, capped (control)."""
    log.warning("learner %s.%s of job %s failed to start", learner.index, incarnation, learner.job_id,
                exc_info=True)
    n = Learner.objects.filter(pk=learner.pk, incarnation=incarnation,
                               state__in=(Learner.State.STARTING, Learner.State.RUNNING)) \
        .update(state=Learner.State.PENDING)
    if n:
        record_start_failure(learner, f"{type(exc).__name__}: {exc}")
    return "failed to start"


def _run(loop: LearnerLoop, followers):
    """Train to the end and tell an island's followers to stop (they exit on their own: `_release`
    waits for them after the learner's end state is written, which must follow its last heartbeat
    at once); when a rank failed, a collective raises here, the group is torn down and the
    followers killed: the whole learner fails (see _island_lost)."""
    from trainer.island import teardown

    if followers is None:
        return loop.run()
    try:
        result = loop.run()
        loop.learner.stop_followers()
    except BaseException:
        teardown()
        followers.kill()
        raise
    return result


def _release(followers) -> None:
    """Leave the island's process group and reap its followers (killed if they linger)."""
    if followers is None:
        return
    from trainer.island import teardown

    teardown()
    followers.close()


def _island_lost(learner: Learner, incarnation: int, loop: LearnerLoop, followers, exc: Exception) -> str:
    """A rank of this learner's island failed: the learner fails whole. Its queued contributions
    and checkpoint are written first (the successor resumes after them), then it goes back to
    pending with an incident, and the coordinator places it again (a new incarnation, all ranks)."""
    from diloco_platform.celery import RECONCILE_JOB, send

    from .common import event

    failed_at = now()
    loop.writer.close(timeout=60)
    close_old_connections()
    t = now()
    dead = followers.failed()
    reason = f"island rank failed ({type(exc).__name__}: {str(exc)[:120]})"
    n = Learner.objects.filter(pk=learner.pk, incarnation=incarnation,
                               state__in=(Learner.State.STARTING, Learner.State.RUNNING)) \
        .update(state=Learner.State.PENDING)
    if not n:
        return "fenced: superseded while its island failed"
    silent = _silent_nodes(learner, failed_at)
    Incident.objects.create(
        job=learner.job, learner=learner, pool=learner.pool, kind="island_rank_lost",
        failed_at=t, detected_at=t,
        description=f"learner {learner.index}.{incarnation} on {learner.pool}: {reason}"[:300],
        details={"incarnation": incarnation, "follower_pids": followers.pids, "failed_pids": dead,
                 "devices": followers.spec.world, "nodes": _island_nodes(learner), "silent_nodes": silent})
    event(learner.job, Event.Kind.FAILED, f"learner {learner.index}.{incarnation}: {reason}",
          {"learner": learner.index, "incarnation": incarnation, "failed_pids": dead}, pool=learner.pool)
    send(RECONCILE_JOB, learner.job_id)
    return "island failed"


def _silent_nodes(learner: Learner, failed_at) -> list[str]:
    """The island's other nodes that stopped heartbeating when it failed (a killed worker, a site cut
    off) are declared lost, so it is not placed on them again: each gets a heartbeat timeout to show
    a newer heartbeat than the failure. A node that still reaches the database stays (a partition
    between the nodes only: the next rendezvous or collective times out again)."""
    import time

    from .common import hb_timeout
    from .dispatch import mark_node_lost

    others = _island_nodes(learner)[1:]
    if not others:
        return []
    until = failed_at + timedelta(seconds=hb_timeout())
    LearnerRuntime.objects.filter(learner=learner).update(retry_after=until)  # no re-placement meanwhile
    time.sleep(max(0.0, (until - now()).total_seconds()))
    silent = list(Node.objects.filter(worker_name__in=others, last_seen__lte=failed_at)
                  .values_list("pk", "worker_name"))
    why = f"no heartbeat since the island of learner {learner.index} of job {learner.job_id} failed"
    for pk, _name in silent:
        mark_node_lost(pk, why)
    return [name for _, name in silent]


def _island_nodes(learner: Learner) -> list[str]:
    return list(LearnerRuntime.objects.filter(learner=learner).values_list("island_nodes", flat=True).first()
                or [])


def run_learner_body(job_id: int, index: int, incarnation: int, hostname: str | None = None) -> str:
    torch.set_num_threads(1)
    close_old_connections()
    learner = _current(job_id, index, incarnation)
    if isinstance(learner, str):
        return learner
    worker = hostname or socket.gethostname()
    _register(learner, incarnation, worker)
    try:
        loop, followers = _start(learner.job, learner, index, incarnation, worker)
    except Fenced as exc:
        return f"fenced: {exc}"
    except DatabaseError:
        raise
    except Exception as exc:
        return _start_failed(learner, incarnation, exc)
    LearnerRuntime.objects.filter(learner_id=learner.pk).update(start_failures=0, retry_after=None)
    try:
        result = _run(loop, followers)
    except Fenced as exc:
        return f"fenced: {exc}"
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError among them)
        if followers is None:
            raise
        log.warning("learner %s.%s of job %s: island failed", index, incarnation, job_id, exc_info=True)
        return _island_lost(learner, incarnation, loop, followers, exc)
    try:
        close_old_connections()
        _finish(learner, incarnation, loop, result)
    finally:
        _release(followers)
    return result.outcome


def _finish(learner: Learner, incarnation: int, loop: LearnerLoop, result) -> None:
    """The learner's end state, its last tokens, and the event with its figures."""
    final = {"tokens": result.tokens, "inner_steps": int(getattr(loop.learner, "inner_steps", 0)),
             "last_heartbeat": now()}
    state = {"done": Learner.State.DONE, "stopped": Learner.State.STOPPED,
             "handoff": Learner.State.PENDING}.get(result.outcome)  # handoff: the reconciler moves it
    if state:
        final["state"] = state
    if result.outcome != "fenced":
        n = Learner.objects.filter(pk=learner.pk, incarnation=incarnation) \
            .exclude(state=Learner.State.REMOVED).update(**final)
        if n and result.outcome in ("handoff", "done"):
            from diloco_platform.celery import RECONCILE_JOB, send

            send(RECONCILE_JOB, learner.job_id)
    host = loop.host
    delta = result.tokens - (host.last_tokens or 0)
    if delta > 0:
        LearnerRuntime.objects.filter(learner_id=learner.pk).update(
            tokens_computed=F("tokens_computed") + delta)
    log.info("learner %s.%s of job %s: %s%s, %d steps in %.1fs", learner.index, incarnation, learner.job_id,
             result.outcome, f" ({result.reason})" if result.reason else "", result.steps, result.seconds)
    if result.outcome != "fenced":
        _end_event(learner, incarnation, loop, result)


def _end_event(learner: Learner, incarnation: int, loop: LearnerLoop, result) -> None:
    from .common import event

    active = result.active_seconds or result.seconds
    tps = (result.tokens - (loop.host.resume_tokens or 0)) / active if active > 0 else None
    index = learner.index
    event(learner.job, Event.Kind.INFO,
          f"learner {index}.{incarnation} {result.outcome} after {result.steps} steps"
          + (f" ({result.reason})" if result.reason else ""),
          {"learner": index, "incarnation": incarnation, "outcome": result.outcome, "steps": result.steps,
           "tokens": result.tokens, "seconds": round(result.seconds, 3),
           "active_seconds": round(result.active_seconds, 3),
           "train_seconds": round(result.train_seconds, 3), "tokens_per_s": tps,
           "contributions": result.contributions, "bytes_sent": result.bytes_sent,
           "bytes_received": result.bytes_received, "updates_received": result.updates_received,
           "blob_write_seconds": round(loop.writer.write_seconds, 3),
           "speed_factor": loop.speed_factor, "pool": learner.pool.slug if learner.pool else None,
           "devices": getattr(loop.learner, "world", 1)})


def stale_before(seconds: float):
    return now() - timedelta(seconds=seconds)
