"""The syncer's side of the runtime protocol: an engine `Syncer` run against a blob store.

Beside `learner_loop` (the learner's side). The loop scans the store for contributions, admits
them (ledger of token ranges, fencing of old incarnations, duplicates), merges them through the
engine and commits each outer step in this order:
  1. blob  update/ and global/f<p>/v<v>-e<epoch>      (the new global fragment)
  2. blob  syncer/s<n>-e<epoch>                       (snapshot: engine state + ledger + pending)
  3. host  `commit()`: one transaction that checks the lease and points at 1 and 2 (commit point)
  4. blob  head                                       (learners adopt only committed versions)
  5. delete the merged contributions and the previous snapshot
A loop restarted at any point resumes from the snapshot the host committed last; blobs written
after it are ignored (keys carry the writer's epoch, so a fenced syncer cannot overwrite what a
newer one committed) and the ledger in the snapshot means no contribution is applied twice.

Fencing has one rule, here (the engine does not fence): a contribution
of an older incarnation counts when its token range ends at or before the point where the
successor resumed, waits while that point is unknown, and is refused as a zombie otherwise.

Everything outside the protocol (lease, learners' incarnations, the commit transaction, events,
metrics, evaluation, exports) sits behind `SyncerHost` (`syncer_host`): the Django host in
apps.coordinator, an in-memory one in the protocol tests. `tick()` is one step, so any clock
can drive it.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainer.clock import Clock, WallClock
from trainer.protocol import Contribution, GlobalFragment, InvalidPayload

from . import codec, keys
from .syncer_host import Beat, Commit, LearnerView, LeaseLost, Resume, SyncerHost

if TYPE_CHECKING:
    from trainer.syncer import MergeResult, Syncer
    from trainer.transport import BlobStore

__all__ = ["Beat", "Commit", "LearnerView", "LeaseLost", "Ledger", "Resume", "SyncerHost", "SyncerLoop"]

log = logging.getLogger(__name__)


class Ledger:
    """Token ranges applied per (learner, fragment): the exactly-once record."""

    def __init__(self, data: dict | None = None):
        self.ranges: dict[tuple[int, int], list[list[int]]] = {}
        for k, v in (data or {}).items():
            learner, fragment = (int(x) for x in k.split(":"))
            self.ranges[(learner, fragment)] = [list(r) for r in v]

    def overlaps(self, learner: int, fragment: int, start: int, end: int) -> bool:
        if end <= start:
            return any(s <= start < e for s, e in self.ranges.get((learner, fragment), []))
        return any(start < e and s < end for s, e in self.ranges.get((learner, fragment), []))

    def add(self, learner: int, fragment: int, start: int, end: int) -> None:
        rs = self.ranges.setdefault((learner, fragment), [])
        rs.append([start, end])
        rs.sort()
        merged: list[list[int]] = []
        for s, e in rs:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        self.ranges[(learner, fragment)] = merged

    def covered(self, learner: int, fragment: int) -> int:
        return sum(e - s for s, e in self.ranges.get((learner, fragment), []))

    def to_dict(self) -> dict:
        return {f"{lr}:{fr}": v for (lr, fr), v in self.ranges.items()}


class SyncerLoop:
    """One syncer shard: with `shards` S, shard k merges the fragments p with p % S == k and
    writes its own head and snapshots; shard 0 (the leader) also evaluates, checkpoints and
    finishes the job, reading the other shards' committed fragments from the store."""

    def __init__(self, syncer: Syncer, store: BlobStore, host: SyncerHost, *, job: int | str, epoch: int,
                 shard: int = 0, shards: int = 1, eval_interval: int = 5, checkpoint_interval: int = 10,
                 heartbeat_interval: float = 0.5, clock: Clock | None = None,
                 metrics_interval: float = 1.0):
        self.syncer, self.store, self.host = syncer, store, host
        self.job, self.epoch, self.shard = job, int(epoch), int(shard)
        self.P = len(syncer.fragments)
        self.shards = max(1, min(self.P, int(shards)))
        self.mine = [p for p in range(self.P) if p % self.shards == self.shard]
        self.leader = self.shard == 0
        self.eval_interval, self.checkpoint_interval = int(eval_interval), int(checkpoint_interval)
        self.heartbeat_interval, self.metrics_interval = heartbeat_interval, metrics_interval
        self.clock = WallClock() if clock is None else clock
        self.shapes = {k: tuple(v.shape) for k, v in syncer.params.items()}
        self.ledger = Ledger()
        self.commits = 0
        self.head: dict[int, int] = {}
        self.head_epochs: dict[int, int] = {}
        self.state_key = ""
        self.seen: set[str] = set()
        self.pending: dict[str, keys.ContribRef] = {}  # key -> ref, submitted, awaiting merge
        self.fences: dict[int, LearnerView] = {}
        self.live: int | None = None
        self.counters = {"duplicates_refused": 0, "zombies_refused": 0, "rejected": 0, "accepted": 0,
                         "tokens_contributed": 0, "tokens_rejected": 0, "bytes_in": 0}
        self.timing = {"merge_s": 0.0, "blob_s": 0.0, "snapshot_s": 0.0, "db_s": 0.0}
        self.sync_seconds = self.blob_seconds = 0.0
        self.commits_here = 0
        self.last_eval_commit = self.last_ckpt_commit = 0
        self.last_metrics_at = -float("inf")
        self.last_merged_norm: float | None = None
        self.ticked_at = self.clock.now()
        self.status = ""
        self._next_beat = -float("inf")
        self._may_finish = False

    # ------------------------------------------------------------------ resume
    def start(self) -> bool:
        """Restore the last committed snapshot; True when there was one."""
        point = self.host.resume_point()
        if point is None or not point.state_key:
            return False
        snap = codec.unpack(self.store.get(point.state_key))
        self.syncer.load_state_dict(snap["syncer"])
        self.ledger = Ledger(snap["ledger"])
        for key in snap.get("pending", []):  # restored inside the engine's state too
            ref = keys.parse_contrib_key(key)
            if ref is not None:
                self.pending[key] = ref
                self.seen.add(key)
        self.counters.update(snap.get("counters", {}))
        self.commits, self.state_key = point.commits, point.state_key
        self.head, self.head_epochs = dict(point.head), dict(point.head_epochs)
        self.last_eval_commit = snap.get("last_eval_commit", self.outer_steps())
        self.last_ckpt_commit = snap.get("last_ckpt_commit", self.outer_steps())
        # learners must see the committed head (step 4 may not have happened)
        self.store.put(keys.head_key(self.job, self.shard), keys.head_blob(self.head, self.head_epochs))
        log.info("syncer shard %s of job %s resumed at commit %s (epoch %s)",
                 self.shard, self.job, self.commits, self.epoch)
        return True

    # ------------------------------------------------------------------ liveness + fencing
    def heartbeat(self) -> Beat:
        beat = self.host.beat()
        self.status = beat.status
        self.fences = dict(beat.learners)
        self.live = sum(1 for v in self.fences.values() if v.live)
        self.syncer.set_expected_learners(max(1, self.live))
        self._refence()
        return beat

    def _superseded(self, ref: keys.ContribRef) -> str | None:
        """For a contribution of an older incarnation: None when it may still be applied (it ends
        where the successor resumed, or before), 'wait' while the successor has not said where
        it resumes, 'zombie' when the successor computes those tokens again."""
        view = self.fences[ref.learner]
        if ref.incarnation >= view.incarnation:
            return None
        if view.resume_point is None:
            return "wait"
        frag_pos = view.resume_point.get("frag_pos") or {}
        limit = int(frag_pos.get(str(ref.fragment), frag_pos.get(ref.fragment, 0)))
        return "zombie" if ref.end > limit else None

    def _refence(self) -> None:
        """Pending contributions whose learner has since been restarted: the predecessor's work
        stays in the merge when the successor resumed after it; otherwise it is taken back out
        (refused as a zombie, or put back to wait for the successor's resume point)."""
        for key, ref in list(self.pending.items()):
            if ref.learner not in self.fences:
                continue
            verdict = self._superseded(ref)
            if verdict is None:
                continue
            self.syncer.withdraw((ref.learner, ref.incarnation, ref.fragment, ref.base_version))
            del self.pending[key]
            if verdict == "wait":
                self.seen.discard(key)  # scanned again once the resume point is known
            else:
                self._refuse(ref, verdict)

    def admit(self, ref: keys.ContribRef) -> str:
        """'ok' | 'wait' | a refusal reason, from fencing and the ledger."""
        view = self.fences.get(ref.learner)
        if view is None:
            return "unknown learner"
        if ref.incarnation > view.incarnation:
            return "wait"
        verdict = self._superseded(ref)
        if verdict is not None:
            return verdict
        if self.ledger.overlaps(ref.learner, ref.fragment, ref.start, ref.end):
            return "duplicate"
        for other in self.pending.values():
            if other.learner == ref.learner and other.fragment == ref.fragment and \
                    ref.start < other.end and other.start < ref.end:
                return "duplicate"
        return "ok"

    # ------------------------------------------------------------------ intake
    def scan(self) -> int:
        """Submit the new contributions of this shard's fragments; returns how many were accepted."""
        n = 0
        for key in sorted(self.store.list(keys.contrib_prefix(self.job))):
            if key in self.seen:
                continue
            ref = keys.parse_contrib_key(key)
            if ref is None or ref.fragment % self.shards != self.shard:  # another shard's fragment
                self.seen.add(key)
                continue
            verdict = self.admit(ref)
            if verdict == "wait":
                continue
            self.seen.add(key)
            if verdict != "ok":
                self._refuse(ref, verdict)
                continue
            n += self._submit(ref)
        return n

    def _submit(self, ref: keys.ContribRef) -> int:
        try:
            t0 = time.perf_counter()
            blob = self.store.get(ref.key)
            self.blob_seconds += time.perf_counter() - t0
            self.counters["bytes_in"] += len(blob)
            c = Contribution.from_bytes(blob, expected=self.syncer.expected_shapes(ref.fragment))
            if (c.learner, c.incarnation, c.fragment, c.base_version) != \
                    (ref.learner, ref.incarnation, ref.fragment, ref.base_version):
                raise InvalidPayload("payload does not match its key")
        except Exception as exc:
            self._refuse(ref, f"invalid: {exc}"[:200])
            return 0
        res = self.syncer.submit(c)
        if res.accepted:
            self.pending[ref.key] = ref
            self.counters["accepted"] += 1
            return 1
        if res.reason.startswith("duplicate"):
            self.counters["duplicates_refused"] += 1  # applied (or pending, from the snapshot)
        else:
            self._refuse(ref, res.reason)
        return 0

    def _refuse(self, ref: keys.ContribRef, reason: str) -> None:
        if reason == "duplicate":
            self.counters["duplicates_refused"] += 1
        elif reason == "zombie":
            self.counters["zombies_refused"] += 1
        else:
            self.counters["rejected"] += 1
            self.counters["tokens_rejected"] += ref.end - ref.start
        self.host.refused(ref, reason)
        with contextlib.suppress(Exception):
            self.store.delete(ref.key)

    # ------------------------------------------------------------------ merge + commit
    def merge_due(self, force: bool = False) -> int:
        """Merge and commit the fragments whose round is due (every pending one with `force`)."""
        frags = self.syncer.due() if not force else sorted({r.fragment for r in self.pending.values()})
        return sum(self._merge(p, force) for p in frags)

    def merge_short(self) -> int:
        """Fewer learners left than the quorum (the others finished or were removed): a
        fragment that holds a contribution from every live learner merges anyway, or the
        tail of the job would wait for a quorum that can no longer form."""
        if self.live is None or self.live >= self.syncer.config.quorum:
            return 0
        return sum(self._merge(p, True) for p in self.mine
                   if self.syncer.pending_count(p) >= max(1, self.live))

    def _merge(self, p: int, force: bool) -> int:
        t0 = time.perf_counter()
        try:
            result = self.syncer.merge(p, force=force)
        except ValueError as exc:  # nothing left to merge (all stale)
            log.info("job %s fragment %s: %s", self.job, p, exc)
            self._drop_stale(p, set())
            return 0
        self.commit(result, time.perf_counter() - t0)
        return 1

    def _drop_stale(self, p: int, used_keys: set[str]) -> None:
        """Pending refs of fragment p the merge left out were dropped by the staleness rule."""
        for k in [k for k, ref in self.pending.items() if ref.fragment == p and k not in used_keys]:
            self._refuse(self.pending.pop(k), "stale: dropped at merge time")

    def _take(self, r: MergeResult) -> tuple[list[keys.ContribRef], list[dict]]:
        """The blobs behind a merge's contributors, moved from pending into the ledger."""
        used, contributors = [], []
        for c in r.contributors:
            # the engine key (learner, incarnation, fragment, base version) names one blob
            match = next((k for k, ref in self.pending.items()
                          if (ref.fragment, ref.learner, ref.incarnation, ref.base_version)
                          == (r.fragment, c["learner"], c["incarnation"], c["base_version"])), None)
            rng = []
            if match is not None:
                u = self.pending.pop(match)
                used.append(u)
                rng = [[u.start, u.end]]
                self.ledger.add(u.learner, u.fragment, u.start, u.end)
            contributors.append({**{k: _jsonable(val) for k, val in c.items()}, "ranges": rng})
        self._drop_stale(r.fragment, {u.key for u in used})
        return used, contributors

    def commit(self, r: MergeResult, merge_s: float) -> Commit:
        """Steps 1-5 of the module docstring for one merge result."""
        t0 = time.perf_counter()
        p, v = r.fragment, r.version
        used, contributors = self._take(r)
        tokens_equiv = sum(u.end - u.start for u in used) // max(1, self.P)
        self.counters["tokens_contributed"] += tokens_equiv
        update = self.syncer.global_update(p)
        if update is not None:  # global_compression: learners holding v - 1 fetch this instead
            self.store.put(keys.update_key(self.job, p, v, self.epoch), update)
        blob = r.global_fragment.to_bytes("none")
        gkey = keys.global_key(self.job, p, v, self.epoch)
        self.store.put(gkey, blob)
        t_snap = time.perf_counter()
        self.timing["blob_s"] += t_snap - t0
        self.timing["merge_s"] += merge_s
        self.commits += 1
        self.head[p], self.head_epochs[p] = v, self.epoch
        snap_key = keys.syncer_state_key(self.job, self.commits, self.epoch, self.shard)
        self.store.put(snap_key, codec.pack({
            "syncer": self.syncer.state_dict(), "ledger": self.ledger.to_dict(), "counters": self.counters,
            "pending": sorted(self.pending),
            "last_eval_commit": self.last_eval_commit, "last_ckpt_commit": self.last_ckpt_commit},
            copy=False))  # the engine's state_dict() returns copies
        t_db = time.perf_counter()
        self.timing["snapshot_s"] += t_db - t_snap
        c = Commit(fragment=p, version=v, contributors=contributors, merged_norm=float(r.merged_norm),
                   duration_s=merge_s, blob_key=gkey, blob_bytes=len(blob), commits=self.commits,
                   state_key=snap_key, head=dict(self.head), head_epochs=dict(self.head_epochs),
                   counters=dict(self.counters), tokens=tokens_equiv,
                   learner_tokens=[(u.learner, (u.end - u.start) // max(1, self.P)) for u in used])
        self.host.commit(c)
        self.timing["db_s"] += time.perf_counter() - t_db
        self._after_commit(c, used, t0)
        return c

    def _after_commit(self, c: Commit, used: list[keys.ContribRef], t0: float) -> None:
        t_blob = time.perf_counter()
        old_key, self.state_key = self.state_key, c.state_key
        self.store.put(keys.head_key(self.job, self.shard), keys.head_blob(self.head, self.head_epochs))
        for u in used:
            with contextlib.suppress(Exception):
                self.store.delete(u.key)
        if old_key and old_key != c.state_key:
            with contextlib.suppress(Exception):
                self.store.delete(old_key)
        self.timing["blob_s"] += time.perf_counter() - t_blob
        self.sync_seconds += c.duration_s + (time.perf_counter() - t0)
        self.commits_here += 1
        self.last_merged_norm = c.merged_norm
        total = self.outer_steps()
        evaluate = self.leader and total - self.last_eval_commit >= self.eval_interval
        now = self.clock.now()
        metrics_due = self.leader and (evaluate or now - self.last_metrics_at >= self.metrics_interval)
        if metrics_due:
            self.last_metrics_at = now
        self.host.committed(c, total, metrics_due)
        if evaluate:
            self.last_eval_commit = total
            self.host.evaluate(self.global_state(), self.tokens())
        if self.leader and total - self.last_ckpt_commit >= self.checkpoint_interval:
            self.last_ckpt_commit = total
            self.checkpoint("periodic")

    # ------------------------------------------------------------------ views
    def outer_steps(self) -> int:
        """Outer steps of the whole job (this shard's commits when it is the only one)."""
        return self.commits if self.shards == 1 else self.host.outer_steps()

    def tokens(self) -> int:
        return int(self.counters["tokens_contributed"])

    def heads(self) -> list[tuple[dict[int, int], dict[int, int]]]:
        """(versions, epochs) committed by every shard: this one's from memory, the others'
        heads from the store."""
        out = []
        for k in range(self.shards):
            if k == self.shard:
                out.append((dict(self.head), dict(self.head_epochs)))
                continue
            try:
                out.append(keys.parse_head(self.store.get(keys.head_key(self.job, k))))
            except Exception:
                out.append(({}, {}))
        return out

    def global_state(self) -> dict[str, torch.Tensor]:
        """Every fragment's committed weights: this shard's from its engine, the other shards'
        from the global blobs their heads name."""
        state = self.syncer.global_state()
        for k, (head, epochs) in enumerate(self.heads()):
            if k == self.shard:
                continue
            for p, v in head.items():
                blob = self.store.get(keys.global_key(self.job, p, v, epochs.get(p)))
                state.update(GlobalFragment.from_bytes(blob, expected=self.syncer.expected_shapes(p)).tensors)
        return state

    def checkpoint(self, kind: str) -> None:
        versions = {str(p): v for head, _ in self.heads() for p, v in head.items()}
        self.host.checkpoint(kind, self.global_state(), self.outer_steps(),
                             dict(sorted(versions.items(), key=lambda kv: int(kv[0]))))

    def summary(self) -> dict[str, Any]:
        return {"shard": self.shard, "commits": self.commits, "commits_this_epoch": self.commits_here,
                "sync_seconds": round(self.sync_seconds, 4),
                "contribution_read_seconds": round(self.blob_seconds, 4), "epoch": self.epoch,
                **{k: round(v, 4) for k, v in self.timing.items()}, **self.counters}

    # ------------------------------------------------------------------ driving
    def tick(self) -> str | None:
        """One step: heartbeat when due, scan, merge, and finish once every learner is done.
        Returns the outcome when the loop is over, else None. Raises LeaseLost."""
        now = self.ticked_at = self.clock.now()
        if now >= self._next_beat:
            beat = self.heartbeat()
            self._next_beat = now + self.heartbeat_interval
            if beat.stop:
                self.host.stopped(beat.status)
                return f"stopped: job {beat.status}"
            self._may_finish = beat.may_finish
        self.scan()
        self.merge_due()
        self.merge_short()
        if self._may_finish and self.all_learners_finished():
            return self._finish()
        return None

    def _finish(self) -> str | None:
        self.scan()
        if self.waiting_keys():
            return None
        self.merge_due(force=True)
        if not self.leader:
            self.host.finished(self.summary(), None)
            return "completed"
        if not self.host.others_finished():
            return None  # the leader waits for the other shards to merge their last contributions
        loss = self.host.evaluate(self.global_state(), self.tokens())
        self.checkpoint("final")
        self.host.finished(self.summary(), loss)
        return "completed"

    def run(self, sleep: Callable[[float], None] = time.sleep, interval: float = 0.05) -> str:
        """Tick until the loop is over (wall clock)."""
        while True:
            outcome = self.tick()
            if outcome is not None:
                return outcome
            sleep(interval)

    def waiting_keys(self) -> bool:
        return any(k not in self.seen for k in self.store.list(keys.contrib_prefix(self.job)))

    def all_learners_finished(self) -> bool:
        return bool(self.fences) and all(v.finished for v in self.fences.values())


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float | int | str | bool) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return str(v)
