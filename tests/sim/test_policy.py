"""Placement and rebalancing policy (pure functions shared by the runtime and the simulator)."""

from __future__ import annotations

import math

import pytest

from trainer import catalogue
from trainer.placement import PlacementError, PoolInfo, place, pool_from_catalogue
from trainer.rebalance import LearnerStatus, plan_moves, resize_work

FLOPS_PER_TOKEN = 6 * 1e9  # a declared 1B-parameter model


def fleet():
    return [
        pool_from_catalogue("h100", "h100-sxm", devices_free=4, link_gbps=100),
        pool_from_catalogue("a100", "a100-80gb", devices_free=8, link_gbps=100),
        pool_from_catalogue("v100", "v100", devices_free=8, link_gbps=10),
        pool_from_catalogue("l4", "l4", devices_free=16, link_gbps=10),
    ]


def test_catalogue_has_the_classes_and_sane_figures():
    slugs = ("h200", "h100-sxm", "a100-80gb", "v100", "l4", "tpu-v5p", "tpu-v5e", "tpu-v4", "tpu-v6e", "cpu")
    for slug in slugs:
        a = catalogue.get(slug)
        assert a.peak_bf16_tflops > 0 and a.tdp_watts > a.idle_watts > 0 and 0 < a.mfu < 1
    with pytest.raises(KeyError, match="unknown accelerator"):
        catalogue.get("nope")


def test_resize_work_is_dylu():
    assert resize_work({0: 100.0, 1: 50.0, 2: 26.0}, 20) == {0: 20, 1: 10, 2: 5}
    assert resize_work({0: 1.0, 1: 0.001}, 10) == {0: 10, 1: 1}  # never below one step
    assert resize_work({0: 0.0, 1: None}, 8) == {0: 8, 1: 8}  # nothing measured yet: base budget
    with pytest.raises(ValueError):
        resize_work({0: 1.0}, 0)


def test_time_placement_takes_fastest_slots_first():
    p = place(
        6,
        fleet(),
        "time",
        model_memory_gib=20,
        model_flops_per_token=FLOPS_PER_TOKEN,
        tokens_per_learner=10**9,
        base_inner_steps=20,
        fragment_bytes=1 << 20,
    )
    pools = [slug for _, slug in p.assignments]
    assert pools[:4] == ["h100"] * 4 and pools[4:] == ["a100"] * 2
    assert p.work_sizes["h100"] == 20 and p.work_sizes["a100"] == math.floor(312 * 0.45 / (989 * 0.4) * 20)
    assert p.est_time_s > 0 and p.est_energy_j > 0 and p.est_cost > 0 and p.reasons


def test_memory_decides_devices_per_learner_and_refusals():
    p = place(
        2,
        fleet(),
        "time",
        model_memory_gib=100,
        model_flops_per_token=FLOPS_PER_TOKEN,
        tokens_per_learner=10**9,
        base_inner_steps=10,
        fragment_bytes=1 << 20,
    )
    assert p.devices_per_learner["h100"] == 2
    with pytest.raises(PlacementError, match="learner slot"):
        place(
            100,
            fleet(),
            "time",
            model_memory_gib=20,
            model_flops_per_token=FLOPS_PER_TOKEN,
            tokens_per_learner=10**9,
            base_inner_steps=10,
            fragment_bytes=1,
        )
    with pytest.raises(PlacementError, match="objective"):
        place(1, fleet(), "speed")
    drained = [PoolInfo(**{**vars(fleet()[0]), "state": "draining"})]
    with pytest.raises(PlacementError, match="draining"):
        place(1, drained, "time")


def test_energy_placement_saves_energy_within_time_budget():
    kw = {
        "model_memory_gib": 20,
        "model_flops_per_token": FLOPS_PER_TOKEN,
        "tokens_per_learner": 10**9,
        "base_inner_steps": 20,
        "fragment_bytes": 1 << 20,
    }
    fast = place(8, fleet(), "time", **kw)
    green = place(8, fleet(), "energy", **kw)
    assert green.est_time_s <= fast.est_time_s * 1.10 + 1e-6
    assert green.est_energy_j <= fast.est_energy_j
    cheap = place(8, fleet(), "cost", **kw)
    assert cheap.est_cost <= fast.est_cost and cheap.est_time_s <= fast.est_time_s * 1.10 + 1e-6


def test_slow_link_picks_compressed_wire():
    pools = [pool_from_catalogue("wan", "h100-sxm", devices_free=512, link_gbps=1.0, latency_ms=30)]
    p = place(
        1,
        pools,
        "time",
        model_memory_gib=20,
        model_flops_per_token=6 * 12e9,
        tokens_per_learner=10**10,
        base_inner_steps=24,
        fragment_bytes=4 * 12 * 10**9 // 24,
        fragments=24,
        tokens_per_step=4 * 10**6,
        devices_per_learner=512,
    )
    assert p.wire_dtype["wan"] in ("int8", "int4")
    lan = [pool_from_catalogue("lan", "h100-sxm", devices_free=8, link_gbps=3200)]
    q = place(
        1,
        lan,
        "time",
        model_memory_gib=20,
        model_flops_per_token=6e9,
        tokens_per_learner=10**10,
        base_inner_steps=24,
        fragment_bytes=1 << 20,
        fragments=4,
        tokens_per_step=10**6,
    )
    assert q.wire_dtype["lan"] == "none"


def test_plan_moves_rescues_lost_and_drained_then_improves():
    pools = fleet()
    pools[2].state = "draining"
    learners = [
        LearnerStatus(0, "h100", tokens_per_s=None),
        LearnerStatus(1, "a100", alive=False),
        LearnerStatus(2, "v100"),
        LearnerStatus(3, "l4", tokens_per_s=1.0),  # a straggling node: far below its pool's speed
    ]
    moves = plan_moves(learners, pools, "time", model_memory_gib=20, model_flops_per_token=FLOPS_PER_TOKEN)
    by = {m.learner: m for m in moves}
    assert by[1].to_pool == "h100" and "lost" in by[1].reason and by[1].gain == math.inf
    assert by[2].to_pool == "h100" and "not active" in by[2].reason
    assert by[3].to_pool in ("h100", "a100") and by[3].gain > 0.2
    assert 0 not in by  # already on the fastest pool
    assert (
        plan_moves(
            learners, pools, "time", model_memory_gib=20, model_flops_per_token=FLOPS_PER_TOKEN, max_moves=1
        )[0].learner
        == 1
    )


def test_plan_moves_energy_objective():
    pools = fleet()
    learners = [LearnerStatus(0, "v100")]
    (m,) = plan_moves(learners, pools, "energy", model_memory_gib=20, model_flops_per_token=FLOPS_PER_TOKEN)
    assert m.to_pool in ("h100", "l4") and "energy" in m.reason
    assert (
        plan_moves(
            [LearnerStatus(0, "h100")],
            pools,
            "energy",
            model_memory_gib=20,
            model_flops_per_token=FLOPS_PER_TOKEN,
            min_gain=0.5,
        )
        == []
    )
