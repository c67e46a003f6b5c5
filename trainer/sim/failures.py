"""Failure injection: chip interruptions, correlated pool failures, stragglers, repairs.

Everything is drawn up front from `numpy.random.default_rng([seed, stream, island])`, so
the schedule of one island depends only on the seed and that island's size: every
strategy of a scenario meets exactly the same failures at the same virtual times.

Model (per learner island of n chips, chip mean time between interruptions MTBI):
- chip interruptions of the island form a Poisson process of rate n / MTBI (the
  superposition of n independent chips), so we sample island failure times from the
  aggregate rate instead of simulating chips: this is what makes 2.4 million chips cheap;
- correlated failures: each pool fails as a whole (power, network, rack row) as a Poisson
  process of rate 1 / pool_mtbf_s and stays down for pool_repair_s: every learner placed
  on it goes down at once;
- stragglers: each island turns slow as a Poisson process of rate 1 / straggler_mtbi_s,
  runs at `straggler_speed` of its speed for straggler_duration_s;
- repair: a failed host returns to the pool's spares after repair_s (used to decide
  whether a spare is available when the platform re-dispatches).

The platform's recovery is described by `RecoveryModel`; the simulator charges it the
same way for every strategy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

YEAR_S = 365.25 * 24 * 3600


@dataclass
class FailureModel:
    enabled: bool = True
    chip_mtbi_s: float = YEAR_S  # mean time between interruptions of one chip
    pool_mtbf_s: float | None = None  # correlated whole-pool failures (None = off)
    pool_repair_s: float = 1800.0
    straggler_mtbi_s: float | None = None  # per island (None = off)
    straggler_speed: float = 0.5
    straggler_duration_s: float = 60.0
    repair_s: float = 4 * 3600.0  # a failed host back in the spares

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RecoveryModel:
    """How the platform recovers (same for every strategy).

    - heartbeat_timeout_s: the watchdog declares a learner/replica lost after this;
    - redispatch_s: start a learner on a healthy node and load its state (the learner's
      checkpoint plus the newest global fragments);
    - job_restart_s: lock-step data-parallel restarts the whole job (all replicas
      re-initialise, rebuild collectives, load the last checkpoint);
    - reconfig_s: elastic data-parallel rebuilds its collectives without a failed replica
      (and again when it rejoins);
    - checkpoint_interval_s: data-parallel checkpoint period (work since the last
      checkpoint is lost on a restart); checkpoints are written asynchronously.
    """

    heartbeat_timeout_s: float = 10.0
    redispatch_s: float = 5.0
    job_restart_s: float = 30.0
    reconfig_s: float = 5.0
    checkpoint_interval_s: float = 60.0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def R(self) -> float:  # noqa: N802 - the name used in METHOD.md section 7
        return self.heartbeat_timeout_s + self.job_restart_s

    @property
    def S(self) -> float:  # noqa: N802
        return self.heartbeat_timeout_s + self.reconfig_s

    @property
    def D(self) -> float:  # noqa: N802
        return self.heartbeat_timeout_s + self.redispatch_s


def poisson_times(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray:
    """Sorted event times of a Poisson process of `rate` (/s) on [start, end), vectorised."""
    if rate <= 0 or end <= start:
        return np.zeros(0)
    n = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, size=n))


CHUNK_S = 3600.0
MAX_LOOKAHEAD_S = 1000 * CHUNK_S


class LazyPoisson:
    """Event times of a Poisson process drawn chunk by chunk (CHUNK_S seconds each) from
    `default_rng([seed, stream, index, chunk])`: the times do not depend on how far a run
    looks ahead, so every strategy sees the same events however long it takes."""

    def __init__(self, seed: int, stream: int, index: int, rate: float) -> None:
        self.key = (seed, stream, index)
        self.rate = rate
        self.times = np.zeros(0)
        self.upto = 0.0
        self._k = 0

    def _grow(self) -> None:
        rng = np.random.default_rng([*self.key, self._k])
        chunk = poisson_times(rng, self.rate, self._k * CHUNK_S, (self._k + 1) * CHUNK_S)
        self.times = np.concatenate([self.times, chunk])
        self._k += 1
        self.upto = self._k * CHUNK_S

    def ensure(self, t: float) -> None:
        while self.upto <= t:
            self._grow()

    def next_after(self, t: float) -> float:
        if self.rate <= 0:
            return float("inf")
        self.ensure(t)
        while True:
            i = int(np.searchsorted(self.times, t, side="right"))
            if i < len(self.times):
                return float(self.times[i])
            if self.upto > t + MAX_LOOKAHEAD_S:
                return float("inf")  # nothing within the look-ahead: treated as never
            self._grow()

    def last_at_or_before(self, t: float) -> float | None:
        if self.rate <= 0:
            return None
        self.ensure(t)
        i = int(np.searchsorted(self.times, t, side="right")) - 1
        return float(self.times[i]) if i >= 0 else None

    def between(self, a: float, b: float) -> np.ndarray:
        if self.rate <= 0:
            return np.zeros(0)
        self.ensure(b)
        return self.times[np.searchsorted(self.times, a, side="right") : np.searchsorted(self.times, b)]


class FailureSchedule:
    """Chip failures and straggler windows per learner slot, whole-pool failures per pool."""

    def __init__(self, model: FailureModel, island_chips: list[int], pools: list[str], seed: int) -> None:
        self.model = model
        self.seed = seed
        on = model.enabled
        self.fail = [
            LazyPoisson(seed, 1, i, n / model.chip_mtbi_s if on else 0.0) for i, n in enumerate(island_chips)
        ]
        srate = 1.0 / model.straggler_mtbi_s if on and model.straggler_mtbi_s else 0.0
        self.slow = [LazyPoisson(seed, 2, i, srate) for i in range(len(island_chips))]
        prate = 1.0 / model.pool_mtbf_s if on and model.pool_mtbf_s else 0.0
        self.pool = {slug: LazyPoisson(seed, 3, j, prate) for j, slug in enumerate(sorted(set(pools)))}

    def next_failure(self, island: int, t: float) -> float:
        return self.fail[island].next_after(t)

    def failures_between(self, island: int, a: float, b: float) -> np.ndarray:
        return self.fail[island].between(a, b)

    def speed(self, island: int, t: float) -> float:
        s = self.slow[island].last_at_or_before(t)
        if s is not None and t < s + self.model.straggler_duration_s:
            return self.model.straggler_speed
        return 1.0

    def next_pool_failure(self, slug: str, t: float) -> float:
        lp = self.pool.get(slug)
        return lp.next_after(t) if lp is not None else float("inf")

    def pool_down_until(self, slug: str, t: float) -> float | None:
        """End of the outage of pool `slug` covering time t, if any."""
        lp = self.pool.get(slug)
        if lp is None:
            return None
        f = lp.last_at_or_before(t)
        if f is not None and t < f + self.model.pool_repair_s:
            return f + self.model.pool_repair_s
        return None


# --------------------------------------------------------------------------------------------
# Aggregate (timing-only) model: used for the 2.4M-chip scale run and for calibration.
# --------------------------------------------------------------------------------------------


def island_failure_times(
    seed: int, island_chips: list[int], chip_mtbi_s: float, horizon_s: float
) -> list[np.ndarray]:
    """The same chip-failure times as `FailureSchedule` (same streams), up to `horizon_s`."""
    return [
        LazyPoisson(seed, 1, i, n / chip_mtbi_s).between(-1.0, horizon_s) for i, n in enumerate(island_chips)
    ]


def lockstep_goodput(fail_times: np.ndarray, horizon_s: float, rec: RecoveryModel, step_s: float) -> dict:
    """Lock-step data parallel: any failure stops the job for R and loses the work since the last
    checkpoint (taken every checkpoint_interval_s of progress, on step boundaries). Failures
    that strike during a restart are absorbed by it (the restart swaps the broken hosts)."""
    t, useful, down, lost = 0.0, 0.0, 0.0, 0.0
    ckpt_every = max(step_s, round(rec.checkpoint_interval_s / step_s) * step_s)
    for f in fail_times:
        if f < t:
            continue  # absorbed by the restart in progress
        run = f - t  # progress since the restart, which resumed from the last checkpoint
        kept = np.floor(run / ckpt_every) * ckpt_every
        useful += kept
        lost += run - kept
        down += rec.R
        t = f + rec.R
        if t >= horizon_s:
            break
    if t < horizon_s:
        useful += horizon_s - t
    return {
        "goodput": useful / horizon_s,
        "downtime_s": down,
        "lost_s": lost,
        "failures": int(len(fail_times)),
    }


def elastic_goodput(fail_times: np.ndarray, horizon_s: float, rec: RecoveryModel, replicas: int) -> dict:
    """Elastic data parallel: every failure stalls everyone for S (drop) and the replica's later
    rejoin costs another reconfig_s; the replica is out for D meanwhile."""
    stall = 0.0
    t_end = 0.0
    out_time = 0.0
    for f in fail_times:
        if f < t_end:
            continue
        stall += rec.S + rec.reconfig_s
        out_time += rec.D
        t_end = f + rec.S
    active = max(0.0, horizon_s - stall)
    goodput = (active - out_time / replicas) / horizon_s
    return {"goodput": max(0.0, goodput), "downtime_s": stall}


def islands_goodput(per_island: list[np.ndarray], horizon_s: float, rec: RecoveryModel) -> dict:
    """Decoupled learners: an island that fails is out for D (failures during the outage are
    absorbed); nobody else stops. Global downtime = time during which every island is out."""
    intervals = []
    avail = []
    for fails in per_island:
        busy_until = -1.0
        down = 0.0
        for f in fails:
            if f < busy_until:
                continue
            end = min(horizon_s, f + rec.D)
            intervals.append((f, end))
            down += end - f
            busy_until = f + rec.D
        avail.append(1 - down / horizon_s)
    # global downtime: all islands out at once (sweep line)
    m = len(per_island)
    pts = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    depth, last, glob = 0, 0.0, 0.0
    for x, d in pts:
        if depth >= m:
            glob += x - last
        depth += d
        last = x
    return {
        "goodput": float(np.mean(avail)) if avail else 1.0,
        "global_downtime_s": glob,
        "failures": int(sum(len(f) for f in per_island)),
    }
