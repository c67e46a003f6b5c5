"""The simulator's event queue: virtual time, ties broken by push order (so runs are deterministic)."""

from __future__ import annotations

import heapq
import itertools


class EventQueue:
    """Events ordered by virtual time, then by the order they were pushed."""

    def __init__(self) -> None:
        self._h: list = []
        self._seq = itertools.count()

    def push(self, t: float, kind: str, **data) -> None:
        heapq.heappush(self._h, (t, next(self._seq), kind, data))

    def pop(self):
        return heapq.heappop(self._h)

    def __bool__(self) -> bool:
        return bool(self._h)
