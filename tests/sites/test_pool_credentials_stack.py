"""A real pool worker under its least-privilege credentials (apps.inventory.credentials) trains a
decoupled job to the end: everything a worker does fits in its grants, its rows and its ACL."""
from __future__ import annotations

import pytest
import redis

from apps.inventory.credentials import redis_user, role_name
from apps.inventory.models import Node
from apps.jobs import state as st
from apps.jobs.models import Job, Learner
from apps.jobs.services import submit_job
from tests.support.stack import Stack

from .conftest import needs_services

pytestmark = [needs_services, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TINY = {
    "name": "restricted pool", "model": "tiny", "learners": 2, "quorum": 2, "inner_steps": 8, "fragments": 1,
    "steps": 32, "batch_size": 8, "seq_len": 32, "warmup_steps": 4, "eval_interval": 4,
    "checkpoint_interval": 20, "grace_cap_s": 0.5, "seed": 1,
}


def _sessions_of(role: str) -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role])
        return cur.fetchone()[0]


def test_job_completes_on_a_pool_with_restricted_credentials(make_pool, pool_credentials, tmp_path,
                                                             django_user_model):
    pool = make_pool("remote")
    env = pool_credentials(pool.slug)
    owner = django_user_model.objects.create_user("runner", "runner@example.com", "pw-runner-123")
    with Stack(tmp_path, pools={pool.slug: 2}, pool_env={pool.slug: env}) as stack:
        worker = stack.pools[pool.slug].workers[0]
        assert stack.procs[worker].env["DATABASE_URL"] == env["DATABASE_URL"]
        stack.wait_for(lambda: Node.objects.filter(pool=pool, state=Node.State.ONLINE).exists(),
                       timeout=60, what="the restricted worker registered")
        # connected as its own role and user (the heartbeat thread's session, the broker's sockets)
        stack.wait_for(lambda: _sessions_of(role_name(pool.slug)), timeout=30, what="a session of the role")
        clients = redis.Redis.from_url(stack.redis_url).client_list()
        assert any(c.get("user") == redis_user(pool.slug) for c in clients)
        job, _ = submit_job(owner, TINY)
        stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=240, what="job end")
        log = stack.tail(worker, 2000)
    job.refresh_from_db()
    assert job.status == st.COMPLETED, f"{job.status_reason}\n{log[-4000:]}"
    assert job.outer_steps >= 2
    learners = Learner.objects.filter(job=job)
    assert {lr.pool_id for lr in learners} == {pool.pk}
    assert set(learners.values_list("state", flat=True)) == {Learner.State.DONE}
    assert "permission denied" not in log and "row-level security" not in log, log[-4000:]
