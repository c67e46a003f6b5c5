"""Reconciliation, watchdog and rebalancer: drive the DB state towards what each job needs.

All of it is idempotent and safe to run concurrently (row locks where it matters); beat
runs the watchdog every second and the rebalancer every few seconds, and apps.jobs.services
kicks reconcile_job on every user action. Recovery never waits for broker redelivery.
"""
from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta

from django.db import DatabaseError, transaction
from django.db.models import F, Q

from apps.inventory.models import Node, Pool
from apps.jobs import state as st
from apps.jobs.models import Event, Incident, Job, Learner
from trainer.spec import stored_spec

from . import capacity
from .common import (
    event,
    hb_timeout,
    job_spec,
    log,
    now,
    start_attempts,
    start_backoff,
    start_timeout,
    syncer_timeout,
)
from .dispatch import (
    BUSY,
    choose_pool,
    dispatch,
    figures,
    free_slots,
    island_placement,
    mark_node_lost,
    model_figures,
    nodes_free,
    place_job,
    pool_infos,
)
from .models import CoordinatorTick, LearnerRuntime, SyncerLease

ACTIVE = (st.RUNNING, st.PAUSING)
MOVE_COOLDOWN_S = 30.0
MOVE_MIN_GAIN = 0.5  # measured tokens/s on shared hosts are noisy: move only for a clear win
MOVE_BACK_S = 600.0  # a learner is not moved back to a pool it left this recently


def reconcile(job_id: int) -> str:
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return "no such job"
    if job.status == st.QUEUED:
        return start_job(job)
    if job.status == st.PLACING:
        return resume_placing(job)
    if job.status == st.RUNNING:
        dispatch_pending(job)
        ensure_syncer(job)
        return "running"
    if job.status == st.PAUSING:
        return settle_pause(job)
    if job.status in st.TERMINAL:
        return settle_terminal(job)
    return job.status


def fail_job(job: Job, reason: str) -> bool:
    """Move `job` to failed with `reason` (shown by the dashboard, the API and the CLI)."""
    try:
        job.transition(st.FAILED, reason[:1000])
    except st.IllegalTransition:
        return False
    event(job, Event.Kind.FAILED, f"job failed: {reason}"[:300], {"reason": reason[:1000]})
    settle_terminal(job)
    return True


def _never_fits(job: Job, spec) -> str | None:
    """Why the job cannot be placed even on an empty fleet of its pools (None: it can, later)."""
    from trainer.placement import PlacementError, place_spec

    everything = dict(Pool.objects.values_list("slug", "device_count"))
    nodes = nodes_free(empty=True) if spec.nodes_per_learner > 1 else None
    infos = [dataclasses.replace(i, state="active") for i in pool_infos(spec, job, everything, nodes)]
    if not infos:
        return None  # no pool yet: the job waits for the operator to add one
    try:
        place_spec(spec, figures(spec), infos)
    except PlacementError as exc:
        return str(exc)
    return None


def start_job(job: Job) -> str:
    """QUEUED -> PLACING -> RUNNING; back to QUEUED while capacity is busy (learner slots or
    syncer slots, apps.coordinator.capacity); FAILED when the job can never run (its spec no
    longer validates, its model cannot be built, it fits on no pool or no coordinator)."""
    from trainer.placement import PlacementError

    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.status != st.QUEUED:
            return f"already {locked.status}"
        before = locked.status_reason
        locked.transition(st.PLACING, "placing learners")
    # counted by the others from here (placing holds syncer slots): see capacity's docstring
    job.refresh_from_db()
    if (waiting := syncer_admission(job, before)) is not None:
        return waiting
    if job.learners.exists():  # a paused job that waited for syncer slots: its learners resume
        return _resume(job)
    try:
        place_job(job)
    except PlacementError as exc:
        job.refresh_from_db()
        never = _never_fits(job, job_spec(job))
        if never:
            fail_job(job, f"cannot be placed on any pool: {never}")
            return "failed"
        job.transition(st.QUEUED, f"waiting for capacity: {exc}")
        event(job, Event.Kind.INFO, f"placement failed: {exc}"[:300], {"reason": str(exc)})
        return "waiting for capacity"
    except Exception as exc:  # the spec, the model factory or the data: the same next time
        if _transient(exc):
            raise
        log.warning("job %s cannot be placed", job.pk, exc_info=True)
        job.refresh_from_db()
        fail_job(job, f"placement failed: {type(exc).__name__}: {exc}")
        return "failed"
    job.refresh_from_db()
    job.transition(st.RUNNING, "learners placed")
    ensure_syncer(job)
    dispatch_pending(job)
    return "started"


def syncer_admission(job: Job, before: str = "") -> str | None:
    """None when `job` (placing) may start its syncer shards now; else it goes back to the queue
    with the reason (or fails, when it can never fit) and the result of start_job is returned.
    `before`: the job's previous reason, so that a long wait makes one event, not one per tick."""
    never = capacity.spec_problem(capacity.needed(job))
    if never:
        fail_job(job, f"cannot start: {never}")
        return "failed"
    wait = capacity.wait_reason(job)
    if wait is None:
        return None
    try:
        job.transition(st.QUEUED, wait)
    except st.IllegalTransition:  # cancelled meanwhile
        return f"already {Job.objects.filter(pk=job.pk).values_list('status', flat=True).first()}"
    if not before.startswith(capacity.WAITING):
        event(job, Event.Kind.INFO, wait, {"reason": wait, "syncer_slots": capacity.syncer_slots()})
    return "waiting for syncer capacity"


def resume_placing(job: Job) -> str:
    """PLACING after a pause: learners that stopped go back to pending, then run (once the job's
    syncer shards fit; until then it waits queued)."""
    if not job.learners.exists():
        with transaction.atomic():
            Job.objects.filter(pk=job.pk, status=st.PLACING).update(status=st.QUEUED)
        job.refresh_from_db()
        return start_job(job)
    if (waiting := syncer_admission(job, job.status_reason)) is not None:
        return waiting
    return _resume(job)


def _resume(job: Job) -> str:
    job.learners.filter(state__in=(Learner.State.STOPPED, Learner.State.LOST)) \
        .update(state=Learner.State.PENDING)
    with contextlib.suppress(st.IllegalTransition):
        job.transition(st.RUNNING, "resumed")
    ensure_syncer(job)
    dispatch_pending(job)
    return "resumed"


def dispatch_pending(job: Job) -> int:
    n = 0
    t = now()
    for learner in job.learners.select_related("pool", "runtime", "job").filter(state=Learner.State.PENDING):
        rt = getattr(learner, "runtime", None)
        if rt is not None and rt.start_failures >= start_attempts():
            fail_job(job, f"learner {learner.index} failed to start {rt.start_failures} times: "
                          f"{rt.last_error}")
            return n
        if rt is not None and rt.retry_after is not None and rt.retry_after > t:
            continue  # backing off after failed starts
        target = rt.move_to if rt is not None and rt.move_to_id else None
        if target is not None and (free_slots(exclude_learner=learner).get(target.slug, 0) <= 0
                                   or island_placement(learner, target) is None):
            target = None
        if target is None:
            off = learner.pool_id and learner.pool.state != Pool.State.ACTIVE
            avoid = {learner.pool.slug} if off else set()
            target = choose_pool(learner, avoid)
        if target is None:
            if shrink(job, learner):
                continue
            log.info("job %s learner %s: no free slot anywhere, waiting", job.pk, learner.index)
            continue
        moved = learner.pool_id and learner.pool_id != target.pk
        before = learner.pool.slug if learner.pool_id else None
        dispatch(learner, target, "(pending)")
        if moved:
            event(job, Event.Kind.REASSIGNED, f"learner {learner.index} {before} → {target.slug}",
                  {"learner": learner.index, "from": before, "to": target.slug,
                   "incarnation": learner.incarnation,
                   "reason": (rt.move_reason if rt is not None and rt.move_reason else "")}, pool=target)
        n += 1
    return n


def ensure_syncer(job: Job) -> None:
    """Start each syncer shard of the job that holds no fresh lease (restart after a death)."""
    spec = stored_spec(job.spec)
    shards = spec.syncer_shards if spec else 1
    for shard in range(shards):  # each holds one of the syncer slots the job was admitted with
        _ensure_syncer_shard(job, shard, shards)


def _ensure_syncer_shard(job: Job, shard: int, shards: int) -> None:
    from diloco_platform.celery import RUN_SYNCER, SYNCER_QUEUE, send

    # lease.worker: "" = no syncer (never started or stopped cleanly), "dispatched" = sent,
    # else the worker running it; last_heartbeat: its pulse (or the dispatch time)
    name = "syncer" if shards == 1 else f"syncer shard {shard}"
    with transaction.atomic():
        lease, _created = SyncerLease.objects.select_for_update().get_or_create(job=job, shard=shard)
        if lease.finished:
            return
        if lease.last_heartbeat and lease.last_heartbeat >= now() - timedelta(seconds=_syncer_grace(lease)):
            return
        lost = lease.last_heartbeat is not None and lease.worker not in ("", "dispatched")
        lease.epoch += 1
        epoch = lease.epoch
        if lost:
            lease.restarts += 1
            Incident.objects.create(job=job, kind="syncer_lost", failed_at=lease.last_heartbeat,
                                    description=f"{name} epoch {epoch - 1} missed its heartbeats",
                                    details={"epoch": epoch - 1, "worker": lease.worker,
                                             "commits": lease.commits, "shard": shard})
        lease.last_heartbeat = now()
        lease.worker = "dispatched"
        lease.started_at = None
        lease.save()
        transaction.on_commit(lambda: send(RUN_SYNCER, job.pk, epoch, shard, queue=SYNCER_QUEUE))
    if lost:
        event(job, Event.Kind.FAILED, f"{name} lost; restarting from commit {lease.commits} (epoch {epoch})",
              {"epoch": epoch, "commits": lease.commits, "shard": shard})


def _syncer_grace(lease: SyncerLease) -> float:
    """Seconds of silence after which a syncer is lost: its heartbeat timeout, or while it starts
    (no commit yet, started within the learners' start timeout) that start timeout. A fresh
    syncer worker building its first job's engine on a busy host went quiet for 3-4 s though its
    pulse thread stamps every 0.5 s, and was restarted for nothing (the browser test's stack)."""
    starting = lease.commits == 0 and lease.started_at is not None \
        and lease.started_at >= now() - timedelta(seconds=start_timeout())
    return max(syncer_timeout(), start_timeout()) if starting else syncer_timeout()


def settle_pause(job: Job) -> str:
    job.learners.filter(state__in=(Learner.State.PENDING,)).update(state=Learner.State.STOPPED)
    if not job.learners.filter(state__in=BUSY).exists():
        with contextlib.suppress(st.IllegalTransition):
            job.transition(st.PAUSED, "all learners stopped")
        return "paused"
    return "pausing"


def settle_terminal(job: Job) -> str:
    job.learners.filter(state=Learner.State.PENDING).update(state=Learner.State.STOPPED)
    return job.status


# ---------------------------------------------------------------------------------- watchdog
def watchdog() -> dict:
    """Missed heartbeats -> lost learner -> incident + new incarnation on a healthy node."""
    t = now()
    out = {"lost": 0, "redispatched": 0, "syncers": 0}
    hb_cut = t - timedelta(seconds=hb_timeout())
    start_cut = t - timedelta(seconds=start_timeout())
    dead = Learner.objects.select_related("job", "pool", "runtime").filter(job__status__in=ACTIVE).filter(
        Q(state=Learner.State.RUNNING, last_heartbeat__lt=hb_cut)
        | Q(state=Learner.State.RUNNING, last_heartbeat__isnull=True, started_at__lt=start_cut)
        | Q(state=Learner.State.STARTING, runtime__dispatched_at__lt=start_cut)
    )
    for learner in dead:
        if guarded(learner.job, lose_learner, learner, t):
            out["lost"] += 1
    for job in Job.objects.filter(status__in=ACTIVE):
        if job.status == st.RUNNING:
            out["drained"] = out.get("drained", 0) + (guarded(job, drain, job) or 0)
            out["redispatched"] += guarded(job, dispatch_pending, job) or 0
            guarded(job, ensure_syncer, job)
        else:
            guarded(job, settle_pause, job)
    # learners of jobs that ended or paused before they started
    Learner.objects.filter(state=Learner.State.PENDING, job__status__in=(*st.TERMINAL, st.PAUSED)) \
        .update(state=Learner.State.STOPPED)
    Learner.objects.filter(state=Learner.State.STARTING,
                           job__status__in=(*st.TERMINAL, st.PAUSING, st.PAUSED),
                           runtime__dispatched_at__lt=start_cut).update(state=Learner.State.STOPPED)
    # jobs whose submit kick was lost
    for job in Job.objects.filter(status=st.QUEUED, updated_at__lt=t - timedelta(seconds=5))[:10]:
        guarded(job, start_job, job)
    for job in Job.objects.filter(status=st.PLACING, updated_at__lt=t - timedelta(seconds=10))[:10]:
        guarded(job, resume_placing, job)
    CoordinatorTick.record("watchdog")
    return out


def _transient(exc: Exception) -> bool:
    """Errors of the services (database, broker, Redis, network), not of the job: retried."""
    from kombu.exceptions import KombuError
    from redis.exceptions import RedisError

    return isinstance(exc, DatabaseError | OSError | KombuError | RedisError)


def guarded(job: Job, fn, *args):
    """Run one job's part of a tick so that its failure never stops the tick for the others.

    An error of the services (the broker down in the chaos drill, a database hiccup) is left
    for the next tick; anything else comes from the job itself (its spec, model or data) and
    would happen again, so the job fails with the reason.
    """
    try:
        return fn(*args)
    except Exception as exc:
        if _transient(exc):
            log.warning("tick: job %s: %s, retried next tick", job.pk, type(exc).__name__, exc_info=True)
            return None
        log.warning("tick: job %s failed in %s", job.pk, getattr(fn, "__name__", fn), exc_info=True)
        try:
            job.refresh_from_db()
            fail_job(job, f"{type(exc).__name__}: {exc}")
        except Exception:
            log.exception("tick: job %s could not be failed", job.pk)
    return None


def record_start_failure(learner: Learner, reason: str) -> bool:
    """Count a failed start of `learner` and back off before the next one.

    Returns True when the count reached the cap; the coordinator's next look at the job
    (dispatch_pending) then fails it, so a pool worker never writes a job's state itself.
    """
    rt, _ = LearnerRuntime.objects.get_or_create(learner=learner)
    LearnerRuntime.objects.filter(pk=rt.pk).update(start_failures=F("start_failures") + 1,
                                                    last_error=reason[:300])
    rt.refresh_from_db()
    wait = start_backoff(rt.start_failures)
    LearnerRuntime.objects.filter(pk=rt.pk).update(retry_after=now() + timedelta(seconds=wait))
    capped = rt.start_failures >= start_attempts()
    event(learner.job, Event.Kind.FAILED,
          f"learner {learner.index} failed to start ({reason})"
          + ("" if capped else f"; retry {rt.start_failures + 1} of {start_attempts()} in {wait:.0f} s"),
          {"learner": learner.index, "reason": reason[:300], "start_failures": rt.start_failures})
    return capped


def push_control(job_id: int, index: int, payload: dict) -> None:
    """Best effort: tell the learner now over its websocket (it also reads the DB each heartbeat)."""
    try:
        from django.conf import settings

        if settings.REDIS_URL:  # the in-memory layer cannot reach the web process
            from apps.telemetry.publish import send_control

            send_control(job_id, index, payload)
    except Exception:
        log.debug("control push failed", exc_info=True)


def drain(job: Job) -> int:
    """Learners on pools (or nodes) that are draining or disabled checkpoint and move off."""
    n = 0
    off = Learner.objects.select_related("pool", "node", "runtime").filter(
        job=job, state=Learner.State.RUNNING).filter(
        ~Q(pool__state=Pool.State.ACTIVE) | Q(node__state=Node.State.DRAINING))
    for lr in off:
        rt = getattr(lr, "runtime", None)
        if rt is not None and rt.move_reason.startswith("drain") and rt.move_to_id:
            continue
        what = f"pool {lr.pool.slug} is {lr.pool.state}" if lr.pool.state != Pool.State.ACTIVE \
            else f"node {lr.node.worker_name} is draining"
        avoid = {lr.pool.slug} if lr.pool.state != Pool.State.ACTIVE else set()
        target = choose_pool(lr, avoid=avoid)
        if target is None and rt is not None and rt.move_reason.startswith("drain"):
            continue  # still no free slot; already told
        LearnerRuntime.objects.update_or_create(learner=lr, defaults={"move_to": target,
                                                                     "move_reason": f"drain: {what}"})
        if target is not None:
            push_control(job.pk, lr.index, {"action": "migrate", "incarnation": lr.incarnation})
        event(job, Event.Kind.DRAINED,
              f"learner {lr.index} leaves {lr.pool.slug} ({what})"
              + (f" for {target.slug}" if target else ", waiting for a free slot"),
              {"learner": lr.index, "from": lr.pool.slug, "to": target.slug if target else None,
               "reason": what}, pool=lr.pool)
        n += 1
    return n


def lose_learner(learner: Learner, t) -> bool:
    """Mark `learner` lost (if it still is the incarnation we looked at) and queue its successor."""
    with transaction.atomic():
        n = Learner.objects.filter(pk=learner.pk, incarnation=learner.incarnation, state=learner.state) \
            .update(state=Learner.State.PENDING)
        if not n:
            return False
        rt = LearnerRuntime.objects.filter(learner=learner).first()
        was_running = learner.state == Learner.State.RUNNING
        failed_at = learner.last_heartbeat or (rt.dispatched_at if rt and rt.dispatched_at else t)
        Incident.objects.create(
            job=learner.job, learner=learner, pool=learner.pool, kind="learner_lost", failed_at=failed_at,
            detected_at=t,  # tokens_lost is filled in when the successor says where it resumes
            description=f"learner {learner.index}.{learner.incarnation} on {learner.pool} "
                        f"{'missed heartbeats' if was_running else 'never started'}",
            details={"incarnation": learner.incarnation, "worker": rt.worker if rt else "",
                     "node": learner.node_id, "state": learner.state})
    mark_node_lost(learner.node_id, f"learner {learner.index} of job {learner.job_id} lost")
    if not was_running:
        record_start_failure(learner, f"no heartbeat within {start_timeout():.0f} s of its dispatch")
    event(learner.job, Event.Kind.FAILED,
          f"learner {learner.index}.{learner.incarnation} lost on {learner.pool}",
          {"learner": learner.index, "incarnation": learner.incarnation,
           "last_heartbeat": learner.last_heartbeat.isoformat() if learner.last_heartbeat else None},
          pool=learner.pool)
    return True


# ---------------------------------------------------------------------------------- rebalancer
def _left_recently(job: Job, index: int, pool: str) -> bool:
    """Learner `index` moved away from `pool` less than MOVE_BACK_S ago. Where measured speeds wobble
    (pools sharing cores, a link that comes and goes) the rebalancer otherwise sends a learner back
    and forth, each move a handoff: the sites drill saw s1 -> s2 -> s1 every 40 s, 12% of a
    fault-free run's tokens lost."""
    return Event.objects.filter(job=job, kind=Event.Kind.REBALANCED, payload__learner=index,
                                payload__from=pool, time__gte=now() - timedelta(seconds=MOVE_BACK_S)).exists()


def rebalance() -> dict:
    """Drain, DyLU work sizes from measured throughput, moves to better pools, elastic size."""
    from trainer.rebalance import LearnerStatus, plan_moves, resize_work

    out = {"resized": 0, "moves": 0}
    for job in Job.objects.filter(status=st.RUNNING):
        spec = job_spec(job)
        learners = list(job.learners.select_related("pool", "runtime").filter(state__in=BUSY))
        # 2. DyLU: work sizes from measured tokens/s so contributions arrive together
        running = [lr for lr in learners if lr.state == Learner.State.RUNNING and lr.tokens_per_s]
        if len(running) >= 2:
            sizes = resize_work({lr.index: lr.tokens_per_s for lr in running}, spec.inner_steps)
            for lr in running:
                new = sizes.get(lr.index)
                if new and lr.work_size and abs(new - lr.work_size) >= max(2, lr.work_size // 4):
                    Learner.objects.filter(pk=lr.pk).update(work_size=new)
                    push_control(job.pk, lr.index, {"action": "resize", "work_size": new,
                                                    "incarnation": lr.incarnation})
                    event(job, Event.Kind.REBALANCED,
                          f"learner {lr.index} work size {lr.work_size} → {new} "
                          f"({lr.tokens_per_s:.0f} tok/s)",
                          {"learner": lr.index, "before": lr.work_size, "after": new,
                           "tokens_per_s": lr.tokens_per_s, "reason": "dynamic local updates"})
                    out["resized"] += 1
        # 3. moves to faster / cheaper / greener pools with free slots (measured for a while,
        #    at most one move per job per MOVE_COOLDOWN_S)
        settled = [lr for lr in running if lr.started_at and lr.started_at < now() - timedelta(seconds=5)]
        recent = Event.objects.filter(job=job, kind=Event.Kind.REBALANCED, payload__has_key="to",
                                      time__gte=now() - timedelta(seconds=MOVE_COOLDOWN_S)).exists()
        if settled and not recent:
            mem, flops, _ = model_figures(spec)
            status = [LearnerStatus(index=lr.index, pool=lr.pool.slug, tokens_per_s=lr.tokens_per_s)
                      for lr in running if lr.pool]
            try:
                moves = plan_moves(status, pool_infos(spec, job), spec.objective, model_memory_gib=mem,
                                   model_flops_per_token=flops, max_moves=1, min_gain=MOVE_MIN_GAIN)
            except Exception:
                log.debug("plan_moves failed", exc_info=True)
                moves = []
            for mv in moves:
                lr = next((x for x in running if x.index == mv.learner), None)
                rt = getattr(lr, "runtime", None) if lr else None
                if lr is None or (rt is not None and rt.move_to_id):
                    continue
                if _left_recently(job, lr.index, mv.to_pool):
                    continue
                target = Pool.objects.filter(slug=mv.to_pool, state=Pool.State.ACTIVE).first()
                if target is None or free_slots(exclude_learner=lr).get(target.slug, 0) <= 0:
                    continue
                reason = getattr(mv, "reason", "") or f"better pool for {spec.objective}"
                LearnerRuntime.objects.update_or_create(learner=lr, defaults={"move_to": target,
                                                                             "move_reason": reason})
                push_control(job.pk, lr.index, {"action": "migrate", "incarnation": lr.incarnation})
                event(job, Event.Kind.REBALANCED, f"learner {lr.index} moves {mv.from_pool} → {mv.to_pool}",
                      {"learner": lr.index, "from": mv.from_pool, "to": mv.to_pool, "reason": reason,
                       **{k: v for k, v in vars(mv).items() if isinstance(v, int | float | str)}})
                out["moves"] += 1
        elastic(job, spec)
    CoordinatorTick.record("rebalance")
    return out


def shrink(job: Job, learner: Learner) -> bool:
    """Capacity shrank (no slot anywhere for a pending learner): drop it while the job keeps at
    least min_learners; its data shard is simply not read further."""
    spec = job_spec(job)
    if not spec.min_learners:
        return False
    alive = job.learners.exclude(state__in=(Learner.State.REMOVED, Learner.State.DONE)).count()
    if alive <= (spec.min_learners or spec.learners):
        return False
    n = Learner.objects.filter(pk=learner.pk, state=Learner.State.PENDING).update(state=Learner.State.REMOVED)
    if n:
        event(job, Event.Kind.LEFT, f"learner {learner.index} removed: no capacity "
              f"({alive - 1} learners left, min {spec.min_learners})",
              {"learner": learner.index, "learners": alive - 1, "min": spec.min_learners,
               "reason": "capacity shrank"})
    return bool(n)


def elastic(job: Job, spec) -> None:
    """Grow towards max_learners while slots are free (new learners start from the newest
    global weights; the data is sharded max_learners ways from the start)."""
    if not spec.max_learners or spec.max_learners <= spec.learners:
        return
    if job.outer_steps < 1:
        return
    current = job.learners.exclude(state__in=(Learner.State.REMOVED, Learner.State.DONE)).count()
    if current >= spec.max_learners or job.learners.count() >= spec.max_learners:
        return
    free = free_slots()
    if spec.pools:
        free = {k: v for k, v in free.items() if k in spec.pools}
    if sum(free.values()) <= 0:
        return
    index = job.learners.count()
    learner = Learner.objects.create(job=job, index=index, state=Learner.State.PENDING,
                                     work_size=spec.inner_steps)
    LearnerRuntime.objects.create(learner=learner)
    event(job, Event.Kind.JOINED, f"learner {index} joins (elastic, {current + 1}/{spec.max_learners})",
          {"learner": index, "learners": current + 1, "max": spec.max_learners})
    dispatch_pending(job)
