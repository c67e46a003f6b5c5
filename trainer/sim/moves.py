"""The placement/rebalance policy applied to the simulated fleet: what the policy is told about
the pools, the moves it plans (live rebalancing and re-dispatch after a pool failure), and
relocating a learner island to its new pool."""

from __future__ import annotations

from trainer.placement import PoolInfo
from trainer.rebalance import LearnerStatus, plan_moves, resize_work
from trainer.sim.fleet import Island
from trainer.sim.state import SimRun


def pool_infos(run: SimRun, t: float) -> tuple[list[PoolInfo], dict[str, int]]:
    """PoolInfo for the policy: free devices = spare learner slots x chips of a learner island."""
    pools, chips = [], {}
    for p in run.pools.values():
        a = p.acc
        n = max((isl.chips for isl in run.islands if isl.pool.slug == p.slug), default=max(run.spec.chips))
        chips[p.slug] = n
        pools.append(
            PoolInfo(
                p.slug,
                a.slug,
                a.peak_bf16_tflops,
                a.memory_gib,
                a.tdp_watts,
                a.cost_per_device_hour,
                p.spare_slots * n,
                p.link_gbps,
                p.latency_ms,
                speed_factor=p.speed_factor,
                mfu=a.mfu,
                state="disabled" if run.sched.pool_down_until(p.slug, t) else "active",
            )
        )
    return pools, chips


def relocate(run: SimRun, i: int, to: str, step_time: list[float], reason: str, t: float) -> None:
    """Move learner island i to pool `to`: slots, island, step time and the recorded move."""
    old, new = run.islands[i].pool, run.pools[to]
    new.spare_slots -= 1
    run.pools[old.slug].spare_slots += 1
    run.islands[i] = Island(i, new, run.islands[i].chips)
    step_time[i] = run.islands[i].step_time(run.spec.model)
    run.moves.append({"t": t, "learner": i, "from": old.slug, "to": to, "reason": reason})


def resize(run: SimRun, slots: list, t: float, inner_steps: int) -> dict[int, float]:
    """DyLU work sizes from the throughput measured since the last rebalance; returns it."""
    tput = {}
    for i, s in enumerate(slots):
        if s.up and s.window_steps:
            tput[i] = s.window_steps * run.spec.model.tokens_per_step / s.window_busy
        s.window_steps, s.window_busy = 0, 0.0
    if tput:
        sizes = resize_work(tput, inner_steps)
        for i, h in sizes.items():
            if slots[i].learner.work_size != h:
                slots[i].learner.set_work_size(h)
                run.marks.append({"t": t, "kind": "work size", "learner": i, "H": h})
    return tput


def rebalance_moves(run: SimRun, slots: list, t: float, tput: dict[int, float]) -> list:
    """Moves of live learners to better pools with free slots (worth at least `min_move_gain`)."""
    pools, chips = pool_infos(run, t)
    status = [
        LearnerStatus(
            i, run.islands[i].pool.slug, tokens_per_s=tput.get(i), devices=run.islands[i].chips, alive=True
        )
        for i, s in enumerate(slots)
        if s.up
    ]
    if not status:
        return []
    return plan_moves(
        status,
        pools,
        "time",
        model_flops_per_token=run.spec.model.flops_per_token,
        min_gain=run.spec.min_move_gain,
        devices_per_learner=chips,
        model_memory_gib=0.0,
    )


def redispatch_moves(run: SimRun, slug: str, downs: list[int], t: float) -> list:
    """Where the learners of failed pool `slug` can be re-dispatched (the pool itself disabled)."""
    infos, chips = pool_infos(run, t)
    for pi in infos:
        if pi.slug == slug:
            pi.state = "disabled"
    lost = [LearnerStatus(i, slug, devices=run.islands[i].chips, alive=False) for i in downs]
    return plan_moves(
        lost,
        infos,
        "time",
        model_flops_per_token=run.spec.model.flops_per_token,
        devices_per_learner=chips,
        model_memory_gib=0.0,
    )
