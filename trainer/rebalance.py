"""Rebalancing policy: per-learner work sizes and learner moves between pools.

Pure policy (no Django, no I/O), shared by the coordinator and the simulator.

- `resize_work`: dynamic local updates (DyLU, arXiv 2401.09135): learner w gets
  H_w = max(1, floor(v_w / v_max * H)) inner steps per cycle, v = measured throughput,
  so fast and slow learners finish a cycle at about the same time. The syncer's token
  weighting absorbs what is left of the mismatch.
- `plan_moves`: moves learners to better or healthier pools:
  * a learner that is lost or sits on a pool that is not active is moved to the best pool
    with free devices (reason "lost" / "pool draining");
  * otherwise a learner is moved when a free slot improves the objective by at least
    `min_gain` (time: tokens/s measured on its current pool, so a straggling node counts;
    energy: joules per token; cost: dollars per token).
  Free devices are consumed as moves are planned; the biggest gains are planned first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trainer.placement import OBJECTIVES, PoolInfo, devices_needed, learner_tokens_per_s


def resize_work(throughputs: dict[int, float], base_inner_steps: int) -> dict[int, int]:
    """DyLU inner-step budgets from measured throughputs (any positive unit, same for all)."""
    if base_inner_steps < 1:
        raise ValueError("base_inner_steps must be at least 1")
    live = {k: float(v) for k, v in throughputs.items() if v is not None and math.isfinite(v) and v > 0}
    if not live:
        return dict.fromkeys(throughputs, base_inner_steps)
    vmax = max(live.values())
    return {k: max(1, math.floor(live.get(k, 0.0) / vmax * base_inner_steps + 1e-9)) for k in throughputs}


@dataclass
class LearnerStatus:
    index: int
    pool: str
    tokens_per_s: float | None = None  # measured; None when not yet known
    devices: int = 1
    alive: bool = True


@dataclass
class Move:
    learner: int
    from_pool: str
    to_pool: str
    reason: str
    gain: float  # relative improvement of the objective (1.0 = twice as good); inf for rescues


def _unit_cost(pool: PoolInfo, devices: int, v: float, objective: str) -> float:
    if objective == "time":
        return 1.0 / v
    if objective == "energy":
        return devices * pool.watts_per_device / v
    return devices * pool.cost_per_device_hour / v


def _devices(pool: PoolInfo, devices_per_learner: int | dict[str, int] | None, memory_gib: float) -> int:
    d = devices_per_learner.get(pool.slug) if isinstance(devices_per_learner, dict) else devices_per_learner
    return d or devices_needed(pool, memory_gib)


def _options(pools, free, devices_per_learner, model_memory_gib, model_flops_per_token):
    """(pool, devices, tokens/s) of each active pool with room for one more learner now."""
    for p in pools:
        if p.state != "active":
            continue
        d = _devices(p, devices_per_learner, model_memory_gib)
        if free.get(p.slug, 0) >= d:
            v = learner_tokens_per_s(p, d, model_flops_per_token)
            if v > 0:
                yield p, d, v


def _rescue_moves(rescues: list[LearnerStatus], options, objective: str, free: dict[str, int]) -> list[Move]:
    """Lost learners and learners on pools that are not active go to the best pool with room."""
    moves = []
    for ls in sorted(rescues, key=lambda x: x.index):
        best = min(options(), key=lambda o: _unit_cost(o[0], o[1], o[2], objective), default=None)
        if best is None:
            continue
        p, d, _ = best
        free[p.slug] -= d
        why = "learner lost" if not ls.alive else f"pool {ls.pool} is not active"
        moves.append(Move(ls.index, ls.pool, p.slug, f"{why}: re-dispatched to {p.slug}", math.inf))
    return moves


def _best_move(candidates, planned: list[Move], options, objective: str, min_gain: float):
    """(gain, learner, its pool, target pool, devices) of the biggest gain above min_gain, or None."""
    best = None
    moved = {m.learner for m in planned}
    for ls, cur, c_now in candidates:
        if ls.index in moved:
            continue
        for p, d, v in options():
            if p.slug == cur.slug:
                continue
            gain = c_now / _unit_cost(p, d, v, objective) - 1.0
            if gain >= min_gain and (best is None or gain > best[0]):
                best = (gain, ls, cur, p, d)
    return best


def plan_moves(
    learners: list[LearnerStatus],
    pools: list[PoolInfo],
    objective: str = "time",
    *,
    model_memory_gib: float = 1.0,
    model_flops_per_token: float = 6e6,
    min_gain: float = 0.2,
    max_moves: int | None = None,
    devices_per_learner: int | dict[str, int] | None = None,
) -> list[Move]:
    """Moves that improve `objective` by at least `min_gain`, rescues first.

    A learner needs `devices_per_learner` devices (per pool when a dict) or, by default, as
    many as its model's memory needs (`placement.devices_needed`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    by_slug = {p.slug: p for p in pools}
    free = {p.slug: p.devices_free for p in pools if p.state == "active"}
    options = functools.partial(
        _options, pools, free, devices_per_learner, model_memory_gib, model_flops_per_token)

    rescues = [
        ls
        for ls in learners
        if not ls.alive or by_slug.get(ls.pool) is None or by_slug[ls.pool].state != "active"
    ]
    moves = _rescue_moves(rescues, options, objective, free)

    candidates = []
    for ls in learners:
        if ls in rescues:
            continue
        cur = by_slug[ls.pool]
        v_now = ls.tokens_per_s or learner_tokens_per_s(cur, ls.devices, model_flops_per_token)
        if v_now > 0:
            candidates.append((ls, cur, _unit_cost(cur, ls.devices, v_now, objective)))
    label = {"time": "faster", "energy": "less energy per token", "cost": "cheaper per token"}[objective]
    planned: list[Move] = []
    while (best := _best_move(candidates, planned, options, objective, min_gain)) is not None:
        gain, ls, cur, p, d = best
        free[p.slug] -= d
        free[cur.slug] = free.get(cur.slug, 0) + ls.devices
        planned.append(Move(ls.index, cur.slug, p.slug, f"{gain:+.0%} {label} on {p.slug}", gain))
        if max_moves is not None and len(moves) + len(planned) >= max_moves:
            break
    out = moves + planned
    return out[:max_moves] if max_moves is not None else out
