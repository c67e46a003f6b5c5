"""Placement of learners onto pools and dispatch of learner tasks to pool queues.

Capacity of a pool = the device slots of its live nodes (a node is live while it has been
seen within the node timeout and was not declared lost), or the pool's device_count when no
node of it has registered yet. Slots in use = learners of any job that are starting or
running there.
"""
from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.db.models import Count, Q

from apps.inventory.models import Node, Pool
from apps.jobs.models import Event, Learner

from .common import event, job_spec, log, node_timeout, now
from .models import LearnerRuntime

BUSY = (Learner.State.STARTING, Learner.State.RUNNING)


def pool_capacity(pool: Pool) -> int:
    """Learner slots of a pool: its declared devices while at least one of its nodes is live.

    Nodes report their slots (GPUs detected, or worker processes on CPU nodes), but a pool's
    workers may register one by one, so the pool's declared device_count stays the capacity
    and node liveness only switches it on or off. A pool whose every node is lost, offline
    or silent gets nothing; a pool with no registered node yet is trusted.
    """
    nodes = list(Node.objects.filter(pool=pool).values_list("state", "last_seen"))
    if not nodes:
        return pool.device_count
    fresh = now() - timedelta(seconds=node_timeout())
    live = [1 for state, seen in nodes if state == Node.State.ONLINE and seen >= fresh]
    return pool.device_count if live else 0


def free_slots(exclude_learner: Learner | None = None) -> dict[str, int]:
    """Free learner slots per active pool."""
    used = dict(
        Learner.objects.filter(state__in=BUSY, pool__isnull=False)
        .exclude(pk=exclude_learner.pk if exclude_learner else None)
        .values_list("pool__slug").annotate(n=Count("id"))
    )
    out = {}
    for pool in Pool.objects.filter(state=Pool.State.ACTIVE).select_related("accelerator"):
        out[pool.slug] = max(0, pool_capacity(pool) - used.get(pool.slug, 0))
    return out


def pool_infos(job, free: dict[str, int] | None = None):
    """PoolInfo objects of the active pools a job may use (trainer.placement input)."""
    from trainer.placement import PoolInfo, learner_tokens_per_s

    spec = job_spec(job)
    free = free if free is not None else free_slots()
    measured = measured_throughput(job)
    infos = []
    qs = Pool.objects.select_related("accelerator")
    if spec.pools:
        qs = qs.filter(slug__in=spec.pools)
    for p in qs:
        acc = p.accelerator
        infos.append(PoolInfo(
            slug=p.slug, accelerator=acc.slug, peak_tflops_per_device=acc.peak_bf16_tflops,
            memory_gib=acc.memory_gib, watts_per_device=acc.tdp_watts,
            cost_per_device_hour=float(p.cost_per_device_hour), devices_free=free.get(p.slug, 0),
            link_gbps=p.link_gbps, latency_ms=p.latency_ms,
            measured_tokens_per_s=measured.get(p.slug), speed_factor=p.speed_factor, state=p.state,
        ))
    if measured:
        # Calibrate the catalogue estimates of unmeasured pools with what was measured, so a
        # measured pool is never compared with a raw peak-FLOPs guess.
        _mem, flops, _ = model_figures(spec)
        ratios = []
        for info in infos:
            if info.measured_tokens_per_s:
                est = learner_tokens_per_s(_replace(info, measured_tokens_per_s=None), 1, flops)
                if est > 0:
                    ratios.append(info.measured_tokens_per_s / est)
        if ratios:
            r = sum(ratios) / len(ratios)
            for info in infos:
                if not info.measured_tokens_per_s:
                    info.measured_tokens_per_s = learner_tokens_per_s(info, 1, flops) * r
    return infos


def _replace(info, **changes):
    import dataclasses

    return dataclasses.replace(info, **changes)


def measured_throughput(job) -> dict[str, float]:
    """Mean measured tokens/s per learner on each pool, from this job's running learners."""
    out: dict[str, list[float]] = {}
    for slug, tps in Learner.objects.filter(job=job, state=Learner.State.RUNNING, tokens_per_s__gt=0) \
            .values_list("pool__slug", "tokens_per_s"):
        if slug:
            out.setdefault(slug, []).append(tps)
    return {k: sum(v) / len(v) for k, v in out.items()}


def model_figures(spec) -> tuple[float, float, int]:
    """The dry run's figures too (trainer.models.spec_model_figures)."""
    from trainer.models import spec_model_figures

    return spec_model_figures(spec)


def place_job(job) -> list[Learner]:
    """Create the job's learners on pools (trainer.placement); raises PlacementError."""
    from trainer.placement import place

    spec = job_spec(job)
    mem, flops, frag_bytes = model_figures(spec)
    plan = place(
        spec.learners, pool_infos(job), spec.objective, model_memory_gib=mem, model_flops_per_token=flops,
        tokens_per_learner=spec.steps * spec.batch_size * spec.seq_len, base_inner_steps=spec.inner_steps,
        fragment_bytes=frag_bytes, fragments=spec.fragments,
        tokens_per_step=spec.batch_size * spec.seq_len,
    )
    pools = {p.slug: p for p in Pool.objects.filter(slug__in=plan.pools_used)}
    learners = []
    with transaction.atomic():
        for index, slug in plan.assignments:
            learner, _ = Learner.objects.update_or_create(
                job=job, index=index,
                defaults={"pool": pools[slug], "state": Learner.State.PENDING,
                          "work_size": plan.work_sizes.get(slug, spec.inner_steps),
                          "wire_dtype": spec.compression if spec.compression != "none"
                          else plan.wire_dtype.get(slug, "none")},
            )
            LearnerRuntime.objects.get_or_create(learner=learner)
            learners.append(learner)
    event(job, Event.Kind.PLACED,
          f"placed {len(learners)} learner(s) on {', '.join(plan.pools_used)} ({spec.objective})",
          {"assignments": plan.assignments, "work_sizes": plan.work_sizes, "wire_dtype": plan.wire_dtype,
           "reasons": plan.reasons, "est_time_s": plan.est_time_s, "est_energy_j": plan.est_energy_j,
           "est_cost": plan.est_cost})
    return learners


def choose_pool(learner: Learner, avoid: set[str] | None = None) -> Pool | None:
    """A pool with a free slot for `learner`: its own if healthy, else the best other one."""
    spec = job_spec(learner.job)
    free = free_slots(exclude_learner=learner)
    avoid = avoid or set()
    candidates = [s for s, n in free.items()
                  if n > 0 and s not in avoid and (not spec.pools or s in spec.pools)]
    if not candidates:
        return None
    own = learner.pool.slug if learner.pool_id else None
    if own in candidates:
        return learner.pool
    # best other pool: fastest per the placement model
    from trainer.placement import PlacementError, place

    mem, flops, frag_bytes = model_figures(spec)
    infos = [i for i in pool_infos(learner.job, free) if i.slug in candidates]
    try:
        plan = place(1, infos, spec.objective, model_memory_gib=mem, model_flops_per_token=flops,
                     tokens_per_learner=spec.steps * spec.batch_size * spec.seq_len,
                     base_inner_steps=spec.inner_steps, fragment_bytes=frag_bytes, fragments=spec.fragments,
                     tokens_per_step=spec.batch_size * spec.seq_len)
        return Pool.objects.get(slug=plan.assignments[0][1])
    except PlacementError:
        return None


def dispatch(learner: Learner, pool: Pool, reason: str = "") -> int:
    """Bump the incarnation, point the learner at `pool` and send run_learner to its queue."""
    from diloco_platform.celery import pool_queue

    from .tasks import run_learner

    with transaction.atomic():
        row = Learner.objects.select_for_update().get(pk=learner.pk)
        if row.state != Learner.State.PENDING:
            return row.incarnation  # someone else dispatched it meanwhile
        inc = row.incarnation + 1
        Learner.objects.filter(pk=row.pk).update(
            incarnation=inc, pool=pool, state=Learner.State.STARTING, node=None, last_heartbeat=None)
        LearnerRuntime.objects.update_or_create(
            learner=row, defaults={"dispatched_at": now(), "move_to": None, "move_reason": "",
                                   "resume_point": None, "worker": "", "pid": None})
        job_id = row.job_id
        index = row.index
        transaction.on_commit(lambda: run_learner.apply_async(
            (job_id, index, inc), queue=pool_queue(pool.slug)))
    learner.incarnation, learner.pool, learner.state = inc, pool, Learner.State.STARTING
    log.info("dispatched job %s learner %s.%s to %s %s", job_id, index, inc, pool.slug, reason)
    return inc


def mark_node_lost(node_id: int | None, reason: str) -> None:
    """Declare a node lost when none of its learners is alive any more."""
    if not node_id:
        return
    from .common import hb_timeout

    fresh = now() - timedelta(seconds=hb_timeout())
    alive = Learner.objects.filter(node_id=node_id, state=Learner.State.RUNNING, last_heartbeat__gte=fresh)
    if not alive.exists():
        n = Node.objects.filter(pk=node_id).exclude(state=Node.State.LOST).update(state=Node.State.LOST)
        if n:
            node = Node.objects.select_related("pool").get(pk=node_id)
            Event.objects.create(pool=node.pool, kind=Event.Kind.FAILED,
                                 message=f"node {node.worker_name} lost: {reason}"[:300])


def busy_filter():
    return Q(state__in=BUSY)
