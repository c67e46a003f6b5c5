"""Placement policy: which pool each learner runs on, its inner-step budget and wire dtype.

Pure policy (no Django, no I/O): the coordinator calls it with `PoolInfo` built from the
inventory, the simulator calls it with pools built from the catalogue.

Model of a learner on a pool:
- devices per learner d = ceil(model_memory_gib / (0.9 * device memory)), at least 1
  (unless `devices_per_learner` is given): the learner's model shards over d devices;
  with `nodes_per_learner` n > 1 the d devices are d/n on each of n distinct live nodes of
  the pool (free slots per node, `island_nodes`), else the pool's free devices count;
- throughput v = measured tokens/s of that pool if known, else
  d * peak TFLOP/s * MFU * speed_factor / FLOPs per token;
- per outer cycle of H inner steps a learner sends and receives every fragment once:
  2 * P * fragment_bytes / ratio(wire dtype) bytes, overlapped with compute. The wire
  dtype is the least lossy of none/bf16/int8/int4 whose transfer fits in half the compute
  time of the cycle (int4 when nothing fits), so communication hides behind compute.

Estimates (`est_time_s`, `est_energy_j`, `est_cost`) assume dynamic local updates: every
learner computes all the time, so the job's tokens arrive at the summed rate; a learner
whose link cannot keep up is slowed to its link rate. Energy counts the job's devices at
TDP while busy; cost counts device-hours.

Objectives:
- time: maximise the summed throughput (greedy, fastest learner slot first);
- energy / cost: minimise joules (dollars) per token subject to a time budget of
  (1 + time_slack) x the time-optimal estimate. Candidates come from a sweep of the
  scalarised score  e_pool + lam / v_pool  over lam (a Lagrangian relaxation), each filled
  greedily; the cheapest candidate within the budget wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer.spec import JobSpec

OBJECTIVES = ("time", "energy", "cost")
WIRE_RATIO = {"none": 1.0, "bf16": 2.0, "int8": 4.0, "int4": 8.0}  # vs fp32 fragment_bytes


class PlacementError(ValueError):
    """Nothing fits: the message says why (memory, free devices, bad arguments)."""


# Bytes of training state per parameter: fp32 weights, grads, AdamW's two moments, and the
# learner's copy of the global base it computes pseudo-gradients against.
STATE_BYTES_PER_PARAM = 20
# Activations kept for the backward pass, per token of a batch (a rough figure for the small
# GPTs of the presets; a factory's model may need more) and the allocator's slack on top.
ACTIVATION_BYTES_PER_TOKEN = 4096
MEMORY_OVERHEAD = 1.25


@dataclass(frozen=True)
class ModelFigures:
    """What placement needs to know of a job's model: one estimate for the dry run and the coordinator."""

    params: int
    memory_gib: float
    flops_per_token: float
    fragment_bytes: int


def model_figures(params: int, batch_size: int, seq_len: int, fragments: int = 1) -> ModelFigures:
    """Training footprint of one learner and the 6 N FLOPs per token of a `params`-parameter model."""
    state = params * STATE_BYTES_PER_PARAM
    activations = batch_size * seq_len * ACTIVATION_BYTES_PER_TOKEN
    return ModelFigures(
        params=int(params),
        memory_gib=(state + activations) * MEMORY_OVERHEAD / 2**30,
        flops_per_token=6.0 * params,
        fragment_bytes=int(params) * 4 // max(1, fragments),
    )


@dataclass
class PoolInfo:
    slug: str
    accelerator: str
    peak_tflops_per_device: float
    memory_gib: float
    watts_per_device: float
    cost_per_device_hour: float
    devices_free: int
    link_gbps: float
    latency_ms: float = 1.0
    measured_tokens_per_s: float | None = None  # per learner, for this job's model, when known
    speed_factor: float = 1.0
    state: str = "active"
    mfu: float = 0.4
    idle_watts_per_device: float | None = None
    # free device slots of each live node (worker name -> slots), when known: an island over several
    # nodes needs that many distinct nodes with its per-node share free on each (`island_nodes`)
    nodes_free: dict[str, int] | None = None


@dataclass
class Placement:
    assignments: list[tuple[int, str]]
    work_sizes: dict[str, int]
    wire_dtype: dict[str, str]
    reasons: list[str]
    est_time_s: float
    est_energy_j: float
    est_cost: float
    devices_per_learner: dict[str, int] = field(default_factory=dict)
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    nodes: dict[int, list[str]] = field(default_factory=dict)  # learner -> its island's nodes, rank 0's first

    @property
    def pools_used(self) -> list[str]:
        return sorted({p for _, p in self.assignments})


def devices_needed(pool: PoolInfo, model_memory_gib: float) -> int:
    usable = 0.9 * pool.memory_gib
    if usable <= 0:
        return 10**9
    return max(1, math.ceil(model_memory_gib / usable))


def learner_tokens_per_s(pool: PoolInfo, devices: int, model_flops_per_token: float) -> float:
    """Expected compute throughput of one learner on `pool` (tokens/s)."""
    if pool.measured_tokens_per_s:
        return float(pool.measured_tokens_per_s)
    flops = devices * pool.peak_tflops_per_device * 1e12 * pool.mfu * pool.speed_factor
    return flops / model_flops_per_token


def cycle_bytes(fragment_bytes: int, fragments: int, wire: str) -> float:
    """Bytes one learner moves (up + down) per outer cycle with `wire` dtype."""
    return 2.0 * fragments * fragment_bytes / WIRE_RATIO[wire]


def choose_wire(
    pool: PoolInfo, compute_cycle_s: float, fragment_bytes: int, fragments: int
) -> tuple[str, float]:
    """Least lossy dtype whose transfer fits in half the compute of a cycle; its transfer time."""
    bw = max(pool.link_gbps, 1e-9) * 1e9 / 8
    lat = 2 * fragments * pool.latency_ms / 1e3
    for wire in ("none", "bf16", "int8", "int4"):
        t = cycle_bytes(fragment_bytes, fragments, wire) / bw + lat
        if t <= 0.5 * compute_cycle_s:
            return wire, t
    return "int4", cycle_bytes(fragment_bytes, fragments, "int4") / bw + lat


def island_nodes(nodes_free: Mapping[str, int], nodes: int, per_node: int) -> list[str] | None:
    """The nodes of one island over `nodes` nodes: those with the most free slots (ties by name),
    each with at least `per_node` free; None when fewer nodes have room. Rank 0 goes to the first.
    Taking the fullest nodes first is also what packs the most islands (`islands_that_fit`)."""
    fit = sorted((n for n, f in nodes_free.items() if f >= per_node), key=lambda n: (-nodes_free[n], n))
    return fit[:nodes] if len(fit) >= nodes else None


def reserve_nodes(nodes_free: Mapping[str, int], chosen: list[str], per_node: int) -> dict[str, int]:
    """`nodes_free` after one island took `per_node` slots on each of `chosen`."""
    return {n: f - (per_node if n in chosen else 0) for n, f in nodes_free.items()}


def islands_that_fit(nodes_free: Mapping[str, int], nodes: int, per_node: int) -> int:
    """How many islands of `nodes` x `per_node` the nodes hold (islands placed one by one by
    `island_nodes`, so the count is the one dispatch reaches)."""
    free, count = dict(nodes_free), 0
    while (chosen := island_nodes(free, nodes, per_node)) is not None:
        free = reserve_nodes(free, chosen, per_node)
        count += 1
    return count


@dataclass
class _Slot:
    pool: PoolInfo
    devices: int
    v: float  # effective tokens/s of one learner (link-limited)
    wire: str
    joules_per_token: float
    dollars_per_token: float
    capacity: int = 0  # learners of this shape the pool holds now
    nodes: int = 1  # nodes per learner


def _capacity(pool: PoolInfo, devices: int, nodes: int) -> int:
    """Learners of `devices` over `nodes` nodes that fit on `pool`: its free devices for one-node
    learners (the pool's count, as ever), its nodes' free slots for islands over several nodes."""
    if nodes <= 1:
        return pool.devices_free // devices
    islands = islands_that_fit(pool.nodes_free or {}, nodes, devices // nodes)
    return min(islands, pool.devices_free // devices)


def _slots(
    pools,
    model_memory_gib,
    model_flops_per_token,
    tokens_per_step,
    base_inner_steps,
    fragment_bytes,
    fragments,
    devices_per_learner,
    nodes_per_learner=1,
):
    out, reasons = [], []
    for pool in pools:
        if pool.state != "active":
            reasons.append(f"{pool.slug}: skipped, pool is {pool.state}")
            continue
        d = devices_per_learner or devices_needed(pool, model_memory_gib)
        if d * pool.memory_gib * 0.9 < model_memory_gib:
            reasons.append(f"{pool.slug}: skipped, {model_memory_gib:.1f} GiB does not fit on {d} device(s)")
            continue
        if pool.devices_free < d:
            reasons.append(f"{pool.slug}: skipped, {pool.devices_free} free device(s), a learner needs {d}")
            continue
        capacity = _capacity(pool, d, nodes_per_learner)
        if capacity < 1:
            reasons.append(f"{pool.slug}: skipped, a learner needs {nodes_per_learner} live nodes with "
                           f"{d // nodes_per_learner} free device(s) each")
            continue
        v = learner_tokens_per_s(pool, d, model_flops_per_token)
        if v <= 0:
            continue
        compute_cycle = base_inner_steps * tokens_per_step / v
        wire, comm = choose_wire(pool, compute_cycle, fragment_bytes, fragments)
        if comm > compute_cycle:  # the link cannot keep up even at int4: the learner runs at link speed
            v = v * compute_cycle / comm
        out.append(_Slot(pool, d, v, wire, d * pool.watts_per_device / v,
                         d * pool.cost_per_device_hour / 3600 / v, capacity, nodes_per_learner))
    return out, reasons


def _fill(slots: list[_Slot], learners: int, key) -> list[_Slot] | None:
    free = {s.pool.slug: s.capacity for s in slots}
    order = sorted(slots, key=key)
    chosen: list[_Slot] = []
    for _ in range(learners):
        for s in order:
            if free[s.pool.slug] >= 1:
                free[s.pool.slug] -= 1
                chosen.append(s)
                break
        else:
            return None
    return chosen


def _estimate(chosen: list[_Slot], total_tokens: float) -> tuple[float, float, float]:
    rate = sum(s.v for s in chosen)
    t = total_tokens / rate
    energy = sum(s.devices * s.pool.watts_per_device for s in chosen) * t
    cost = sum(s.devices * s.pool.cost_per_device_hour for s in chosen) * t / 3600
    return t, energy, cost


def _improve(
    chosen: list[_Slot], slots: list[_Slot], total_tokens: float, budget: float, objective: str
) -> list[_Slot]:
    """Local search after the sweep: move single learners to other pools while that lowers the
    objective and keeps the time estimate within budget (greedy fills move whole pools at once)."""

    def score(sel):
        t, e, c = _estimate(sel, total_tokens)
        return t, (e if objective == "energy" else c)

    chosen = list(chosen)
    _, cur = score(chosen)
    for _ in range(4 * len(chosen) * max(1, len(slots))):
        used: dict[str, int] = {}
        for c in chosen:
            used[c.pool.slug] = used.get(c.pool.slug, 0) + 1
        best = None
        for k, old in enumerate(chosen):
            for s in slots:
                if s.pool.slug == old.pool.slug or s.capacity - used.get(s.pool.slug, 0) < 1:
                    continue
                trial = chosen[:k] + [s] + chosen[k + 1 :]
                t, v = score(trial)
                if (
                    t <= budget * (1 + 1e-9)
                    and v < cur - 1e-12 * max(1.0, abs(cur))
                    and (best is None or v < best[0])
                ):
                    best = (v, trial)
        if best is None:
            break
        cur, chosen = best
    return chosen


def _check(learners, objective, flops, tokens, steps, fragment_bytes, time_slack, devices, nodes) -> None:
    """`place`'s arguments, or PlacementError."""
    if objective not in OBJECTIVES:
        raise PlacementError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    if learners < 1:
        raise PlacementError("learners must be at least 1")
    if flops <= 0 or tokens <= 0 or steps < 1 or fragment_bytes < 0:
        raise PlacementError("model_flops_per_token, tokens_per_learner, base_inner_steps must be positive")
    if not 0 <= time_slack <= 10:
        raise PlacementError("time_slack must lie in [0, 10]")
    if nodes > 1 and (not devices or devices % nodes):
        raise PlacementError("nodes_per_learner must divide devices_per_learner")


def place(
    learners: int,
    pools: list[PoolInfo],
    objective: str = "time",
    model_memory_gib: float = 1.0,
    model_flops_per_token: float = 6e6,
    tokens_per_learner: int = 1_000_000,
    base_inner_steps: int = 20,
    fragment_bytes: int = 1 << 20,
    *,
    fragments: int = 1,
    tokens_per_step: int | None = None,
    devices_per_learner: int | None = None,
    nodes_per_learner: int = 1,
    time_slack: float = 0.10,
) -> Placement:
    """Place `learners` learners on `pools` for `objective`; raises PlacementError when nothing fits.

    `tokens_per_step` (one learner's tokens per inner step) sets the cycle length used to
    pick the wire dtype; by default a cycle is assumed to last 1/100 of the learner's work.
    `nodes_per_learner` > 1 (with `devices_per_learner`) spreads each learner over that many
    distinct nodes of its pool (`PoolInfo.nodes_free`); `Placement.nodes` names them.
    """
    _check(learners, objective, model_flops_per_token, tokens_per_learner, base_inner_steps, fragment_bytes,
           time_slack, devices_per_learner, nodes_per_learner)
    if tokens_per_step is None:
        tokens_per_step = max(1, tokens_per_learner // (100 * base_inner_steps))
    slots, reasons = _slots(
        pools,
        model_memory_gib,
        model_flops_per_token,
        tokens_per_step,
        base_inner_steps,
        fragment_bytes,
        fragments,
        devices_per_learner,
        nodes_per_learner,
    )
    if not slots:
        raise PlacementError("no pool can host a learner: " + ("; ".join(reasons) or "no pools given"))
    total_tokens = float(learners * tokens_per_learner)

    fastest = _fill(slots, learners, key=lambda s: -s.v)
    if fastest is None:
        cap = sum(s.capacity for s in slots)
        raise PlacementError(f"only {cap} learner slot(s) free across pools, {learners} requested")
    t_best, _, _ = _estimate(fastest, total_tokens)
    chosen = fastest
    if objective != "time":
        unit = (lambda s: s.joules_per_token) if objective == "energy" else (lambda s: s.dollars_per_token)
        budget = t_best * (1 + time_slack)
        scale = sum(unit(s) for s in slots) / len(slots) * sum(s.v for s in slots) / len(slots)
        best = None
        for k in range(-12, 13):
            lam = scale * 2.0**k
            cand = _fill(slots, learners, key=lambda s, lam=lam: unit(s) + lam / s.v)
            if cand is None:
                continue
            t, e, c = _estimate(cand, total_tokens)
            score = e if objective == "energy" else c
            if t <= budget * (1 + 1e-9) and (best is None or score < best[0] - 1e-12):
                best = (score, cand)
        if best is not None:
            chosen = _improve(best[1], slots, total_tokens, budget, objective)
        reasons.append(
            f"{objective}: cheapest placement within {time_slack:.0%} of the fastest "
            f"estimate ({t_best:.0f} s)"
        )
    else:
        reasons.append("time: fastest learner slots first")

    t, e, c = _estimate(chosen, total_tokens)
    vmax = max(s.v for s in chosen)
    assignments = [(i, s.pool.slug) for i, s in enumerate(chosen)]
    work, wire, dev, tps = {}, {}, {}, {}
    for s in chosen:
        work[s.pool.slug] = max(1, math.floor(s.v / vmax * base_inner_steps))
        wire[s.pool.slug] = s.wire
        dev[s.pool.slug] = s.devices
        tps[s.pool.slug] = s.v
    for slug in sorted(work):
        n = sum(1 for _, p in assignments if p == slug)
        reasons.append(
            f"{slug}: {n} learner(s) x {dev[slug]} device(s), ~{tps[slug]:.3g} tok/s each, "
            f"H={work[slug]}, wire {wire[slug]}"
        )
    return Placement(assignments, work, wire, reasons, t, e, c, dev, tps, _assign_nodes(chosen))


def _assign_nodes(chosen: list[_Slot]) -> dict[int, list[str]]:
    """The nodes of each island over several nodes, in learner order: what dispatch picks when it
    sends them one by one on today's free slots (`island_nodes`)."""
    free = {s.pool.slug: dict(s.pool.nodes_free or {}) for s in chosen if s.nodes > 1}
    out: dict[int, list[str]] = {}
    for i, s in enumerate(chosen):
        if s.nodes <= 1:
            continue
        per_node = s.devices // s.nodes
        nodes = island_nodes(free[s.pool.slug], s.nodes, per_node)
        if nodes is None:  # cannot happen within `capacity`; a learner without nodes is placed at dispatch
            continue
        free[s.pool.slug] = reserve_nodes(free[s.pool.slug], nodes, per_node)
        out[i] = nodes
    return out


def free_slots(capacity: Mapping[str, int], busy: Mapping[str, int]) -> dict[str, int]:
    """The free-slot rule: a pool's learner slots less its busy learners, never below zero."""
    return {slug: max(0, int(cap) - int(busy.get(slug, 0))) for slug, cap in capacity.items()}


def calibrate(pools: list[PoolInfo], model_flops_per_token: float) -> list[PoolInfo]:
    """Pools without a measurement get the catalogue estimate scaled by the mean measured/estimated
    ratio of the measured ones, so a measured pool is never compared with a raw peak-FLOPs guess."""
    ratios = []
    for info in pools:
        if info.measured_tokens_per_s:
            est = learner_tokens_per_s(dataclasses.replace(info, measured_tokens_per_s=None), 1,
                                       model_flops_per_token)
            if est > 0:
                ratios.append(info.measured_tokens_per_s / est)
    if not ratios:
        return list(pools)
    r = sum(ratios) / len(ratios)
    return [
        info if info.measured_tokens_per_s else dataclasses.replace(
            info, measured_tokens_per_s=learner_tokens_per_s(info, 1, model_flops_per_token) * r)
        for info in pools
    ]


def place_spec(
    spec: JobSpec, figures: ModelFigures, pools: list[PoolInfo], learners: int | None = None
) -> Placement:
    """Place a job spec's learners (all of them, or `learners`): the one call the dry run and the
    coordinator both make, so the preview is the placement the coordinator will make.

    A learner's work is its share of the job's token budget; its cycle is `inner_steps` steps of
    batch x sequence tokens; a compression the spec names wins over the link-fitted wire dtype.
    A learner island (`devices_per_learner` > 1) takes that many devices; one device otherwise
    unless the model needs more. An island over `nodes_per_learner` > 1 nodes takes its share of
    devices on each of that many distinct nodes of one pool (`island_nodes`).
    """
    island = getattr(spec, "devices_per_learner", 1) or 1
    nodes = getattr(spec, "nodes_per_learner", 1) or 1
    plan = place(
        spec.learners if learners is None else learners, pools, spec.objective,
        model_memory_gib=figures.memory_gib, model_flops_per_token=figures.flops_per_token,
        tokens_per_learner=max(1, spec.total_tokens // spec.learners), base_inner_steps=spec.inner_steps,
        fragment_bytes=figures.fragment_bytes, fragments=spec.fragments,
        tokens_per_step=spec.batch_size * spec.seq_len,
        devices_per_learner=island if island > 1 else None, nodes_per_learner=nodes,
    )
    if spec.compression != "none":
        plan.wire_dtype = dict.fromkeys(plan.wire_dtype, spec.compression)
    return plan


def pool_from_catalogue(
    slug: str, accelerator: str, devices_free: int, link_gbps: float, latency_ms: float = 1.0, **overrides
) -> PoolInfo:
    """A PoolInfo filled from `trainer.catalogue` figures (overrides win)."""
    from trainer import catalogue

    a = catalogue.get(accelerator)
    fields = {
        "slug": slug,
        "accelerator": accelerator,
        "peak_tflops_per_device": a.peak_bf16_tflops,
        "memory_gib": a.memory_gib,
        "watts_per_device": a.tdp_watts,
        "cost_per_device_hour": a.cost_per_device_hour,
        "devices_free": devices_free,
        "link_gbps": link_gbps,
        "latency_ms": latency_ms,
        "mfu": a.mfu,
        "idle_watts_per_device": a.idle_watts,
    }
    fields.update(overrides)
    return PoolInfo(**fields)
