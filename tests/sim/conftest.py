from __future__ import annotations

import pytest
import torch

from trainer.config import TrainConfig
from trainer.sim.failures import FailureModel, RecoveryModel
from trainer.sim.fleet import DeclaredModel, PoolProfile
from trainer.sim.runner import SimSpec

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus():
    from trainer.learner import load_corpus

    return load_corpus(TrainConfig(model="trainer.sim.proxy:micro"))


def small_spec(learners: int = 4, steps: int = 16, failures: FailureModel | None = None, **train) -> SimSpec:
    """A homogeneous fleet of H100 islands on fast links, the micro proxy model."""
    kw = {
        "model": "trainer.sim.proxy:micro",
        "learners": learners,
        "inner_steps": 4,
        "fragments": 2,
        "quorum": max(1, learners // 2),
        "batch_size": 4,
        "seq_len": 32,
        "steps": steps,
        "warmup_steps": 2,
        "eval_batches": 2,
        "compression": "int8",
    }
    kw.update(train)
    cfg = TrainConfig(**kw)
    pool = PoolProfile("dc", "h100-sxm", link_gbps=10_000.0, latency_ms=0.01)
    return SimSpec(
        "test",
        [pool],
        ["dc"] * learners,
        [1024] * learners,
        DeclaredModel("1B", 1e9, 2e8),
        cfg,
        failures or FailureModel(enabled=False),
        RecoveryModel(checkpoint_interval_s=6.0),
        seed=0,
        eval_points=2,
        max_time_s=1e6,
        wall_limit_s=120,
    )
