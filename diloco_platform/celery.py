"""The Celery app: one queue per pool (`pool.<slug>`), a `coordinator` queue for short housekeeping
(placement, dispatch, watchdog, rebalance, fleet ticks) and a `syncer` queue for the long-running
syncer shards, served by their own worker (settings.SYNCER_SLOTS threads), so no job can hold
the threads the watchdog needs."""
from __future__ import annotations

import os
import re

from celery import Celery

from .log_filters import install as quiet_housekeeping_logs

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "diloco_platform.settings")

app = Celery("diloco_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
SYNCER_QUEUE = "syncer"
# Exact names win over patterns: run_syncer goes to the syncer queue, the rest of the
# coordinator's tasks (all short) to the coordinator queue.
app.conf.task_routes = {
    "apps.coordinator.tasks.run_syncer": {"queue": SYNCER_QUEUE},
    "apps.coordinator.tasks.*": {"queue": "coordinator"},
}
app.autodiscover_tasks()
quiet_housekeeping_logs()
# The runtime's periodic ticks (apps.coordinator): missed heartbeats -> recovery within seconds.
app.conf.beat_schedule = {
    "coordinator-watchdog": {"task": "apps.coordinator.tasks.watchdog", "schedule": 1.0,
                             "options": {"expires": 5}},
    "coordinator-rebalance": {"task": "apps.coordinator.tasks.rebalance", "schedule": 5.0,
                              "options": {"expires": 10}},
    # silent nodes lost, long-gone ones purged, pool/node history sampled (apps.inventory.tasks)
    "fleet-tick": {"task": "apps.inventory.tasks.fleet_tick",
                   "schedule": float(os.environ.get("FLEET_SAMPLE_INTERVAL_S", "10")),
                   "options": {"expires": 30}},
}


# The coordinator's tasks by name: code that sends them (apps.jobs.services, the coordinator's
# control, dispatch and learner) does not import apps.coordinator.tasks, which imports that code.
RECONCILE_JOB = "apps.coordinator.tasks.reconcile_job"
RUN_LEARNER = "apps.coordinator.tasks.run_learner"
RUN_SYNCER = "apps.coordinator.tasks.run_syncer"
RUN_ISLAND_RANKS = "apps.coordinator.tasks.run_island_ranks"


def send(name: str, *args: object, queue: str | None = None):
    """Send task `name` with `args` (routed by task_routes unless `queue` is given)."""
    return app.signature(name, args=args).apply_async(queue=queue)


def pool_queue(slug: str) -> str:
    """Name of the Celery queue served by the workers of a pool."""
    return f"pool.{slug}"


def node_queue(slug: str, worker: str) -> str:
    """Name of the queue only worker `worker` of pool `slug` consumes (apps.inventory.worker adds it):
    the ranks of a learner island over several nodes go to the nodes placement chose. A worker's
    name holds '@' (`cpu-new@host`), which the filesystem broker refuses in a queue's exchange
    name (the embedded demo's workers died at start): anything outside [A-Za-z0-9._-] becomes '_'."""
    return f"pool.{slug}.node.{re.sub(r'[^A-Za-z0-9._-]', '_', worker)}"
