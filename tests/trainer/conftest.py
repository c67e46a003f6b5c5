"""Fixtures of the engine tests: one thread, a shared token cache, small configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainer.config import TrainConfig
from trainer.data import Corpus

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir():
    """The token cache is keyed by a fingerprint of its inputs and written atomically, so the
    suite shares the normal one ($DILOCO_CACHE_DIR, else var/cache) instead of re-tokenising."""
    path = Path(os.environ.get("DILOCO_CACHE_DIR") or Path(__file__).resolve().parents[2] / "var" / "cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def stdlib_corpus(cache_dir):
    return Corpus.load("stdlib", cache_dir=cache_dir)


@pytest.fixture
def small_config(cache_dir):
    def make(**kw):
        base = {
            "model": "tiny",
            "learners": 2,
            "inner_steps": 4,
            "fragments": 1,
            "quorum": 1,
            "batch_size": 2,
            "seq_len": 16,
            "steps": 8,
            "warmup_steps": 2,
            "eval_batches": 2,
            "eval_batch_size": 4,
            "cache_dir": str(cache_dir),
        }
        base.update(kw)
        return TrainConfig(**base)

    return make
