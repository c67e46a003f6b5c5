"""A FIFO background writer: blobs are written in the order they were queued, off the hot loop."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_STOP = object()


class OrderedWriter:
    """put(key, bytes | callable returning bytes) is queued; a thread writes them in order.

    The queue is bounded (backpressure: the producer waits when the store is slower than it).
    A failed write is retried a few times and then reported through `errors`; later writes
    still happen (the store's own ordering keeps a checkpoint after the contributions it covers
    because both go through this one queue).
    """

    def __init__(self, store, maxsize: int = 32, retries: int = 3):
        self.store = store
        self.retries = retries
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.errors: list[str] = []
        self.bytes_written = 0
        self.write_seconds = 0.0
        self.writes = 0
        self._thread = threading.Thread(target=self._run, name="blob-writer", daemon=True)
        self._thread.start()

    def put(self, key: str, data: bytes | Callable[[], bytes],
            on_done: Callable[[], None] | None = None) -> None:
        self.q.put((key, data, on_done))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is _STOP:
                self.q.task_done()
                return
            key, data, on_done = item
            try:
                payload = data() if callable(data) else data
                for attempt in range(self.retries + 1):
                    try:
                        t0 = time.perf_counter()
                        self.store.put(key, payload)
                        self.write_seconds += time.perf_counter() - t0
                        self.bytes_written += len(payload)
                        self.writes += 1
                        break
                    except Exception as exc:
                        if attempt == self.retries:
                            raise
                        log.warning("blob write %s failed (%s), retrying", key, exc)
                        time.sleep(0.1 * (attempt + 1))
                if on_done:
                    on_done()
            except Exception as exc:
                log.exception("blob write %s failed", key)
                self.errors.append(f"{key}: {exc}")
            finally:
                self.q.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.q.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    @property
    def pending(self) -> int:
        return self.q.unfinished_tasks

    def close(self, timeout: float | None = 30) -> None:
        self.flush(timeout)
        self.q.put(_STOP)
        self._thread.join(timeout)


class InlineWriter:
    """The OrderedWriter's interface, writing at once on the caller's thread.

    For drivers that own time themselves (the simulator): a write happens at the instant the
    loop asks for it, so a run is deterministic; FIFO order is the call order. A store that
    can hold a blob's recipe (`put_lazy`, the simulator's) gets a callable payload unbuilt: it
    is serialised only if someone reads it (a learner checkpoint, read only on a restart)."""

    def __init__(self, store):
        self.store = store
        self.q: queue.Queue = queue.Queue()  # always empty: nothing is ever queued
        self.errors: list[str] = []
        self.bytes_written = 0
        self.write_seconds = 0.0
        self.writes = 0

    def put(self, key: str, data: bytes | Callable[[], bytes],
            on_done: Callable[[], None] | None = None) -> None:
        self.writes += 1
        if callable(data) and hasattr(self.store, "put_lazy"):
            self.store.put_lazy(key, data)
        else:
            payload = data() if callable(data) else data
            self.store.put(key, payload)
            self.bytes_written += len(payload)
        if on_done:
            on_done()

    def flush(self, timeout: float | None = None) -> bool:
        return True

    @property
    def pending(self) -> int:
        return 0

    def close(self, timeout: float | None = 30) -> None:
        pass
