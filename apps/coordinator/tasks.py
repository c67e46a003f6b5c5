"""Celery tasks of the runtime.

  reconcile_job(job_id)                       coordinator queue; called by apps.jobs.services
  run_learner(job_id, index, incarnation)     pool.<slug> queue; long-running, acks early
  run_island_ranks(job_id, index, inc, ...)   pool.<slug>.node.<worker> queue; the ranks of an island over
                                              several nodes on one of its nodes (apps.coordinator.island_node)
  run_syncer(job_id, epoch, shard)            syncer queue; long-running, one per job shard (its own
                                              worker: SYNCER_SLOTS threads, apps.coordinator.capacity)
  watchdog()                                  coordinator queue; beat, every second
  rebalance()                                 coordinator queue; beat, every few seconds

The coordinator queue runs only short tasks, so housekeeping never waits behind a job's syncer.

Senders use the names (diloco_platform.celery.send), never this module: it imports them.
"""
from __future__ import annotations

from celery import shared_task

from diloco_platform.celery import (
    RECONCILE_JOB,
    RUN_ISLAND_RANKS,
    RUN_LEARNER,
    RUN_SYNCER,
    SYNCER_QUEUE,
    send,
)

from .common import log


@shared_task(name=RECONCILE_JOB, ignore_result=True)
def reconcile_job(job_id: int) -> str:
    from .control import reconcile

    return reconcile(int(job_id))


@shared_task(bind=True, name=RUN_LEARNER, ignore_result=True, acks_late=False,
             time_limit=None, soft_time_limit=None, max_retries=0)
def run_learner(self, job_id: int, index: int, incarnation: int) -> str:
    from .learner import run_learner_body

    try:
        return run_learner_body(int(job_id), int(index), int(incarnation), hostname=self.request.hostname)
    except Exception:
        log.exception("learner %s.%s of job %s crashed", index, incarnation, job_id)
        raise


@shared_task(name=RUN_ISLAND_RANKS, ignore_result=True, acks_late=False, time_limit=None,
             soft_time_limit=None, max_retries=0)
def run_island_ranks(job_id: int, index: int, incarnation: int, node: int, host: str, port: int,
                     spec: str) -> str:
    from .island_node import run_island_ranks_body

    return run_island_ranks_body(int(job_id), int(index), int(incarnation), int(node), str(host), int(port),
                                 str(spec))


@shared_task(bind=True, name=RUN_SYNCER, ignore_result=True, acks_late=False,
             time_limit=None, soft_time_limit=None, max_retries=0)
def run_syncer(self, job_id: int, epoch: int, shard: int = 0) -> str:
    from .syncer import run_syncer_body

    queue = (self.request.delivery_info or {}).get("routing_key")
    if queue and queue != SYNCER_QUEUE:  # sent before syncers had a queue: never hold a housekeeping thread
        send(RUN_SYNCER, job_id, epoch, shard, queue=SYNCER_QUEUE)
        return f"forwarded to the {SYNCER_QUEUE} queue"
    try:
        return run_syncer_body(int(job_id), int(epoch), self.request.hostname or "", shard=int(shard))
    except Exception:
        log.exception("syncer shard %s of job %s (epoch %s) crashed", shard, job_id, epoch)
        raise


@shared_task(name="apps.coordinator.tasks.watchdog", ignore_result=True, expires=5)
def watchdog() -> dict:
    from .control import watchdog as tick

    return tick()


@shared_task(name="apps.coordinator.tasks.rebalance", ignore_result=True, expires=10)
def rebalance() -> dict:
    from .control import rebalance as tick

    return tick()
