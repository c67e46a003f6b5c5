"""Placement of learners onto pools and dispatch of learner tasks to pool queues.

Capacity of a pool = the device slots of its live nodes (a node is live while it has been
seen within the node timeout and was not declared lost), or the pool's device_count when no
node of it has registered yet. Slots in use = learners of any job that are starting or
running there. `plan` is the one placement of a spec: place_job makes it, the dry run
(apps.api.placement) shows it.

A learner island over several nodes (`nodes_per_learner` N > 1) also needs N distinct live
nodes of its pool with W/N free slots each (`nodes_free`, trainer.placement.island_nodes):
dispatch reserves them (LearnerRuntime.island_nodes) and sends rank 0's task to the first
node's own queue (`pool.<slug>.node.<worker>`); rank 0 starts the other nodes' ranks.
"""
from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.db.models import Count, Q

from apps.inventory.models import Node, Pool
from apps.jobs.models import Event, Job, Learner
from trainer import placement
from trainer.placement import PoolInfo
from trainer.spec import JobSpec, stored_spec

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
    """Free learner slots per active pool (trainer.placement.free_slots over live capacity)."""
    busy = dict(
        Learner.objects.filter(state__in=BUSY, pool__isnull=False)
        .exclude(pk=exclude_learner.pk if exclude_learner else None)
        .values_list("pool__slug").annotate(n=Count("id"))
    )
    busy = _island_devices(busy, exclude_learner)
    capacity = {pool.slug: pool_capacity(pool) for pool in Pool.objects.filter(state=Pool.State.ACTIVE)}
    return placement.free_slots(capacity, busy)


def _island_devices(busy: dict[str, int], exclude_learner: Learner | None) -> dict[str, int]:
    """A busy learner of a job with devices_per_learner d holds d slots of its pool (an island)."""
    out = dict(busy)
    rows = Learner.objects.filter(state__in=BUSY, pool__isnull=False, job__spec__devices_per_learner__gt=1) \
        .exclude(pk=exclude_learner.pk if exclude_learner else None).values_list("pool__slug", "job__spec")
    for slug, data in rows:
        spec = stored_spec(data)
        out[slug] = out.get(slug, 0) + (spec.devices_per_learner if spec else 1) - 1
    return out


def _shape(data) -> tuple[int, int]:
    """(devices, nodes) of one learner of a stored spec."""
    spec = stored_spec(data)
    return (spec.devices_per_learner, spec.nodes_per_learner) if spec else (1, 1)


def nodes_free(slugs: list[str] | None = None, exclude_learner: Learner | None = None,
               empty: bool = False) -> dict[str, dict[str, int]]:
    """Free slots of each live node (worker name), per pool: its registered slots less those of the
    busy learners on it (an island over N nodes holds W/N on each node it reserved; any other busy
    learner W on the node that runs it). `empty`: every registered, not lost node as if idle (the
    fleet a job could ever have)."""
    qs = Node.objects.filter(pool__state=Pool.State.ACTIVE)
    if empty:
        qs = qs.exclude(state=Node.State.LOST)
    else:
        qs = qs.filter(state=Node.State.ONLINE, last_seen__gte=now() - timedelta(seconds=node_timeout()))
    if slugs is not None:
        qs = qs.filter(pool__slug__in=slugs)
    out: dict[str, dict[str, int]] = {}
    for slug, worker, slots in qs.values_list("pool__slug", "worker_name", "device_count"):
        out.setdefault(slug, {})[worker] = int(slots)
    if empty:
        return out
    rows = Learner.objects.filter(state__in=BUSY, pool__slug__in=list(out)) \
        .exclude(pk=exclude_learner.pk if exclude_learner else None) \
        .values_list("pool__slug", "node__worker_name", "runtime__island_nodes", "job__spec")
    for slug, worker, island, data in rows:
        devices, _ = _shape(data)
        held = {n: devices // len(island) for n in island} if island else {worker: devices} if worker else {}
        for n, k in held.items():
            if n in out[slug]:
                out[slug][n] = max(0, out[slug][n] - k)
    return out


def pool_infos(spec: JobSpec, job: Job | None = None, free: dict[str, int] | None = None,
               nodes: dict[str, dict[str, int]] | None = None) -> list[PoolInfo]:
    """The pools `spec` may use as trainer.placement sees them: today's free slots (or `free`), the
    free slots of their nodes for islands over several nodes (or `nodes`) and, once `job` runs, its
    measured throughput. The dry run and the coordinator both read this."""
    free = free_slots() if free is None else free
    if nodes is None and spec.nodes_per_learner > 1:
        nodes = nodes_free(spec.pools or None)
    measured = measured_throughput(job) if job is not None else {}
    qs = Pool.objects.select_related("accelerator").order_by("slug")
    if spec.pools:
        qs = qs.filter(slug__in=spec.pools)
    infos = [
        PoolInfo(
            slug=p.slug, accelerator=p.accelerator.slug,
            peak_tflops_per_device=p.accelerator.peak_bf16_tflops, memory_gib=p.accelerator.memory_gib,
            watts_per_device=float(p.accelerator.tdp_watts),
            cost_per_device_hour=float(p.cost_per_device_hour), devices_free=free.get(p.slug, 0),
            link_gbps=p.link_gbps, latency_ms=p.latency_ms, measured_tokens_per_s=measured.get(p.slug),
            speed_factor=p.speed_factor, state=p.state,
            nodes_free=(nodes or {}).get(p.slug, {}) if spec.nodes_per_learner > 1 else None,
        )
        for p in qs
    ]
    return placement.calibrate(infos, figures(spec).flops_per_token) if measured else infos


def measured_throughput(job: Job) -> dict[str, float]:
    """Mean measured tokens/s per learner on each pool, from this job's running learners."""
    out: dict[str, list[float]] = {}
    for slug, tps in Learner.objects.filter(job=job, state=Learner.State.RUNNING, tokens_per_s__gt=0) \
            .values_list("pool__slug", "tokens_per_s"):
        if slug:
            out.setdefault(slug, []).append(tps)
    return {k: sum(v) / len(v) for k, v in out.items()}


def figures(spec: JobSpec) -> placement.ModelFigures:
    """The placement figures of a spec's model (builds a factory model once to count it)."""
    from trainer.models import job_model_figures  # torch: loaded when a placement is made, not on import

    return job_model_figures(spec.model, spec.batch_size, spec.seq_len, spec.fragments)


def model_figures(spec: JobSpec) -> tuple[float, float, int]:
    """(memory GiB, FLOPs per token, fragment bytes) of `figures`."""
    f = figures(spec)
    return f.memory_gib, f.flops_per_token, f.fragment_bytes


def plan(spec: JobSpec, job: Job | None = None, free: dict[str, int] | None = None,
         learners: int | None = None, only: set[str] | None = None,
         nodes: dict[str, dict[str, int]] | None = None) -> placement.Placement:
    """Where `spec`'s learners go now (raises PlacementError): what place_job makes and the dry run shows."""
    infos = pool_infos(spec, job, free, nodes)
    if only is not None:
        infos = [i for i in infos if i.slug in only]
    return placement.place_spec(spec, figures(spec), infos, learners)


def place_job(job: Job) -> list[Learner]:
    """Create the job's learners on pools (`plan`); raises PlacementError."""
    spec = job_spec(job)
    p = plan(spec, job)
    pools = {pool.slug: pool for pool in Pool.objects.filter(slug__in=p.pools_used)}
    learners = []
    with transaction.atomic():
        for index, slug in p.assignments:
            learner, _ = Learner.objects.update_or_create(
                job=job, index=index,
                defaults={"pool": pools[slug], "state": Learner.State.PENDING,
                          "work_size": p.work_sizes[slug], "wire_dtype": p.wire_dtype[slug]},
            )
            LearnerRuntime.objects.get_or_create(learner=learner)
            learners.append(learner)
    event(job, Event.Kind.PLACED,
          f"placed {len(learners)} learner(s) on {', '.join(p.pools_used)} ({spec.objective})",
          {"assignments": p.assignments, "work_sizes": p.work_sizes, "wire_dtype": p.wire_dtype,
           "reasons": p.reasons, "est_time_s": p.est_time_s, "est_energy_j": p.est_energy_j,
           "est_cost": p.est_cost})
    return learners


def choose_pool(learner: Learner, avoid: set[str] | None = None) -> Pool | None:
    """A pool with a free slot for `learner`: its own if healthy, else the best other one."""
    spec = job_spec(learner.job)
    free = free_slots(exclude_learner=learner)
    avoid = avoid or set()
    candidates = {s for s, n in free.items()
                  if n >= spec.devices_per_learner and s not in avoid and (not spec.pools or s in spec.pools)}
    nodes = None
    if spec.nodes_per_learner > 1 and candidates:  # an island over nodes needs N nodes with room
        nodes = nodes_free(sorted(candidates), exclude_learner=learner)
        per_node = spec.devices_per_learner // spec.nodes_per_learner
        candidates = {s for s in candidates
                      if placement.island_nodes(nodes.get(s, {}), spec.nodes_per_learner, per_node)}
    if not candidates:
        return None
    if learner.pool_id and learner.pool.slug in candidates:
        return learner.pool
    try:  # the best other pool per the placement model
        best = plan(spec, learner.job, free, learners=1, only=candidates, nodes=nodes)
    except placement.PlacementError:
        return None
    return Pool.objects.get(slug=best.assignments[0][1])


def island_placement(learner: Learner, pool: Pool) -> list[str] | None:
    """The nodes of `pool` an island over several nodes would take now (rank 0's first), [] for a
    learner on one node, None when the pool lacks the nodes."""
    spec = job_spec(learner.job)
    if spec.nodes_per_learner <= 1:
        return []
    free = nodes_free([pool.slug], exclude_learner=learner).get(pool.slug, {})
    return placement.island_nodes(free, spec.nodes_per_learner,
                                  spec.devices_per_learner // spec.nodes_per_learner)


def dispatch(learner: Learner, pool: Pool, reason: str = "") -> int:
    """Bump the incarnation, point the learner at `pool` and send run_learner to its queue (rank 0's
    node's own queue for an island over several nodes, whose nodes it reserves; when the pool lacks
    them now, the learner stays pending)."""
    from diloco_platform.celery import RUN_LEARNER, node_queue, pool_queue, send

    island = island_placement(learner, pool)
    if island is None:
        log.info("job %s learner %s: pool %s lacks the nodes of its island now, waiting",
                 learner.job_id, learner.index, pool.slug)
        return learner.incarnation
    queue = node_queue(pool.slug, island[0]) if island else pool_queue(pool.slug)
    with transaction.atomic():
        row = Learner.objects.select_for_update().get(pk=learner.pk)
        if row.state != Learner.State.PENDING:
            return row.incarnation  # someone else dispatched it meanwhile
        inc = row.incarnation + 1
        Learner.objects.filter(pk=row.pk).update(
            incarnation=inc, pool=pool, state=Learner.State.STARTING, node=None, last_heartbeat=None)
        LearnerRuntime.objects.update_or_create(
            learner=row, defaults={"dispatched_at": now(), "move_to": None, "move_reason": "",
                                   "resume_point": None, "worker": "", "pid": None, "island_nodes": island})
        job_id = row.job_id
        index = row.index
        transaction.on_commit(lambda: send(RUN_LEARNER, job_id, index, inc, queue=queue))
    learner.incarnation, learner.pool, learner.state = inc, pool, Learner.State.STARTING
    log.info("dispatched job %s learner %s.%s to %s%s %s", job_id, index, inc, pool.slug,
             f" (nodes {', '.join(island)})" if island else "", reason)
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
