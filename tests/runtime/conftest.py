"""Fixtures of the runtime tests: a live stack of real processes (see tests/support/stack.py)."""
from __future__ import annotations

import os

import pytest

from tests.support.stack import Stack

needs_services = pytest.mark.skipif(
    not os.environ.get("REDIS_URL") or "postgres" not in os.environ.get("DATABASE_URL", ""),
    reason="the live stack needs PostgreSQL (DATABASE_URL) and Redis (REDIS_URL)",
)

TINY = {
    "name": "e2e tiny", "model": "tiny", "learners": 2, "quorum": 2, "inner_steps": 8, "fragments": 1,
    "steps": 64, "batch_size": 8, "seq_len": 32, "warmup_steps": 4, "eval_interval": 4,
    "checkpoint_interval": 20, "grace_cap_s": 0.5, "seed": 1,
}


@pytest.fixture
def stack(transactional_db, tmp_path):
    with Stack(tmp_path, pools={"alpha": 2, "beta": 2}) as s:
        yield s


@pytest.fixture
def owner(django_user_model):
    return django_user_model.objects.create_user("runner", "runner@example.com", "pw-runner-123")
