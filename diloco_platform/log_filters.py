"""Keep the coordinator's once-a-second housekeeping out of the logs while it has nothing to say.

Beat sends the watchdog every second and the rebalancer every five; Celery logs each send,
receipt and success at INFO, which buries everything else in a terminal (`make demo`) or a log
file. A tick that did something (any non-zero count in its result), or failed, is still logged.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping

HOUSEKEEPING = frozenset({"apps.coordinator.tasks.watchdog", "apps.coordinator.tasks.rebalance",
                          "apps.inventory.tasks.fleet_tick"})


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _did_nothing(result: str) -> bool:
    """`result` is Celery's repr of the return value, e.g. "{'lost': 0, 'redispatched': 0}"."""
    return all(float(n) == 0 for n in _NUMBER.findall(str(result)))


class QuietHousekeeping(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, Mapping):  # worker: "Task X[id] received" / "... succeeded in ...: result"
            if args.get("name") not in HOUSEKEEPING:
                return True
            if "return_value" in args:
                return not _did_nothing(args["return_value"])
            return "received" not in str(record.msg)
        if isinstance(args, tuple) and len(args) == 2 and args[1] in HOUSEKEEPING:  # beat: Sending due task
            return "Sending due task" not in str(record.msg)
        return True


def install() -> None:
    quiet = QuietHousekeeping()
    for name in ("celery.worker.strategy", "celery.app.trace", "celery.beat"):
        logging.getLogger(name).addFilter(quiet)
