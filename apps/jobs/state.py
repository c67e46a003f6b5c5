"""The job status state machine: every allowed transition, in one place."""
from __future__ import annotations

QUEUED, PLACING, RUNNING, PAUSING, PAUSED = "queued", "placing", "running", "pausing", "paused"
COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"

STATUSES = (QUEUED, PLACING, RUNNING, PAUSING, PAUSED, COMPLETED, FAILED, CANCELLED)
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({PLACING, CANCELLED, FAILED}),
    PLACING: frozenset({RUNNING, QUEUED, CANCELLED, FAILED}),
    RUNNING: frozenset({PAUSING, COMPLETED, FAILED, CANCELLED, PLACING}),
    PAUSING: frozenset({PAUSED, CANCELLED, FAILED}),
    PAUSED: frozenset({PLACING, CANCELLED}),
    COMPLETED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """Raised when a job is asked to move to a status it cannot reach from its own."""

    def __init__(self, current: str, target: str):
        allowed = ", ".join(sorted(TRANSITIONS.get(current, ()))) or "none (terminal)"
        super().__init__(f"cannot go from {current!r} to {target!r}; allowed: {allowed}")
        self.current, self.target = current, target


def check_transition(current: str, target: str) -> None:
    if target not in STATUSES:
        raise IllegalTransition(current, target)
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(current, target)
