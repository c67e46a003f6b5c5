"""Clocks: the engine and the runtime loops never read time themselves, they ask a `Clock`
handed in from outside (one interface for the engine `Syncer`, `LearnerLoop` and `SyncerLoop`).

`WallClock` is what the runtime uses (the loops' default); `ManualClock` is what the tests,
`LocalRun` and the simulator (`trainer/sim/diloco.py`, which sets it to each event's virtual
time) use, so a run driven by a `ManualClock` is fully deterministic.
"""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic time line."""
        ...


class WallClock:
    """Real time (monotonic)."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError("a clock cannot go backwards")
        self._t += float(dt)
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"a clock cannot go backwards ({t} < {self._t})")
        self._t = float(t)
