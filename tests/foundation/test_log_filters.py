"""The housekeeping ticks stay out of the logs unless they did something."""
from __future__ import annotations

import logging

from celery.app.trace import LOG_RECEIVED, LOG_SUCCESS

import diloco_platform.celery  # noqa: F401  (installs the filter, as every worker and beat does)


def _lines(caplog, logger: str, msg: str, args) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        logging.getLogger(logger).info(msg, args)
    return [r.getMessage() for r in caplog.records]


def test_idle_ticks_are_dropped_busy_ones_and_other_tasks_kept(caplog):
    wd = "apps.coordinator.tasks.watchdog"
    ok = {"id": "x", "runtime": 0.01, "args": "()", "kwargs": "{}"}
    assert _lines(caplog, "celery.worker.strategy", LOG_RECEIVED, {"id": "x", "name": wd}) == []
    idle = {**ok, "name": wd, "return_value": "{'lost': 0, 'redispatched': 0, 'syncers': 0}"}
    assert _lines(caplog, "celery.app.trace", LOG_SUCCESS, idle) == []
    busy = {**ok, "name": wd, "return_value": "{'lost': 1, 'redispatched': 1, 'syncers': 0}"}
    assert len(_lines(caplog, "celery.app.trace", LOG_SUCCESS, busy)) == 1
    other = {**ok, "name": "apps.coordinator.tasks.run_syncer", "return_value": "'completed'"}
    assert _lines(caplog, "celery.app.trace", LOG_SUCCESS, other)[0].endswith("'completed'")
    received = {"id": "y", "name": other["name"]}
    assert len(_lines(caplog, "celery.worker.strategy", LOG_RECEIVED, received)) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO):
        logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)", "coordinator-rebalance",
                                              "apps.coordinator.tasks.rebalance")
        logging.getLogger("celery.beat").info("Scheduler: Sending due task %s (%s)", "mine", "apps.x.tasks.y")
    assert [r.getMessage() for r in caplog.records] == ["Scheduler: Sending due task mine (apps.x.tasks.y)"]
