"""The job status state machine: every allowed transition, and what users may ask, in one place."""
from __future__ import annotations

from typing import NamedTuple

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


class UserAction(NamedTuple):
    sources: frozenset[str]  # the statuses a user may ask it from
    target: str
    done: str  # past participle, for messages


# What a user may ask of a job (API, dashboard, admin, CLI alike). Narrower than TRANSITIONS,
# which also holds the runtime's own moves: queued -> placing when it places a job and
# running -> placing when it re-places one are never a user's "resume".
USER_ACTIONS: dict[str, UserAction] = {
    "cancel": UserAction(frozenset({QUEUED, PLACING, RUNNING, PAUSING, PAUSED}), CANCELLED, "cancelled"),
    "pause": UserAction(frozenset({RUNNING}), PAUSING, "paused"),
    "resume": UserAction(frozenset({PAUSED}), PLACING, "resumed"),
}


class IllegalAction(IllegalTransition):
    """A user asked for an action the job's status does not allow (the API answers 409)."""

    def __init__(self, action: str, current: str):
        spec = USER_ACTIONS[action]
        if current in TERMINAL:
            why = f"{current} is terminal"
        else:
            sources = [s for s in STATUSES if s in spec.sources]
            names = ", ".join(sources[:-1]) + " or " + sources[-1] if len(sources) > 1 else sources[0]
            why = f"only {names} jobs can be {spec.done}"
        ValueError.__init__(self, f"Cannot {action} a {current} job: {why}.")
        self.current, self.target, self.action = current, spec.target, action


def allowed_actions(current: str) -> frozenset[str]:
    """The actions a user may ask of a job in status `current` (the dashboard shows these buttons)."""
    return frozenset(name for name, a in USER_ACTIONS.items() if current in a.sources)


def check_action(action: str, current: str) -> str:
    """The status `action` moves a job in status `current` to, or IllegalAction."""
    if current not in USER_ACTIONS[action].sources:
        raise IllegalAction(action, current)
    return USER_ACTIONS[action].target
