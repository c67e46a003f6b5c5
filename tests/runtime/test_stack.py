"""The live-stack helper itself: processes start, serve, get killed and restarted."""
from __future__ import annotations

import json
import urllib.request

import pytest

from apps.inventory.models import Node
from apps.jobs.models import Learner
from apps.jobs.services import submit_job

from .conftest import TINY, needs_services

pytestmark = [needs_services, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_stack_serves_and_dispatches(stack, owner):
    with urllib.request.urlopen(stack.web_url + "/healthz", timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["checks"]["database"] == "ok"
    assert set(stack.pools) == {"alpha", "beta"}
    job, created = submit_job(owner, dict(TINY))
    assert created
    # reconcile on the coordinator places the learners; a pool worker picks the task up
    stack.wait_for(lambda: job.learners.count() == 2, timeout=30, what="placement")
    stack.wait_for(lambda: Node.objects.filter(learners__job=job).exists() or
                   Learner.objects.filter(job=job, node__isnull=False).exists(),
                   timeout=30, what="a learner reaching a worker")
    name = stack.pools["alpha"].workers[0]
    stack.kill_worker(name)
    assert not stack.procs[name].alive()
    stack.restart(name)
    assert stack.procs[name].alive()
