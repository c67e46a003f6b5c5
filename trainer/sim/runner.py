"""One strategy on a simulated fleet: the real engine and runtime protocol on a virtual clock.

The learners, the syncer, the runtime loops around them (`LearnerLoop`, `SyncerLoop`: blob
layout, checkpoints and resume points, admission by ledger and fencing, commit order), the
fragment schedule, the wire format (every contribution and every global fragment is encoded
with the engine's compression and decoded and validated on arrival), the DyLU work sizes and
the placement/move policy are the production code. The
simulator only decides *when* things happen: an inner step of learner i takes
`island.step_time / straggler speed` virtual seconds, a payload takes its declared bytes
over the pool's link (FIFO per direction), failures come from `FailureSchedule`, and the
platform recovers as `RecoveryModel` says.

Strategies (same fleet, failure schedule, data and token budget):
- `ddp`: synchronous data parallel. Every replica computes one batch per step, gradients
  are all-reduced (ring, bf16, overlapped with compute: step = max(compute, comm)). Any
  failure stops everyone: heartbeat timeout + job restart from the last checkpoint (work
  since then is replayed: the simulator charges its time; the math is deterministic, so it
  does not recompute it).
- `elastic-ddp`: a failed replica is dropped after the heartbeat timeout plus a
  reconfiguration; the others go on with a smaller batch; it rejoins (another
  reconfiguration) after re-dispatch.
- `diloco`: synchronous DiLoCo: the real Learner/Syncer (through the loops) with one fragment
  and quorum M; each learner waits for the merged global weights before its next round.
- `decoupled`: Decoupled DiLoCo: P fragments, quorum K < M, learners never wait.
- `decoupled+rebalance`: the same plus live rebalancing every cycle: DyLU work sizes from
  measured throughput (`rebalance.resize_work`) and moves to better pools with free slots
  (`rebalance.plan_moves`).

The drivers live in modules with one job each: `state` (the scenario, shared run state and
result row), `dp` (the data-parallel baselines), `diloco` (the event-driven DiLoCo driver that
steps the runtime loops), `wire` (a learner's view of the store across its link), `events`
(the event queue) and `moves` (the placement/rebalance policy applied to the fleet); this
module picks one.
"""

from __future__ import annotations

from trainer.sim.diloco import run_diloco
from trainer.sim.dp import run_dp
from trainer.sim.state import SimRun, SimSpec

__all__ = ["STRATEGIES", "SimRun", "SimSpec", "run_diloco", "run_dp", "run_strategy"]

STRATEGIES = ("ddp", "elastic-ddp", "diloco", "decoupled", "decoupled+rebalance")


def run_strategy(spec: SimSpec, strategy: str, corpus=None) -> dict:
    """Run one strategy of `spec`; returns the result row (see `SimRun.result`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if corpus is None:
        from trainer.learner import load_corpus

        corpus = load_corpus(spec.train)
    if strategy in ("ddp", "elastic-ddp"):
        return run_dp(spec, corpus, elastic=strategy == "elastic-ddp")
    return run_diloco(spec, corpus, strategy)
