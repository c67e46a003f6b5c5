"""The simulated wire between one learner and the shared in-memory blob store.

A learner's `LearnerLoop` talks to a `LearnerWire` as it would to the real store. What it writes
goes up its pool's link: a contribution lands in the store (where the `SyncerLoop` scans for it)
when the link model says it arrives; a checkpoint lands right behind the uploads queued before
it (the FIFO order the runtime's writer keeps, at no extra link cost, as before). What it reads
comes from the store, except the head: a learner sees a fragment's new version only once the
simulator has carried it down the link (`arrived`), so adoption happens when the download ends.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.runtime import keys
from trainer.transport import MemoryStore

Payload = bytes | Callable[[], bytes]  # the bytes, or the recipe that builds them
# (arrival time, key, payload) -> None: the simulator queues a "land" event
Schedule = Callable[[float, str, Payload], None]


class LazyStore(MemoryStore):
    """The in-memory store, which may also hold a blob as its recipe (`put_lazy`): built on the
    first read. A learner checkpoint is read only when its learner restarts, so most are never
    serialised; what is read is byte for byte what the runtime would have written."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self._lazy: dict[str, Callable[[], bytes]] = {}

    def put_lazy(self, key: str, build: Callable[[], bytes]) -> None:
        self._data.pop(key, None)
        self._lazy[key] = build

    def put(self, key: str, data: bytes) -> None:
        self._lazy.pop(key, None)
        super().put(key, data)

    def get(self, key: str) -> bytes:
        build = self._lazy.pop(key, None)
        if build is not None:
            super().put(key, build())
        return super().get(key)

    def exists(self, key: str) -> bool:
        return key in self._lazy or super().exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return sorted({*super().list(prefix), *(k for k in self._lazy if k.startswith(prefix))})

    def delete(self, key: str) -> None:
        self._lazy.pop(key, None)
        super().delete(key)


class LearnerWire:
    """The blob store as learner i sees it from the simulated fleet."""

    def __init__(self, store, job: str, now: Callable[[], float], upload: Callable[[int, float], float],
                 schedule: Schedule) -> None:
        self.store = store
        self.job = job
        self.now = now
        self.upload = upload  # (fragment, now) -> arrival time of that fragment's contribution
        self.schedule = schedule
        self.versions: dict[int, int] = {}  # fragment -> newest version carried down to this learner
        self.epochs: dict[int, int] = {}
        self.last_landing = 0.0

    # -- what the learner writes -----------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self._write(key, bytes(data))

    def put_lazy(self, key: str, build: Callable[[], bytes]) -> None:
        """A checkpoint stays a recipe (see `LazyStore`); a contribution is built at once."""
        self._write(key, build() if keys.parse_contrib_key(key) is not None else build)

    def _write(self, key: str, data: Payload) -> None:
        t = self.now()
        ref = keys.parse_contrib_key(key)
        if ref is not None:
            at = self.upload(ref.fragment, t)
        elif self.last_landing > t:
            at = self.last_landing  # behind the uploads queued before it
        else:
            land(self.store, key, data)
            return
        self.last_landing = max(self.last_landing, at)
        self.schedule(at, key, data)

    # -- what it reads ---------------------------------------------------------------------
    def arrived(self, fragment: int, version: int, epoch: int) -> None:
        """Fragment `fragment` at `version` has come down the link."""
        if version > self.versions.get(fragment, -1):
            self.versions[fragment], self.epochs[fragment] = version, epoch

    def get(self, key: str) -> bytes:
        if key == keys.head_key(self.job):
            if not self.versions:
                raise KeyError(key)
            return keys.head_blob(self.versions, self.epochs)
        return self.store.get(key)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.store.list(prefix)

    def delete(self, key: str) -> None:
        self.store.delete(key)


def land(store: LazyStore, key: str, data: Payload) -> None:
    """Put what arrived: bytes, or a recipe kept unbuilt."""
    if callable(data):
        store.put_lazy(key, data)
    else:
        store.put(key, data)
