"""The failure injector: deterministic by seed, the aggregate rate, horizon-independent draws."""

from __future__ import annotations

import numpy as np

from trainer.bench.scenarios import scale
from trainer.sim.failures import (
    YEAR_S,
    FailureModel,
    FailureSchedule,
    LazyPoisson,
    RecoveryModel,
    island_failure_times,
    islands_goodput,
    lockstep_goodput,
)


def _draw(seed: int):
    fm = FailureModel(enabled=True, chip_mtbi_s=YEAR_S / 1000, pool_mtbf_s=5000.0, straggler_mtbi_s=600.0)
    s = FailureSchedule(fm, [1000, 2000, 500], ["a", "b"], seed)
    fails = [s.failures_between(i, 0.0, 20_000.0) for i in range(3)]
    slow = [[s.speed(i, t) for t in np.linspace(0, 20_000, 400)] for i in range(3)]
    pools = [s.next_pool_failure("a", 0.0), s.next_pool_failure("b", 100.0)]
    return fails, slow, pools


def test_schedule_is_deterministic_by_seed():
    a, b, c = _draw(7), _draw(7), _draw(8)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert a[1] == b[1] and a[2] == b[2]
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a[0], c[0], strict=True))
    assert any(v < 1.0 for row in a[1] for v in row)  # stragglers happen


def test_draws_do_not_depend_on_how_far_we_look():
    short = LazyPoisson(3, 1, 0, 0.01).between(-1, 5000.0)
    lp = LazyPoisson(3, 1, 0, 0.01)
    lp.next_after(50_000.0)
    assert np.array_equal(lp.between(-1, 5000.0), short)


def test_island_rate_is_chips_over_mtbi():
    chips, horizon = 150_000, 100_000.0
    (times,) = island_failure_times(0, [chips], YEAR_S, horizon)
    expected = chips / YEAR_S * horizon  # ~475
    assert abs(len(times) - expected) < 5 * expected**0.5
    assert np.all(np.diff(times) >= 0)


def test_disabled_model_has_no_events():
    s = FailureSchedule(FailureModel(enabled=False), [10**6], ["a"], 0)
    assert s.next_failure(0, 0.0) == float("inf") and s.speed(0, 10.0) == 1.0
    assert s.pool_down_until("a", 5.0) is None


def test_aggregate_goodput_ordering_and_formula():
    rec = RecoveryModel(
        heartbeat_timeout_s=10, redispatch_s=5, job_restart_s=42, reconfig_s=2, checkpoint_interval_s=9
    )
    fails = island_failure_times(1, [150_000] * 8, YEAR_S, 50_000.0)
    dec = islands_goodput(fails, 50_000.0, rec)
    lam = 1.2e6 / YEAR_S
    assert abs(dec["goodput"] - 1 / (1 + rec.D * lam / 8)) < 0.01
    assert dec["global_downtime_s"] == 0
    dp = lockstep_goodput(np.sort(np.concatenate(fails)), 50_000.0, rec, 3.0)
    assert 0.15 < dp["goodput"] < 0.4 < dec["goodput"]


def test_scale_run_is_cheap_and_reports():
    doc = scale(quick=True, seed=0)
    by = {r["strategy"]: r for r in doc["results"]}
    assert by["decoupled"]["goodput"] > by["elastic-ddp"]["goodput"] > by["ddp"]["goodput"]
    assert doc["settings"]["chips"] == 2_400_000 and doc["wall_s"] > 0
