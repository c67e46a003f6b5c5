"""What each agent credential may write: job-level metrics (learner null) are the coordinator's;
a pool token writes only for learners placed on its own pool. Refusals never close the socket."""
from __future__ import annotations

import logging

import pytest
from channels.db import database_sync_to_async as sync_to_async

from apps.jobs.models import Learner, MetricPoint
from apps.telemetry.writer import get_writer
from diloco_platform.asgi import application  # noqa: F401  (imported once now: see test_ws_routes)

from .conftest import agent, hb, until

pytestmark = [pytest.mark.django_db(transaction=True)]


async def _points(job) -> list[tuple]:
    await get_writer().stop()
    return await sync_to_async(lambda: sorted(
        MetricPoint.objects.filter(job=job).values_list("name", "learner__index", "value")))()


def _job_level(job, value=0.001):
    return {"type": "metrics", "job": job.pk,
            "points": [{"learner": None, "name": "val_loss", "value": value}]}


async def test_pool_token_cannot_write_job_level_metrics(job, token_a, caplog):
    """Pool A serves learner 0 of the job, which is not enough to write its val_loss chart."""
    caplog.set_level(logging.WARNING, logger="apps.telemetry.consumers")
    comm, _ = await agent(token_a)
    await comm.send_json_to(_job_level(job))
    err = await until(comm, lambda m: m["type"] == "error")
    assert err["code"] == "forbidden" and err["in_reply_to"] == "metrics"
    assert "coordinator" in err["reason"] and not err.get("fatal")
    # mixed with a point of its own learner: the whole message is refused, nothing half-written
    await comm.send_json_to({"type": "metrics", "job": job.pk, "points": [
        {"learner": 0, "name": "train_loss", "value": 2.0},
        {"learner": None, "name": "val_loss", "value": 0.5}]})
    assert (await until(comm, lambda m: m["type"] == "error"))["code"] == "forbidden"
    # the socket still serves its own learner
    await comm.send_json_to(hb(job, learner=0))
    await comm.send_json_to({"type": "metrics", "job": job.pk,
                             "points": [{"learner": 0, "name": "train_loss", "value": 2.0}]})
    await until(comm, lambda m: m["type"] == "ack" and m["n"] == 4)
    await comm.disconnect()
    assert await _points(job) == [("train_loss", 0, 2.0)]
    assert await sync_to_async(lambda: Learner.objects.get(job=job, index=0).tokens)() == 1000
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(warned) == 2 and "job-level" in warned[0].getMessage()


async def test_coordinator_writes_job_level_metrics(job, coord_token):
    comm, hello = await agent(coord_token)
    assert hello["role"] == "coordinator"
    await comm.send_json_to(_job_level(job, 3.25))
    await until(comm, lambda m: m["type"] == "ack" and m["n"] == 1)
    await comm.disconnect()
    assert await _points(job) == [("val_loss", None, 3.25)]


async def test_pool_token_writes_only_for_learners_on_its_pool(job, token_a, token_b):
    """Learner 0 is on pool A, learner 1 on pool B: each token reports for its own learner only."""
    a, _ = await agent(token_a)
    b, _ = await agent(token_b)
    for comm, mine, theirs in ((a, 0, 1), (b, 1, 0)):
        await comm.send_json_to(hb(job, learner=theirs, tokens=5000))
        assert (await until(comm, lambda m: m["type"] == "error"))["code"] == "forbidden"
        await comm.send_json_to({"type": "metrics", "job": job.pk,
                                 "points": [{"learner": theirs, "name": "train_loss", "value": 9.0}]})
        assert (await until(comm, lambda m: m["type"] == "error"))["code"] == "forbidden"
        await comm.send_json_to(hb(job, learner=mine, tokens=100 + mine))
        await comm.send_json_to({"type": "metrics", "job": job.pk,
                                 "points": [{"learner": mine, "name": "train_loss", "value": 1.0 + mine}]})
        await until(comm, lambda m: m["type"] == "ack" and m["n"] == 4)
        await comm.disconnect()
    assert await _points(job) == [("train_loss", 0, 1.0), ("train_loss", 1, 2.0)]
    tokens = Learner.objects.filter(job=job).values_list("index", "tokens")
    assert await sync_to_async(lambda: dict(tokens))() == {0: 100, 1: 101}
