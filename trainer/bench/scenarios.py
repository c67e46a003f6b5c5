"""The benchmark scenarios: fleets, declared models, failure models, and what each reports.

Every scenario trains the same proxy (`trainer.sim.proxy:micro`, byte-level, stdlib corpus)
with the real engine; the declared model, the fleet and the failure model set the virtual
clock. `quick` shrinks the run (fewer inner steps, shorter rounds, fewer evaluations) on the
same fleet, models and failure model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from trainer.config import TrainConfig, default_quorum
from trainer.placement import place, pool_from_catalogue
from trainer.sim.failures import (
    YEAR_S,
    FailureModel,
    RecoveryModel,
    elastic_goodput,
    island_failure_times,
    islands_goodput,
    lockstep_goodput,
)
from trainer.sim.fleet import DeclaredModel, PoolProfile
from trainer.sim.runner import SimSpec

PROXY = "trainer.sim.proxy:micro"
TARGET_SLACK = 0.01  # target loss = reference row's final loss x (1 + slack), same rule everywhere
# Every strategy trains on past its budget until it reaches the target, or this many times the
# reference's tokens: "to target" is a time, or "-" for "not within 3x".
TO_TARGET_CAP = 3.0


@dataclass
class Row:
    label: str
    spec: SimSpec
    strategy: str


@dataclass
class Scenario:
    name: str
    description: str
    rows: list[Row]
    reference: str  # label of the row whose final loss sets the target
    settings: dict = field(default_factory=dict)
    checks: object = None  # callable(results by label, scenario) -> list of check dicts
    summary: object = None  # callable(results by label, scenario) -> dict


def _train(steps: int, learners: int, **kw) -> TrainConfig:
    base = {
        "model": PROXY,
        "learners": learners,
        "batch_size": 8,
        "seq_len": 32,
        "steps": steps,
        "warmup_steps": 10,
        "inner_lr": 3e-3,
        "inner_prox": 25.0,  # the proxy's measured setting (the default, 0.125 / lr, would give 41.7)
        "outer_momentum": 0.9,  # the settings the committed bench results were measured with
        "outer_momentum_decay": 0,
        "final_average": False,
        "eval_batches": 4,
        "eval_batch_size": 32,
        "inner_steps": 24,
        "fragments": 4,
        "quorum": default_quorum(learners),
        "max_staleness": 4,
        "compression": "int4",
        "seed": 0,
    }
    base.update(kw)
    return TrainConfig(**base)


def _check(name: str, value, target: str, ok: bool | None, note: str = "") -> dict:
    return {"check": name, "value": value, "target": target, "met": ok, "note": note}


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


# ------------------------------------------------------------------------------------------
# chaos
# ------------------------------------------------------------------------------------------

CHAOS_RECOVERY = RecoveryModel(
    heartbeat_timeout_s=10.0, redispatch_s=5.0, job_restart_s=42.0, reconfig_s=2.0, checkpoint_interval_s=9.0
)


def chaos(quick: bool, seed: int) -> Scenario:
    M, chips = 8, 150_000  # 1.2M TPU v5p chips in 8 learner islands
    steps = 16 if quick else 144
    pool = PoolProfile("dc", "tpu-v5p", link_gbps=3200.0, latency_ms=0.5, spare_slots=0)
    island_flops = chips * 459e12 * 0.50
    model = DeclaredModel("dense-9B", 9e9, tokens_per_step=3.0 * island_flops / (6 * 9e9))  # 3 s steps
    failures = FailureModel(
        enabled=True,
        chip_mtbi_s=YEAR_S,
        straggler_mtbi_s=1800.0,
        straggler_speed=0.6,
        straggler_duration_s=60.0,
    )
    # outer lr 0.7: six outer rounds of H=24 are too few for the default 0.9, which ends at 2.522
    # and never reaches ddp's target within 3x (0.7: 2.500, 47% sooner; 0.7 strided: 2.523, 42%)
    cfg = _train(steps, M, inner_steps=8 if quick else 24, fragments=4, outer_lr=0.7)
    spec = SimSpec(
        "chaos",
        [pool],
        ["dc"] * M,
        [chips] * M,
        model,
        cfg,
        failures,
        CHAOS_RECOVERY,
        seed=seed,
        eval_points=3 if quick else 8,
        max_time_s=200_000,
        max_overrun=TO_TARGET_CAP,
    )
    calm = replace(spec, failures=FailureModel(enabled=False))
    rows = [
        Row("ddp", spec, "ddp"),
        Row("elastic-ddp", spec, "elastic-ddp"),
        Row("diloco", spec, "diloco"),
        Row("decoupled", spec, "decoupled"),
        Row("decoupled+rebalance", spec, "decoupled+rebalance"),
        Row("decoupled (no failures)", calm, "decoupled"),
    ]

    def checks(res, scn):
        d, ref = res["decoupled"], res["decoupled (no failures)"]
        rb = res["decoupled+rebalance"]
        best = max(d["goodput"], rb["goodput"])
        rel = abs(d["final_val_loss"] / ref["final_val_loss"] - 1) if d["final_val_loss"] else None
        return [
            _check("decoupled goodput", best, ">= 0.93", best >= 0.93),
            _check(
                "decoupled global downtime s", d["global_downtime_s"], "== 0", d["global_downtime_s"] == 0
            ),
            _check("ddp goodput (calibration)", res["ddp"]["goodput"], "~0.27 (paper)", None),
            _check("elastic-ddp goodput (calibration)", res["elastic-ddp"]["goodput"], "~0.58 (paper)", None),
            _check("decoupled final loss vs failure-free", rel, "<= 0.02", rel is not None and rel <= 0.02),
        ]

    def summary(res, scn):
        lam = M * chips / YEAR_S
        rec = CHAOS_RECOVERY
        dp = res["ddp"]
        lost = dp.get("lost_per_failure_s")
        w = lost if lost is not None else rec.checkpoint_interval_s / 2
        return {
            "calibration": {
                "fleet_chips": M * chips,
                "chip_mtbi_s": YEAR_S,
                "lambda_per_s": lam,
                "R_s": rec.R,
                "W_s_measured": w,
                "S_s": rec.S + rec.reconfig_s,
                "D_s": rec.D,
                "formula_ddp": 1 / (1 + lam * (rec.R + w)),
                "formula_elastic": 1 / (1 + lam * (rec.S + rec.reconfig_s)),
                "formula_decoupled": 1 / (1 + rec.D * lam / M),
                "aggregate_model_100k_s": _aggregate(M, chips, rec, seed),
                "paper": {"ddp": 0.27, "elastic-ddp": 0.58, "decoupled (paper, D~29 s)": 0.88},
                "note": (
                    "R = heartbeat timeout + job restart; W = work lost per failure (half the checkpoint "
                    "interval plus the partial step); S = heartbeat timeout + reconfiguration, plus one "
                    "more reconfiguration when the replica rejoins; D = heartbeat timeout + re-dispatch. "
                    "job_restart_s, reconfig_s and checkpoint_interval_s were chosen so the aggregate "
                    "model puts ddp and elastic-ddp at the paper's 27% and 58%; D uses the same "
                    "heartbeat timeout and a 5 s re-dispatch to a warm spare."
                ),
            }
        }

    return Scenario(
        "chaos",
        "8 learner islands x 150k TPU v5p chips (1.2M), chip MTBI 1 year, stragglers",
        rows,
        "ddp",
        {
            "learners": M,
            "chips_per_island": chips,
            "recovery": CHAOS_RECOVERY.as_dict(),
            "failures": failures.as_dict(),
            "declared_model": model.as_dict(),
            "inner_steps_per_learner": steps,
        },
        checks,
        summary,
    )


def _aggregate(M: int, chips: int, rec: RecoveryModel, seed: int, horizon: float = 100_000.0) -> dict:
    """Timing-only goodput of the same failure and recovery model over a long horizon (what the
    event simulation of one short run samples)."""
    import numpy as np

    per_island = island_failure_times(seed, [chips] * M, YEAR_S, horizon)
    all_f = np.sort(np.concatenate(per_island))
    return {
        "ddp": lockstep_goodput(all_f, horizon, rec, 3.0)["goodput"],
        "elastic-ddp": elastic_goodput(all_f, horizon, rec, M)["goodput"],
        "decoupled": islands_goodput(per_island, horizon, rec)["goodput"],
    }


# ------------------------------------------------------------------------------------------
# mixed-fleet
# ------------------------------------------------------------------------------------------


def mixed_fleet(quick: bool, seed: int) -> Scenario:
    steps = 24 if quick else 144
    pools = [
        PoolProfile("hopper", "h100-sxm", 400.0, 0.5),
        PoolProfile("ampere", "a100-80gb", 400.0, 0.5),
        PoolProfile("volta", "v100", 100.0, 0.5),
    ]
    placement = ["hopper", "hopper", "ampere", "ampere", "volta", "volta"]
    M = len(placement)
    model = DeclaredModel("dense-1B", 1e9, tokens_per_step=1e6)
    failures = FailureModel(
        enabled=True,
        chip_mtbi_s=YEAR_S,
        straggler_mtbi_s=900.0,
        straggler_speed=0.5,
        straggler_duration_s=30.0,
    )
    cfg = _train(steps, M, inner_steps=12 if quick else 24, fragments=4, quorum=3)
    spec = SimSpec(
        "mixed-fleet",
        pools,
        placement,
        [64] * M,
        model,
        cfg,
        failures,
        RecoveryModel(),
        seed=seed,
        eval_points=3 if quick else 8,
        max_overrun=TO_TARGET_CAP,
    )
    rows = [Row(s, spec, s) for s in ("ddp", "diloco", "decoupled", "decoupled+rebalance")]

    def checks(res, scn):
        rb = res["decoupled+rebalance"]
        return [
            _check(
                "decoupled+rebalance utilisation", rb["utilisation"], ">= 0.98", rb["utilisation"] >= 0.98
            ),
            _check(
                "diloco utilisation (waits for the slowest)", res["diloco"]["utilisation"], "reference", None
            ),
            _check("decoupled+rebalance goodput", rb["goodput"], "reference", None),
        ]

    return Scenario(
        "mixed-fleet",
        "2 learners each on H100, A100 and V100 islands of 64 chips, one job",
        rows,
        "ddp",
        {
            "learners": M,
            "placement": placement,
            "declared_model": model.as_dict(),
            "failures": failures.as_dict(),
            "inner_steps_per_learner": steps,
        },
        checks,
    )


# ------------------------------------------------------------------------------------------
# wan
# ------------------------------------------------------------------------------------------


def wan(quick: bool, seed: int) -> Scenario:
    # 576 inner steps per learner (5 tokens per proxy parameter): long enough that decoupled's
    # per-token gap to ddp has settled, which is what decides the time to ddp's target
    steps = 16 if quick else 576
    links = {"us-east": 1.0, "us-west": 2.0, "us-central": 3.0, "eu-west": 5.0}
    pools = [PoolProfile(slug, "h100-sxm", gbps, latency_ms=35.0) for slug, gbps in links.items()]
    M = 4
    chips = 512
    model = DeclaredModel("dense-12B", 12e9, tokens_per_step=16e6)
    # H=48: the shortest cycle that still hides its transfers on the 1 Gbit/s link (utilisation 1.0);
    # outer lr 0.7 with int4 both ways (the uncompressed default 0.9 reached the target 19.4x sooner,
    # 0.7 24.0x; H=96 16.9x; H=32 and H=24 not within 3x: docs/benchmarks.md, "wan")
    H = 8 if quick else 48
    cfg = _train(
        steps, M, inner_steps=H, fragments=4, quorum=2, compression="int4", global_compression="int4",
        outer_lr=0.7,
    )
    spec = SimSpec(
        "wan",
        pools,
        list(links),
        [chips] * M,
        model,
        cfg,
        FailureModel(enabled=False),
        RecoveryModel(),
        seed=seed,
        eval_points=3 if quick else 8,
        max_overrun=TO_TARGET_CAP,
    )
    rows = [Row(s, spec, s) for s in ("ddp", "diloco", "decoupled")]

    def checks(res, scn):
        dp, dc = res["ddp"], res["decoupled"]
        speed = _ratio(dp["time_to_target_s"], dc["time_to_target_s"])
        fewer = _ratio(dp["bytes_per_token"], dc["bytes_per_token"])
        util1 = dc["utilisation_by_pool"].get("us-east")
        return [
            _check(
                "decoupled utilisation on the 1 Gbit/s link",
                util1,
                ">= 0.95",
                util1 is not None and util1 >= 0.95,
            ),
            _check(
                "time to ddp's target loss, ddp / decoupled",
                speed,
                ">= 20",
                speed is not None and speed >= 20,
            ),
            _check(
                "bytes per token, ddp / decoupled",
                fewer,
                ">= 1000",
                fewer is not None and fewer >= 1000,
                "all bytes both ways: int4 contributions up, int4 global updates down (chains of them "
                "to a learner a few versions behind, whole fp32 fragments when cheaper)",
            ),
            _check(
                "contribution bytes per token, ddp / decoupled (up only)",
                _ratio(dp["bytes_per_token"] / 2, dc["bytes_up_per_token"]),
                "reference",
                None,
            ),
        ]

    return Scenario(
        "wan",
        "4 regions x 512 H100, links 1/2/3/5 Gbit/s, declared 12B model",
        rows,
        "ddp",
        {
            "links_gbps": links,
            "declared_model": model.as_dict(),
            "inner_steps": H,
            "inner_steps_per_learner": steps,
        },
        checks,
    )


# ------------------------------------------------------------------------------------------
# energy
# ------------------------------------------------------------------------------------------


def energy(quick: bool, seed: int) -> Scenario:
    steps = 24 if quick else 144
    M, chips = 8, 8
    model = DeclaredModel("dense-1B", 1e9, tokens_per_step=2.5e5)
    fleet = {
        "hopper": ("h100-sxm", 16),
        "ampere": ("a100-80gb", 32),
        "volta": ("v100", 32),
        "ada": ("l4", 64),
    }
    infos = [pool_from_catalogue(slug, acc, n, 100.0) for slug, (acc, n) in fleet.items()]
    kw = {
        "model_memory_gib": 12.0,
        "model_flops_per_token": model.flops_per_token,
        "tokens_per_learner": int(steps * model.tokens_per_step),
        "base_inner_steps": 24,
        "fragment_bytes": int(model.params * 4 / 4),
        "fragments": 4,
        "tokens_per_step": int(model.tokens_per_step),
        "devices_per_learner": chips,
    }
    speed_first = place(M, infos, "time", **kw)
    green = place(M, infos, "energy", **kw)
    pools = [PoolProfile(slug, acc, 100.0, 0.5, spare_slots=0) for slug, (acc, _) in fleet.items()]
    cfg = _train(steps, M, inner_steps=12 if quick else 24, fragments=4, quorum=4)

    def spec_for(pl):
        return SimSpec(
            "energy",
            pools,
            [p for _, p in pl.assignments],
            [chips] * M,
            model,
            cfg,
            FailureModel(enabled=False),
            RecoveryModel(),
            seed=seed,
            eval_points=3 if quick else 8,
        )

    rows = [
        Row("speed-first (decoupled+rebalance)", spec_for(speed_first), "decoupled+rebalance"),
        Row("energy-aware (decoupled+rebalance)", spec_for(green), "decoupled+rebalance"),
    ]

    def checks(res, scn):
        a, b = res[rows[0].label], res[rows[1].label]
        saving = 1 - b["j_per_token"] / a["j_per_token"]
        slower = b["time_s"] / a["time_s"] - 1
        return [
            _check("energy per token saved", saving, ">= 0.20", saving >= 0.20),
            _check("extra time", slower, "<= 0.10", slower <= 0.10),
        ]

    return Scenario(
        "energy",
        "8 learners x 8 chips; pools of H100, A100, V100, L4; speed-first vs energy-aware "
        "placement (placement.place, 10% time slack)",
        rows,
        rows[0].label,
        {
            "speed_first": speed_first.assignments,
            "energy_aware": green.assignments,
            "speed_first_reasons": speed_first.reasons,
            "energy_aware_reasons": green.reasons,
            "declared_model": model.as_dict(),
        },
        checks,
    )


# ------------------------------------------------------------------------------------------
# scale: the failure process of 2.4M chips over a simulated week (timing only)
# ------------------------------------------------------------------------------------------


def scale(quick: bool, seed: int) -> dict:
    chips, M = 2_400_000, 16
    week = 7 * 24 * 3600.0
    horizon = week / 7 if quick else week
    rec = CHAOS_RECOVERY
    t0 = time.perf_counter()
    per_island = island_failure_times(seed, [chips // M] * M, YEAR_S, horizon)
    import numpy as np

    all_f = np.sort(np.concatenate(per_island))
    dec = islands_goodput(per_island, horizon, rec)
    dp = lockstep_goodput(all_f, horizon, rec, step_s=3.0)
    el = elastic_goodput(all_f, horizon, rec, M)
    wall = time.perf_counter() - t0
    lam = chips / YEAR_S
    results = [
        {"strategy": "ddp", "goodput": dp["goodput"], "global_downtime_s": dp["downtime_s"]},
        {"strategy": "elastic-ddp", "goodput": el["goodput"], "global_downtime_s": el["downtime_s"]},
        {"strategy": "decoupled", "goodput": dec["goodput"], "global_downtime_s": dec["global_downtime_s"]},
    ]
    for r in results:
        r.update(
            {
                "time_to_target_s": None,
                "final_val_loss": None,
                "utilisation": None,
                "tokens": None,
                "energy_j": None,
                "bytes_sent": None,
                "uptime": 1 - r["global_downtime_s"] / horizon,
            }
        )
    return {
        "scenario": "scale",
        "seed": seed,
        "quick": quick,
        "description": f"failure process of {chips:,} chips in {M} islands over "
        f"{horizon / 86400:.0f} simulated day(s), timing only (aggregate Poisson per island)",
        "results": results,
        "checks": [
            _check("wall seconds", wall, "< 60", wall < 60),
            _check("failures simulated", int(dec["failures"]), "reference", None),
        ],
        "settings": {
            "chips": chips,
            "islands": M,
            "horizon_s": horizon,
            "lambda_per_s": lam,
            "recovery": rec.as_dict(),
            "formula_decoupled": 1 / (1 + rec.D * lam / M),
            "aggregate_model_100k_s": _aggregate(M, chips, rec, seed),
        },
        "wall_s": wall,
    }


SCENARIOS = {"chaos": chaos, "mixed-fleet": mixed_fleet, "wan": wan, "energy": energy}
ALL = ("chaos", "mixed-fleet", "wan", "energy", "scale")


def is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)
