"""Run an engine `Learner` against a blob store: train, push contributions, adopt global fragments.

The host (the Celery task in apps.coordinator, or a benchmark) supplies liveness and control:
`host.heartbeat(stats) -> Control` is called every `heartbeat_interval` seconds; it stamps
liveness where the watchdog looks, and answers with stop / resize / hand-off requests.
It raises `Fenced` when this incarnation has been superseded (a zombie must stop at once).

Exactly-once accounting: every contribution carries the token-stream range [start, end) of
its fragment since that fragment's previous contribution. Checkpoints record, per fragment,
the end of the last contribution queued before them; the writer thread keeps the order
(contributions first, checkpoint after), so a checkpoint never claims a contribution that is
not in the store. A new incarnation resumes from the newest checkpoint and reports that
resume point; the syncer accepts older incarnations' contributions only up to it.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainer.clock import Clock, WallClock

from . import codec, keys
from .writer import OrderedWriter

log = logging.getLogger(__name__)


def device_readings(device) -> tuple[float | None, float | None]:
    """(utilisation 0..1, power in W) of a CUDA device when the driver reports them, else Nones."""
    if device is None or getattr(device, "type", "") != "cuda":
        return None, None
    try:
        import torch

        util = torch.cuda.utilization(device) / 100.0
        power = torch.cuda.power_draw(device) / 1000.0
        return util, power
    except Exception:
        return None, None


class Fenced(RuntimeError):
    """This learner incarnation is no longer the current one."""


@dataclass
class Control:
    stop: bool = False           # stop now (cancel / pause / job over); checkpoint first
    reason: str = ""
    handoff: bool = False        # stop because the learner moves elsewhere; checkpoint first
    work_size: int | None = None  # new inner steps per cycle (rebalancer)


class Host(Protocol):
    def heartbeat(self, stats: dict[str, Any]) -> Control: ...
    def resumed(self, point: dict[str, Any]) -> None: ...
    def telemetry(self, msg: dict[str, Any]) -> None: ...


@dataclass
class LoopResult:
    outcome: str  # done | stopped | handoff | fenced
    reason: str = ""
    steps: int = 0
    tokens: int = 0
    contributions: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    updates_received: int = 0  # global versions that came down as compressed updates
    seconds: float = 0.0
    train_seconds: float = 0.0
    active_seconds: float = 0.0  # from start to the end of the last step (no resume, no final wait)
    resume_point: dict = field(default_factory=dict)


class LearnerLoop:
    def __init__(self, learner, store, *, job, index: int, incarnation: int, host: Host,
                 compression: str = "none", heartbeat_interval: float = 1.0, poll_interval: float = 0.25,
                 checkpoint_interval: float = 2.0, speed_factor: float = 1.0, final_wait: float = 30.0,
                 decode_global: Callable[[bytes], Any] | None = None, clock: Clock | None = None,
                 syncer_shards: int = 1, writer=None):
        self.learner = learner
        self.syncer_shards = max(1, int(syncer_shards))
        self.store = store
        self.job = job
        self.index = index
        self.incarnation = incarnation
        self.host = host
        self.compression = compression
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.checkpoint_interval = checkpoint_interval
        self.speed_factor = max(0.01, min(1.0, float(speed_factor)))
        self.clock = WallClock() if clock is None else clock
        self.final_wait = final_wait
        self.hang_after = max(60.0, 20 * heartbeat_interval)
        self.stall_after = max(5.0, 4 * poll_interval)
        self.outstanding: dict[int, tuple[str, float, int]] = {}
        self.refused = 0
        if decode_global is None:
            from trainer.protocol import GlobalFragment

            decode_global = GlobalFragment.from_bytes
        self.decode_global = decode_global
        self.writer = OrderedWriter(store) if writer is None else writer  # sim: an InlineWriter
        self.frag_pos: dict[int, int] = {}
        self.head_versions: dict[int, int] = {}
        self.head_epochs: dict[int, int] = {}
        self.contributions = 0
        self.bytes_sent = self.bytes_received = self.updates_received = 0
        self.last_loss: float | None = None
        self.staleness = 0

    # ------------------------------------------------------------------ resume
    def resume(self) -> dict:
        """Load the newest checkpoint of an earlier incarnation (if any), adopt the newest globals."""
        point = {"tokens": 0, "frag_pos": {}, "from_incarnation": None}
        best = None
        for key in self.store.list(keys.learner_prefix(self.job, self.index)):
            inc = keys.parse_learner_ckpt_incarnation(key)
            if inc is not None and inc < self.incarnation and (best is None or inc > best[0]):
                best = (inc, key)
        if best is not None:
            try:
                saved = codec.unpack(self.store.get(best[1]))
                self._load_as_writer(saved["state"])
                self.frag_pos = {int(k): int(v) for k, v in saved["frag_pos"].items()}
                point = {"tokens": int(saved["tokens"]), "frag_pos": dict(self.frag_pos),
                         "from_incarnation": best[0]}
                self._track_sends(best[0])
            except Exception:
                log.exception("checkpoint %s unreadable; starting from the global weights", best[1])
                self.frag_pos = {}
        self.host.resumed(point)
        self.poll_globals(force=True)
        if best is not None:
            for p in range(len(getattr(self.learner, "fragments", []))):
                if self.learner.outstanding(p) and p not in self.outstanding:
                    # its blob is gone and no newer version came: the syncer refused it, so that
                    # progress is still only local and goes out with the next contribution
                    self.learner.refused(p)
        return point

    def _load_as_writer(self, state: dict) -> None:
        """Load a checkpoint as the incarnation that wrote it, then take this one.

        The checkpoint remembers the sends queued before it; the syncer accepts them (up to the
        resume point) and usually has merged them already. Loaded as a new incarnation the engine
        would forget them and count that progress as unsent: adopting the global that merged it
        would mix it in a second time and the next contribution would carry it again. Loaded as
        the writer, adopting mixes in only the progress made after the sends."""
        mine = self.learner.incarnation
        self.learner.incarnation = int(state.get("incarnation", mine))
        try:
            self.learner.load_state_dict(state)
        finally:
            self.learner.incarnation = mine
        for c in self.learner.due_contributions():  # built but never queued: still local progress
            self.learner.refused(c.fragment)

    def _track_sends(self, incarnation: int) -> None:
        """Watch the checkpoint's sends that are still in the store like this incarnation's own
        (a refused one is re-adopted away after `stall_after`, see `_unblock_refused`)."""
        waiting = {p for p in range(len(getattr(self.learner, "fragments", [])))
                   if self.learner.outstanding(p)}
        if not waiting:
            return
        for key in self.store.list(keys.contrib_prefix(self.job)):
            ref = keys.parse_contrib_key(key)
            if ref is not None and ref.learner == self.index and ref.incarnation == incarnation \
                    and ref.fragment in waiting and ref.end == self.frag_pos.get(ref.fragment):
                self.outstanding[ref.fragment] = (key, self.clock.now(), ref.base_version)

    # ------------------------------------------------------------------ globals
    def poll_globals(self, force: bool = False) -> int:
        """Adopt committed global fragments newer than what this learner has; returns how many."""
        read = self._read_head()
        if read is None:
            return 0
        head, epochs = read
        self.head_epochs = epochs
        adopted = 0
        have = getattr(self.learner, "adopted_versions", {}) or {}
        for p, v in head.items():
            self.head_versions[p] = v
            if v > have.get(p, -1):
                try:
                    gs = self._fetch_global(p, v, epochs.get(p), have.get(p, -1))
                except Exception:
                    log.warning("global fragment %s v%s unreadable", p, v, exc_info=True)
                    continue
                if gs[0].is_update:
                    self.learner.adopt_updates(gs)
                else:
                    self.learner.adopt(gs[0])
                adopted += 1
        if self.head_versions:
            self.staleness = max((self.head_versions.get(p, 0) - have.get(p, 0)) for p in self.head_versions)
        self._unblock_refused(head)
        return adopted

    def _read_head(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """Committed versions of every fragment: one head per syncer shard (each holds its own
        fragments; a shard that has not written one yet contributes nothing). None: no head."""
        head: dict[int, int] = {}
        epochs: dict[int, int] = {}
        found = False
        for key in keys.head_keys(self.job, self.syncer_shards):
            try:
                h, e = keys.parse_head(self.store.get(key))
            except Exception:
                continue
            found = True
            head.update(h)
            epochs.update(e)
        return (head, epochs) if found else None

    def _fetch_global(self, p: int, v: int, epoch: int | None, have: int) -> list:
        """The compressed updates from the version this learner holds to v, when the job publishes
        updates and the chain costs less than the whole fp32 fragment; else [the whole fragment]."""
        if 0 <= have < v:
            chain = self._fetch_updates(p, have, v, epoch)
            if chain is not None:
                self.bytes_received += sum(map(len, chain))
                self.updates_received += len(chain)
                return [self.decode_global(b) for b in chain]
        blob = self.store.get(keys.global_key(self.job, p, v, epoch))
        self.bytes_received += len(blob)
        return [self.decode_global(blob)]

    def _fetch_updates(self, p: int, have: int, v: int, epoch: int | None) -> list[bytes] | None:
        """Update blobs have+1 .. v (None when one is missing, e.g. written under an earlier
        syncer epoch, or when they would outweigh the whole fragment: judged from the first)."""
        whole = None
        shapes = getattr(self.learner, "expected_shapes", None)
        if shapes is not None:
            whole = 4 * sum(math.prod(s) for s in shapes(p).values())
        chain: list[bytes] = []
        for u in range(have + 1, v + 1):
            try:
                blob = self.store.get(keys.update_key(self.job, p, u, epoch))
            except KeyError:
                return None
            if v - have > 1 and (whole is None or len(blob) * (v - have) >= whole):
                return None
            chain.append(blob)
        return chain

    def _unblock_refused(self, head: dict) -> None:
        """A fragment whose contribution the syncer refused (its blob is gone, no newer version
        came) would never send again: the engine waits for an answer. After `stall_after`
        seconds re-adopt the committed version, which drops the refused progress from the local
        weights and re-enables sending (the refused tokens count as lost work)."""
        now = self.clock.now()
        have = getattr(self.learner, "adopted_versions", None)
        if have is None or self.writer.pending:
            return
        for p, (key, t_push, base) in list(self.outstanding.items()):
            if have.get(p, 0) > base or not getattr(self.learner, "outstanding", lambda p: False)(p):
                del self.outstanding[p]
                continue
            if now - t_push < self.stall_after or self.store.exists(key):
                continue
            v = int(head.get(p, have.get(p, 0)))
            try:
                key = keys.global_key(self.job, p, v, self.head_epochs.get(p))
                g = self.decode_global(self.store.get(key)) if v > 0 else None
            except Exception:
                continue
            if g is None:
                continue
            have[p] = v - 1  # let the engine adopt the same committed version again
            self.learner.adopt(g)
            self.refused += 1
            del self.outstanding[p]
            log.info("learner %s: contribution %s was refused; re-adopted fragment %s v%s",
                     self.index, key, p, v)

    # ------------------------------------------------------------------ contributions
    def push_due(self) -> int:
        due = self.learner.due_contributions()
        for c in due:
            self._push(c)
        return len(due)

    def _push(self, c) -> None:
        pos = int(self.learner.tokens)
        start = self.frag_pos.get(c.fragment, 0)
        if start >= pos:
            return
        key = keys.contrib_key(self.job, self.index, self.incarnation, c.fragment, c.base_version, start, pos)
        compression = self.compression

        def encode() -> bytes:  # in the writer thread: the contribution's tensors are its own copies
            blob = c.to_bytes(compression)
            self.bytes_sent += len(blob)
            return blob

        self.writer.put(key, encode)
        self.outstanding[c.fragment] = (key, self.clock.now(), c.base_version)
        self.frag_pos[c.fragment] = pos
        self.contributions += 1

    def finish(self, wait: float | None = None) -> None:
        """Contribute the last progress of every fragment.

        A fragment whose previous contribution is still unanswered cannot send again until a
        newer global version is adopted, so wait (bounded) for those answers first. The bound
        (`final_wait`, 30 s) outlasts a syncer restart, so a learner that reaches its budget
        while the coordinator is down still contributes its last progress instead of losing it.
        """
        self.push_due()
        wait = self.final_wait if wait is None else wait
        deadline = self.clock.now() + wait
        while True:
            self.poll_globals()
            if hasattr(self.learner, "flush"):
                for c in self.learner.flush():
                    self._push(c)
            outstanding = [p for p in range(len(getattr(self.learner, "fragments", [])))
                           if getattr(self.learner, "outstanding", lambda p: False)(p)
                           and self._unsent(p)]
            if not outstanding or self.clock.now() >= deadline:
                break
            time.sleep(self.poll_interval / 2)
        self.checkpoint()

    def _unsent(self, p: int) -> bool:
        """Progress made on fragment p after its last contribution."""
        return int(self.learner.tokens) > self.frag_pos.get(p, 0)

    def checkpoint(self) -> None:
        state = {"state": self.learner.state_dict(), "frag_pos": dict(self.frag_pos),
                 "tokens": int(self.learner.tokens), "incarnation": self.incarnation}
        # state_dict() hands out copies (training goes on): encoded as they are, in the writer
        self.writer.put(keys.learner_ckpt_key(self.job, self.index, self.incarnation),
                        lambda: codec.pack(state, copy=False))

    # ------------------------------------------------------------------ heartbeat thread
    def _stats(self, steps: int) -> dict[str, Any]:
        now = self.clock.now()
        self._tok_window.append((now, int(self.learner.tokens), self._train_s))
        self._tok_window = self._tok_window[-8:]
        dt = self._tok_window[-1][0] - self._tok_window[0][0]
        tps = (self._tok_window[-1][1] - self._tok_window[0][1]) / dt if dt > 0 else None
        # utilisation: share of wall time spent inside engine steps (on GPUs the device's own
        # figure when the driver reports it)
        util = (self._tok_window[-1][2] - self._tok_window[0][2]) / dt if dt > 0 else None
        dev_util, power = device_readings(getattr(self.learner, "device", None))
        return {"step": int(getattr(self.learner, "inner_steps", steps)), "util": dev_util if dev_util
                is not None else (min(1.0, util) if util is not None else None), "power_w": power,
                "tokens": int(self.learner.tokens), "loss": self.last_loss, "tokens_per_s": tps,
                "staleness": self.staleness, "contributions": self.contributions,
                "bytes_sent": self.bytes_sent, "writer_pending": self.writer.pending}

    def _beat_once(self) -> None:
        try:
            ctl = self.host.heartbeat(self._latest_stats)
        except Fenced as exc:
            self._fenced = str(exc)
            return
        except Exception:
            log.warning("heartbeat failed", exc_info=True)
            return
        self._ctl = ctl

    def _beat_loop(self) -> None:
        """Liveness and control off the training thread (a slow DB never slows a step), but only
        while training advances: a hung loop stops the stamps and the watchdog takes over."""
        while not self._beat_stop.wait(self.heartbeat_interval):
            if self.clock.now() - self._last_progress > self.hang_after:
                continue
            self._beat_once()
            if self._fenced:
                return
        close = getattr(self.host, "close", None)
        if close:
            close()

    # ------------------------------------------------------------------ main loop
    def _take_control(self) -> Control | None:
        """The newest control message: from the heartbeat thread, else pushed by the host."""
        ctl, self._ctl = self._ctl, None
        pushed = getattr(self.host, "take_control", None)
        if ctl is None and pushed is not None:
            ctl = pushed()
        return ctl

    def _should_stop(self, result: LoopResult, max_seconds: float | None) -> bool:
        """Apply control and end conditions before the next step; True ends the loop."""
        if self._fenced:
            raise Fenced(self._fenced)
        ctl = self._take_control()
        if ctl is not None:
            if ctl.work_size:
                self.learner.set_work_size(int(ctl.work_size))
            if ctl.stop or ctl.handoff:
                self.checkpoint()
                result.outcome = "handoff" if ctl.handoff else "stopped"
                result.reason = ctl.reason
                return True
        now = self.clock.now()
        if getattr(self.learner, "done", False):
            result.active_seconds = now - self._t_start
            self.finish()
            result.outcome = "done"
            return True
        if max_seconds is not None and now - self._t_start > max_seconds:
            result.outcome = "stopped"
            result.reason = "time limit"
            return True
        return False

    def tick(self) -> None:
        """One inner step, then what falls due after it: contributions, checkpoint, globals, stats."""
        t0 = self.clock.now()
        res = self.learner.step()
        t1 = self.clock.now()
        self._train_s += t1 - t0
        self._steps += 1
        self._last_progress = t1
        self.last_loss = float(res.loss)
        if self.speed_factor < 1.0:
            time.sleep((t1 - t0) * (1.0 / self.speed_factor - 1.0))
        if self.push_due() and self.clock.now() - self._last_ckpt >= self.checkpoint_interval:
            # a checkpoint right behind the contributions (same FIFO): a successor resumes
            # exactly after what this incarnation contributed
            self.checkpoint()
            self._last_ckpt = self.clock.now()
        if self.clock.now() >= self._next_poll:
            self.poll_globals()
            self._next_poll = self.clock.now() + self.poll_interval
        if t1 - self._last_stats >= self.heartbeat_interval / 2:
            self._latest_stats = self._stats(self._steps)
            self._last_stats = t1

    def _drop_queued(self) -> None:
        """A zombie writes nothing more: drop whatever is still queued."""
        while not self.writer.q.empty():
            try:
                self.writer.q.get_nowait()
                self.writer.q.task_done()
            except Exception:
                break

    def begin(self) -> float:
        """Reset the counters, send the first sign of life: `run()` or a stepping driver calls it."""
        t_start = self._t_start = self.clock.now()
        self._next_poll = t_start + self.poll_interval
        self._last_ckpt = t_start
        self._last_stats = t_start
        self._steps = 0
        self._train_s = 0.0
        self._tok_window = [(t_start, int(self.learner.tokens), 0.0)]
        self._latest_stats = self._stats(0)
        self._last_progress = t_start
        self._ctl = None
        self._fenced = None
        self._beat_once()  # first sign of life before the first step
        return t_start

    def run(self, max_seconds: float | None = None) -> LoopResult:
        import threading

        t_start = self.begin()
        self._beat_stop = threading.Event()
        beat = threading.Thread(target=self._beat_loop, name=f"heartbeat-{self.index}", daemon=True)
        beat.start()
        result = LoopResult(outcome="done")
        try:
            while not self._should_stop(result, max_seconds):
                self.tick()
        except Fenced as exc:
            result.outcome = "fenced"
            result.reason = str(exc)
            self._drop_queued()
        finally:
            self._beat_stop.set()
        if result.outcome != "fenced":
            # last word: final counters (the host marks the learner's end state itself)
            self._latest_stats = self._stats(self._steps)
            beat.join(timeout=10)
            self._beat_once()
        else:
            beat.join(timeout=10)
        self.writer.close(timeout=60)
        result.steps = self._steps
        result.tokens = int(self.learner.tokens)
        result.contributions = self.contributions
        result.bytes_sent = self.bytes_sent
        result.bytes_received = self.bytes_received
        result.updates_received = self.updates_received
        result.seconds = self.clock.now() - t_start
        result.train_seconds = self._train_s
        return result
