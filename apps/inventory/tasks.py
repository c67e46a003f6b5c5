"""The fleet's housekeeping tick (beat, every FLEET_SAMPLE_INTERVAL_S, on the coordinator queue)."""
from __future__ import annotations

from celery import shared_task

FLEET_TICK = "apps.inventory.tasks.fleet_tick"


@shared_task(name=FLEET_TICK, ignore_result=True, expires=30)
def fleet_tick() -> dict:
    """Mark silent nodes lost, purge long-gone ones, sample pool and node history.

    Returns only what changed (lost, purged): the log filter keeps a tick that did nothing quiet.
    """
    from . import history, liveness

    lost = liveness.mark_silent_lost()
    purged = liveness.purge_stale()
    history.sample_fleet()
    history.forget_old()
    return {"nodes_lost": len(lost), "nodes_purged": len(purged)}
