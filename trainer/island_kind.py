"""The island of a job's `inner_parallelism`: DDP replicas (trainer.island) or FSDP2 shards
(trainer.island_fsdp, which builds on the former, hence this module above both)."""
from __future__ import annotations

from trainer.config import TrainConfig
from trainer.data import Corpus
from trainer.island import PARALLELISMS, IslandLearner
from trainer.island_fsdp import ShardedIsland


def make_island(config: TrainConfig, index: int, *, parallelism: str = "ddp", **kwargs) -> IslandLearner:
    """One rank of an island that runs `parallelism` (ddp: DDP replicas; fsdp: FSDP2 shards)."""
    if parallelism == "ddp":
        return IslandLearner(config, index, **kwargs)
    if parallelism == "fsdp":
        return ShardedIsland(config, index, parallelism="fsdp", **kwargs)
    raise ValueError(f"inner_parallelism {parallelism!r}: one of {', '.join(PARALLELISMS)}")


def follower(config: TrainConfig, index: int, ranks: list[int], group, corpus: Corpus, *,
             num_learners: int | None = None, job: str = "local", incarnation: int = 0,
             parallelism: str = "ddp", timeout_s: float | None = None) -> IslandLearner:
    return make_island(config, index, ranks=ranks, group=group, parallelism=parallelism,
                       timeout_s=timeout_s, corpus=corpus, num_learners=num_learners, job=job,
                       incarnation=incarnation)
