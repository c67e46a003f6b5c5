"""The simulator runs the real Learner/Syncer on a virtual clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.sim.conftest import small_spec
from trainer.sim.failures import YEAR_S, FailureModel
from trainer.sim.runner import STRATEGIES, run_strategy

pytestmark = pytest.mark.slow

CHAOTIC = FailureModel(
    enabled=True,
    chip_mtbi_s=YEAR_S / 1000,
    straggler_mtbi_s=20.0,
    straggler_speed=0.5,
    straggler_duration_s=3.0,
)


def _core(r):
    return (
        r["goodput"],
        r["final_val_loss"],
        r["tokens"],
        r["time_s"],
        r["energy_j"],
        r["bytes_sent"],
        [(m["t"], m["kind"]) for m in r["marks"]],
        [(c["t"], c["val_loss"]) for c in r["curve"]],
    )


def test_runs_are_deterministic_by_seed(corpus):
    spec = small_spec(failures=CHAOTIC)
    a = run_strategy(spec, "decoupled", corpus)
    b = run_strategy(spec, "decoupled", corpus)
    assert a["failures"] > 0
    assert _core(a) == _core(b)
    c = run_strategy(replace(spec, seed=1), "decoupled", corpus)
    assert [m["t"] for m in c["marks"]] != [m["t"] for m in a["marks"]]


def test_without_failures_goodput_is_about_one_for_every_strategy(corpus):
    spec = small_spec()
    for strategy in STRATEGIES:
        r = run_strategy(spec, strategy, corpus)
        assert r["goodput"] > 0.97, (strategy, r["goodput"])
        assert r["global_downtime_s"] == 0 and r["failures"] == 0
        assert r["tokens"] >= 4 * 16 * 2e8 and r["final_val_loss"] < 5.6  # trained below uniform (ln 256)


def test_homogeneous_no_failures_diloco_and_decoupled_agree(corpus):
    # same algorithm when the decoupled syncer needs every learner and the model is one fragment
    spec = small_spec(fragments=1, quorum=4)
    sync = run_strategy(spec, "diloco", corpus)
    dec = run_strategy(spec, "decoupled", corpus)
    assert dec["final_val_loss"] == pytest.approx(sync["final_val_loss"], rel=1e-3)
    # with fragments and a quorum below M they still land close
    loose = run_strategy(small_spec(), "decoupled", corpus)
    assert loose["final_val_loss"] == pytest.approx(sync["final_val_loss"], rel=0.1)


def test_a_learner_that_never_returns_does_not_stop_the_syncer(corpus):
    spec = replace(small_spec(quorum=2), kill={3: 0.5})
    r = run_strategy(spec, "decoupled", corpus)
    assert not r["wall_limited"] and r["final_val_loss"] is not None
    assert r["global_downtime_s"] == 0
    kill_t = 0.5
    assert r["time_s"] > kill_t and r["merges"] > 4 and r["tokens"] >= 4 * 16 * 2e8
    # lock-step DiLoCo (quorum = M) waits for it forever: nothing can happen any more
    stuck = run_strategy(replace(spec, max_time_s=500.0), "diloco", corpus)
    assert stuck["stuck"] and stuck["wall_limited"] and stuck["final_val_loss"] is None
    assert stuck["merges"] == 0


def test_failures_hurt_lockstep_most(corpus):
    spec = small_spec(failures=FailureModel(enabled=True, chip_mtbi_s=YEAR_S / 300))
    got = {s: run_strategy(spec, s, corpus)["goodput"] for s in ("ddp", "elastic-ddp", "decoupled")}
    assert got["ddp"] < got["elastic-ddp"] < got["decoupled"], got


def test_pool_failure_rebalancer_moves_learners_to_a_healthy_pool(corpus):
    from trainer.sim.fleet import PoolProfile

    spec = small_spec(
        failures=FailureModel(enabled=True, chip_mtbi_s=1e30, pool_mtbf_s=60.0, pool_repair_s=300.0)
    )
    pools = [
        PoolProfile("dc", "h100-sxm", 10_000.0, 0.01),
        PoolProfile("spare", "h100-sxm", 10_000.0, 0.01, spare_slots=4, whole_pool_failures=False),
    ]
    spec = replace(spec, pools=pools, placement=["dc", "dc", "spare", "spare"])
    stay = run_strategy(spec, "decoupled", corpus)
    move = run_strategy(spec, "decoupled+rebalance", corpus)
    assert stay["failures"] > 0 and not stay["moves"]
    assert move["moves"] and all(m["to"] == "spare" for m in move["moves"][:2])
    assert move["goodput"] > stay["goodput"]
    assert move["time_s"] < stay["time_s"]


def test_runs_on_to_the_target_or_to_the_cap(corpus):
    """The run-to-target rule of the bench: past its budget a strategy trains on until it reaches
    the target loss, or until max_overrun x its budget; "to target" is then a time or None."""
    spec = small_spec()
    base = run_strategy(spec, "decoupled", corpus)
    budget_tokens = base["tokens"]
    reachable = run_strategy(replace(spec, target_loss=base["final_val_loss"] * 0.995, max_overrun=3.0),
                             "decoupled", corpus)
    unreachable = run_strategy(replace(spec, target_loss=0.5, max_overrun=2.0), "decoupled", corpus)
    assert base["time_to_target_s"] is None
    assert reachable["time_to_target_s"] is not None and reachable["time_to_target_s"] > base["time_s"]
    assert reachable["final_val_loss"] == base["final_val_loss"]  # still scored at equal tokens
    assert unreachable["time_to_target_s"] is None
    last = unreachable["curve"][-1]["tokens"]
    assert 2 * budget_tokens <= last <= 2.2 * budget_tokens  # stopped at the cap
