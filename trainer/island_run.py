"""The engine CLI's islands: `python -m trainer train --devices-per-learner W` on one machine.

Apart from trainer.island because it starts the follower ranks (trainer.runtime.island_rank),
which import trainer.island themselves: one direction only, no import loop.
"""
from __future__ import annotations

from trainer.config import TrainConfig
from trainer.data import Corpus
from trainer.island import (
    DEFAULT_TIMEOUT_S,
    island_device,
    island_layout,
    make_groups,
    teardown,
)
from trainer.island_kind import make_island
from trainer.learner import load_corpus
from trainer.runtime.island_rank import IslandSpec, start
from trainer.train import LocalRun


def run_islands(config: TrainConfig, strategy: str = "decoupled", *, devices: int = 2,
                parallelism: str = "ddp", progress=None, corpus: Corpus | None = None,
                speeds: list[float] | None = None, timeout_s: float | None = None) -> dict:
    """The engine's local run (trainer.train.LocalRun) with every learner an island of `devices`
    processes: this process is rank 0 of all of them, each has `devices - 1` followers."""
    if strategy not in ("diloco", "decoupled"):
        raise ValueError("islands run the diloco and decoupled strategies")
    if config.batch_size % devices:
        raise ValueError(f"batch_size {config.batch_size} is not a multiple of {devices} devices")
    corpus = corpus if corpus is not None else load_corpus(config)
    layout = island_layout(config.learners, devices)
    spec = IslandSpec(config=config.to_dict(), islands=list(enumerate(layout)), parallelism=parallelism,
                      timeout_s=timeout_s or DEFAULT_TIMEOUT_S, device=island_device(config.device, 0))
    followers = start(spec)
    ok = False
    try:
        groups = make_groups(layout)
        run = LocalRun(config, strategy, corpus=corpus, speeds=speeds, progress=progress)
        run.learners = [make_island(config, m, ranks=ranks, group=groups[m], parallelism=parallelism,
                                     timeout_s=timeout_s, corpus=corpus, job=run.job)
                        for m, ranks in enumerate(layout)]
        report = run.run()
        for learner in run.learners:
            learner.stop_followers()
        ok = True
    finally:
        teardown()
        followers.close() if ok else followers.kill()
    report.update(devices_per_learner=devices, inner_parallelism=parallelism, processes=spec.world)
    return report
