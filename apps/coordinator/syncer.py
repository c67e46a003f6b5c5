"""The syncer task body: the engine's Syncer for one job, wired to the blob store and the database.

Commit of an outer step (fragment p, version v), in this order:
  1. blob  jobs/<job>/global/f<p>/v<v>-e<epoch>        (the new global fragment)
  2. blob  jobs/<job>/syncer/s<n>-e<epoch>             (snapshot: syncer state + ledger)
  3. DB    one transaction: lease epoch check, OuterStep row, lease.commits/state_key/head,
           job counters                                 (the commit point)
  4. blob  jobs/<job>/head                             (learners adopt only committed versions)
  5. delete the merged contribution blobs
A syncer restarted at any point resumes from the snapshot of the last committed row; blobs
written after it are ignored (keys carry the writer's epoch, so a fenced syncer cannot overwrite
what a newer one committed), and the ledger of applied token ranges (per
learner and fragment) in the snapshot means no contribution is ever applied twice.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from datetime import timedelta

import torch
from django.db import close_old_connections, transaction
from django.db.models import F, Q, Sum, Value
from django.db.models.functions import Greatest

from apps.jobs import state as st
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner, MetricPoint, OuterStep
from trainer.runtime import codec, keys

from .common import corpus, event, hb_interval, hb_timeout, log, now, publish, store, train_config
from .models import LearnerRuntime, SyncerLease

ACTIVE_JOB = (st.RUNNING, st.PAUSING)
DEVICES_PER_LEARNER = 1  # one learner per device slot (dispatch.pool_capacity)
METRIC_EVERY_S = 1.0  # goodput / bytes_sent points: at most one pair per second of commits


class LeaseLost(RuntimeError):
    pass


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


class SyncerRun:
    """One syncer shard of a job. With `syncer_shards` S, shard k merges the fragments p with
    p % S == k and writes its own head and snapshots; shard 0 (the leader) also evaluates,
    checkpoints, accounts and finishes the job, reading the other shards' committed fragments
    from the store."""

    def __init__(self, job_id: int, epoch: int, worker: str, shard: int = 0):
        self.job_id = job_id
        self.epoch = epoch
        self.worker = worker
        self.shard = shard
        self.store = store()
        self.job = Job.objects.get(pk=job_id)
        self.config = train_config(self.job)
        self.spec = self.job.spec
        self.P = self.config.fragments
        self.shards = max(1, min(self.P, int(self.spec.get("syncer_shards") or 1)))
        self.mine = [p for p in range(self.P) if p % self.shards == shard]
        self.leader = shard == 0
        self.ledger = Ledger()
        self.commits = 0
        self.head: dict[int, int] = {}
        self.head_epochs: dict[int, int] = {}
        self.seen: set[str] = set()
        self.pending: dict[str, keys.ContribRef] = {}  # key -> ref, submitted, awaiting merge
        self.fences: dict[int, tuple[int, dict | None]] = {}
        self.counters = {"duplicates_refused": 0, "zombies_refused": 0, "rejected": 0, "accepted": 0,
                         "tokens_contributed": 0, "tokens_rejected": 0, "bytes_in": 0}
        self.sync_seconds = 0.0
        self.timing = {"merge_s": 0.0, "blob_s": 0.0, "snapshot_s": 0.0, "db_s": 0.0}
        self.commits_here = 0
        self.blob_seconds = 0.0
        self.eval_model = None
        self.last_eval_commit = 0
        self.last_ckpt_commit = 0
        self.accounted_at = None  # wall time of the last energy/cost tick
        self.last_metrics_at = 0.0
        self.last_merged_norm: float | None = None

    # ------------------------------------------------------------------ setup
    def build(self) -> None:
        from trainer.clock import WallClock
        from trainer.models import build_model
        from trainer.syncer import Syncer

        torch.set_num_threads(1)
        data = corpus(self.config.dataset, self.config.cache_dir)
        model = build_model(self.config.model, seq_len=self.config.seq_len, seed=self.config.seed,
                            vocab_size=data.vocab_size)
        self.eval_model = model
        # fencing by incarnation happens here (admit / _refence), from token ranges
        self.syncer = Syncer(self.config, model, WallClock(), job=str(self.job_id), fence_incarnations=False)
        self.shapes = {k: tuple(v.shape) for k, v in self.syncer.global_state().items()}
        lease = SyncerLease.objects.get(job_id=self.job_id, shard=self.shard)
        if lease.state_key:
            snap = codec.unpack(self.store.get(lease.state_key))
            self.syncer.load_state_dict(snap["syncer"])
            self.ledger = Ledger(snap["ledger"])
            for key in snap.get("pending", []):  # restored inside the engine's state too
                ref = keys.parse_contrib_key(key)
                if ref is not None:
                    self.pending[key] = ref
                    self.seen.add(key)
            self.counters.update(snap.get("counters", {}))
            self.commits = lease.commits
            saved = dict(lease.head)
            self.head_epochs = {int(k): int(v) for k, v in (saved.pop("epochs", None) or {}).items()}
            self.head = {int(k): int(v) for k, v in saved.items()}
            self.last_eval_commit = snap.get("last_eval_commit", self._outer_steps())
            self.last_ckpt_commit = snap.get("last_ckpt_commit", self._outer_steps())
            # make sure learners see the committed head (step 4 may not have happened)
            self.store.put(keys.head_key(self.job_id, self.shard),
                           keys.head_blob(self.head, self.head_epochs))
            log.info("syncer shard %s of job %s resumed at commit %s (epoch %s)",
                     self.shard, self.job_id, self.commits, self.epoch)
        elif self.job.initial_val_loss is None and self.leader:
            loss = self.evaluate()
            Job.objects.filter(pk=self.job_id).update(initial_val_loss=loss)
            self._metric("val_loss", loss, 0)

    # ------------------------------------------------------------------ lease
    def _lease(self):
        return SyncerLease.objects.filter(job_id=self.job_id, shard=self.shard, epoch=self.epoch)

    def heartbeat(self) -> str:
        n = self._lease().update(last_heartbeat=now(), worker=self.worker)
        if n == 0:
            raise LeaseLost(f"syncer epoch {self.epoch} superseded")
        status = Job.objects.filter(pk=self.job_id).values_list("status", flat=True).first()
        self.fences = {}
        for index, inc, point, state in Learner.objects.filter(job_id=self.job_id).values_list(
                "index", "incarnation", "runtime__resume_point", "state"):
            self.fences[index] = (inc, point, state)
        live = sum(1 for f in self.fences.values()
                   if f[2] in (Learner.State.RUNNING, Learner.State.STARTING, Learner.State.PENDING))
        self.syncer.set_expected_learners(max(1, live))
        self.live = live
        self._refence()
        self.beats = getattr(self, "beats", 0) + 1
        if self.beats % 10 == 1 and self.leader:  # running totals for dashboards (final figures at the end)
            self.account()
        return status

    # ------------------------------------------------------------------ accounting
    def _computed(self) -> int:
        return int(LearnerRuntime.objects.filter(learner__job_id=self.job_id)
                   .aggregate(n=Sum("tokens_computed"))["n"] or 0)

    def account(self) -> None:
        """Energy and cost of the learners' busy time since the previous tick, and the live
        tokens_computed (never below tokens_contributed: a contribution proves its tokens were
        computed, the learners' own counts lag by a heartbeat). See docs/runtime.md.

        A learner is busy from its start (or the previous tick) until now while it is running
        and stamping, else until its last heartbeat (its final stamp when it finished or handed
        off, its last sign of life when it died)."""
        t = now()
        last, self.accounted_at = self.accounted_at, t
        if last is None:  # a job with nothing accounted yet is accounted from its start
            row = Job.objects.filter(pk=self.job_id).values("energy_j", "cost", "started_at").first()
            if row and row["energy_j"] == 0 and row["cost"] == 0 and row["started_at"]:
                last = row["started_at"]
        energy = cost = 0.0
        if last is not None and t > last:
            fresh = t - timedelta(seconds=hb_timeout())
            for state, started, beat, watts, price in Learner.objects.filter(
                    job_id=self.job_id, pool__isnull=False, last_heartbeat__gt=last).values_list(
                    "state", "started_at", "last_heartbeat", "pool__accelerator__tdp_watts",
                    "pool__cost_per_device_hour"):
                begin = max(last, started) if started else last
                end = t if state == Learner.State.RUNNING and beat >= fresh else min(t, beat)
                busy = (end - begin).total_seconds()
                if busy > 0:
                    energy += float(watts or 0) * DEVICES_PER_LEARNER * busy
                    cost += float(price or 0) * DEVICES_PER_LEARNER * busy / 3600.0
        Job.objects.filter(pk=self.job_id).update(
            energy_j=F("energy_j") + energy, cost=F("cost") + cost,
            tokens_computed=Greatest(Value(self._computed()), F("tokens_contributed")))

    # ------------------------------------------------------------------ contributions
    def _superseded(self, ref: keys.ContribRef) -> str | None:
        """For a contribution of an older incarnation: None when it may still be applied (it ends
        where the successor resumed, or before), 'wait' while the successor has not said where
        it resumes, 'zombie' when the successor computes those tokens again."""
        inc, point, _state = self.fences[ref.learner]
        if ref.incarnation >= inc:
            return None
        if point is None:
            return "wait"
        frag_pos = point.get("frag_pos") or {}
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
        fence = self.fences.get(ref.learner)
        if fence is None:
            return "unknown learner"
        if ref.incarnation > fence[0]:
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

    def scan(self) -> int:
        from trainer.protocol import Contribution, InvalidPayload

        n = 0
        for key in sorted(self.store.list(keys.contrib_prefix(self.job_id))):
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
            try:
                t0 = time.perf_counter()
                blob = self.store.get(key)
                self.blob_seconds += time.perf_counter() - t0
                self.counters["bytes_in"] += len(blob)
                c = Contribution.from_bytes(blob, expected=self._expected(ref.fragment))
                if (c.learner, c.incarnation, c.fragment, c.base_version) != \
                        (ref.learner, ref.incarnation, ref.fragment, ref.base_version):
                    raise InvalidPayload("payload does not match its key")
            except Exception as exc:
                self._refuse(ref, f"invalid: {exc}"[:200])
                continue
            res = self.syncer.submit(c)
            if not res.accepted and res.reason.startswith("duplicate"):
                self.counters["duplicates_refused"] += 1
                continue  # already applied (or pending, restored from the snapshot): nothing to do
            if res.accepted:
                self.pending[key] = ref
                self.counters["accepted"] += 1
                n += 1
            else:
                self._refuse(ref, res.reason)
        return n

    def _expected(self, fragment: int):
        names = self.syncer.fragments[fragment] if hasattr(self.syncer, "fragments") else None
        if names is None:
            return None
        return {k: self.shapes[k] for k in names}

    def _refuse(self, ref: keys.ContribRef, reason: str) -> None:
        if reason == "duplicate":
            self.counters["duplicates_refused"] += 1
        elif reason == "zombie":
            self.counters["zombies_refused"] += 1
        else:
            self.counters["rejected"] += 1
            self.counters["tokens_rejected"] += ref.end - ref.start
            Learner.objects.filter(job_id=self.job_id, index=ref.learner).update(
                rejected_contributions=F("rejected_contributions") + 1)
        event(self.job, Event.Kind.REJECTED,
              f"contribution of learner {ref.learner}.{ref.incarnation} fragment {ref.fragment} "
              f"v{ref.base_version}: {reason}",
              {"learner": ref.learner, "incarnation": ref.incarnation, "fragment": ref.fragment,
               "base_version": ref.base_version, "start": ref.start, "end": ref.end, "reason": reason})
        with contextlib.suppress(Exception):
            self.store.delete(ref.key)

    # ------------------------------------------------------------------ merge + commit
    def merge_due(self, force: bool = False) -> int:
        frags = self.syncer.due() if not force else sorted({r.fragment for r in self.pending.values()})
        done = 0
        for p in frags:
            t0 = time.perf_counter()
            try:
                result = self.syncer.merge(p, force=force)
            except ValueError as exc:  # nothing left to merge (all stale)
                log.info("job %s fragment %s: %s", self.job_id, p, exc)
                self._drop_stale(p, set())
                continue
            self.commit(result, time.perf_counter() - t0)
            done += 1
        return done

    def merge_short(self) -> int:
        """Fewer learners left than the quorum (the others finished or were removed): a
        fragment that holds a contribution from every live learner merges anyway, or the
        tail of the job would wait for a quorum that can no longer form."""
        live = getattr(self, "live", None)
        if live is None or live >= self.config.quorum:
            return 0
        done = 0
        for p in self.mine:
            if self.syncer.pending_count(p) >= max(1, live):
                t0 = time.perf_counter()
                try:
                    result = self.syncer.merge(p, force=True)
                except ValueError:
                    self._drop_stale(p, set())
                    continue
                self.commit(result, time.perf_counter() - t0)
                done += 1
        return done

    def _drop_stale(self, p: int, used_keys: set[str]) -> None:
        """Pending refs of fragment p the merge left out were dropped by the staleness rule."""
        for k in [k for k, ref in self.pending.items() if ref.fragment == p and k not in used_keys]:
            ref = self.pending.pop(k)
            self._refuse(ref, "stale: dropped at merge time")

    def commit(self, r, merge_s: float) -> None:
        t0 = time.perf_counter()
        p, v = r.fragment, r.version
        used = []
        contributors = []
        tokens = 0
        for c in r.contributors:
            # the engine key (learner, incarnation, fragment, base version) names one blob
            match = next((k for k, ref in self.pending.items()
                          if (ref.fragment, ref.learner, ref.incarnation, ref.base_version)
                          == (p, c["learner"], c["incarnation"], c["base_version"])), None)
            rng = []
            if match is not None:
                u = self.pending.pop(match)
                used.append(u)
                rng = [[u.start, u.end]]
                self.ledger.add(u.learner, u.fragment, u.start, u.end)
                tokens += u.end - u.start
            contributors.append({**{k: _jsonable(val) for k, val in c.items()}, "ranges": rng})
        self._drop_stale(p, {u.key for u in used})
        tokens_equiv = tokens // max(1, self.P)
        self.counters["tokens_contributed"] += tokens_equiv
        t_blob = time.perf_counter()
        update = self.syncer.global_update(p)
        if update is not None:  # global_compression: learners holding v - 1 fetch this instead
            self.store.put(keys.update_key(self.job_id, p, v, self.epoch), update)
        blob = r.global_fragment.to_bytes("none")
        gkey = keys.global_key(self.job_id, p, v, self.epoch)
        self.store.put(gkey, blob)
        self.timing["blob_s"] += time.perf_counter() - t_blob
        self.timing["merge_s"] += merge_s
        t_snap = time.perf_counter()
        self.commits += 1
        self.head[p] = v
        self.head_epochs[p] = self.epoch
        snap_key = keys.syncer_state_key(self.job_id, self.commits, self.epoch, self.shard)
        self.store.put(snap_key, codec.pack({
            "syncer": self.syncer.state_dict(), "ledger": self.ledger.to_dict(), "counters": self.counters,
            "pending": sorted(self.pending),
            "last_eval_commit": self.last_eval_commit, "last_ckpt_commit": self.last_ckpt_commit},
            copy=False))  # the engine's state_dict() returns copies
        t_db = time.perf_counter()
        self.timing["snapshot_s"] += t_db - t_snap
        with transaction.atomic():
            lease = self._lease().select_for_update().first()
            if lease is None:
                raise LeaseLost("lease lost before commit")
            OuterStep.objects.create(job_id=self.job_id, fragment=p, version=v, contributors=contributors,
                                     merged_norm=float(r.merged_norm), duration_s=merge_s, blob_uri=gkey)
            old_key = lease.state_key
            SyncerLease.objects.filter(pk=lease.pk).update(
                commits=self.commits, state_key=snap_key, head=self._head_json(),
                last_heartbeat=now(), duplicates_refused=self.counters["duplicates_refused"],
                zombies_refused=self.counters["zombies_refused"])
            Job.objects.filter(pk=self.job_id).update(
                outer_steps=F("outer_steps") + 1, tokens_contributed=F("tokens_contributed") + tokens_equiv,
                tokens_computed=Greatest(Value(self._computed()), F("tokens_contributed") + tokens_equiv),
                bytes_sent=F("bytes_sent") + len(blob))
            for u in used:
                Learner.objects.filter(job_id=self.job_id, index=u.learner).update(
                    tokens_contributed=F("tokens_contributed") + (u.end - u.start) // max(1, self.P))
        self.timing["db_s"] += time.perf_counter() - t_db
        t_blob = time.perf_counter()
        self.store.put(keys.head_key(self.job_id, self.shard), keys.head_blob(self.head, self.head_epochs))
        for u in used:
            with contextlib.suppress(Exception):
                self.store.delete(u.key)
        if old_key and old_key != snap_key:
            with contextlib.suppress(Exception):
                self.store.delete(old_key)
        self.timing["blob_s"] += time.perf_counter() - t_blob
        self.sync_seconds += merge_s + (time.perf_counter() - t0)
        self.commits_here += 1
        total = self._outer_steps()
        publish(self.job_id, {"type": "job", "status": st.RUNNING, "outer_steps": total})
        self.last_merged_norm = float(r.merged_norm)
        if not self.leader:
            return
        evaluate = total - self.last_eval_commit >= int(self.spec.get("eval_interval", 5))
        if evaluate or time.monotonic() - self.last_metrics_at >= METRIC_EVERY_S:
            self.job_metrics()
        if evaluate:
            self.last_eval_commit = total
            self._metric("val_loss", self.evaluate(), self._tokens())
        if total - self.last_ckpt_commit >= int(self.spec.get("checkpoint_interval", 10)):
            self.last_ckpt_commit = total
            self.export(Checkpoint.Kind.PERIODIC)

    def _outer_steps(self) -> int:
        """Outer steps of the whole job (this shard's commits when it is the only one)."""
        if self.shards == 1:
            return self.commits
        return int(Job.objects.filter(pk=self.job_id).values_list("outer_steps", flat=True).first() or 0)

    def _heads(self) -> list[tuple[dict[int, int], dict[int, int]]]:
        """(versions, epochs) committed by every shard: this one's from memory, the others' heads
        from the store."""
        out = []
        for k in range(self.shards):
            if k == self.shard:
                out.append((dict(self.head), dict(self.head_epochs)))
                continue
            try:
                out.append(keys.parse_head(self.store.get(keys.head_key(self.job_id, k))))
            except Exception:
                out.append(({}, {}))
        return out

    def global_state(self) -> dict[str, torch.Tensor]:
        """Every fragment's committed weights: this shard's from its engine, the other shards'
        from the global blobs their heads name."""
        from trainer.protocol import GlobalFragment

        state = self.syncer.global_state()
        for k, (head, epochs) in enumerate(self._heads()):
            if k == self.shard:
                continue
            for p, v in head.items():
                blob = self.store.get(keys.global_key(self.job_id, p, v, epochs.get(p)))
                state.update(GlobalFragment.from_bytes(blob, expected=self._expected(p)).tensors)
        return state

    def _head_json(self) -> dict:
        return {**{str(k): x for k, x in self.head.items()},
                "epochs": {str(k): x for k, x in self.head_epochs.items()}}

    def _tokens(self) -> int:
        return int(self.counters["tokens_contributed"])

    # ------------------------------------------------------------------ eval / export
    def evaluate(self) -> float:
        from trainer.data import evaluate

        if hasattr(self, "syncer"):
            self.eval_model.load_state_dict(self.global_state(), strict=False)
        data = corpus(self.config.dataset, self.config.cache_dir)
        return float(evaluate(self.eval_model, data, self.config.eval_batch_size or self.config.batch_size,
                              self.config.seq_len, batches=self.config.eval_batches, seed=0))

    def job_metrics(self) -> None:
        """`goodput` (tokens contributed / computed, at most 1), `bytes_sent` (cumulative) and
        `outer_step_norm` (the latest merged pseudo-gradient's norm) points at the job's
        contributed tokens, plus a live job message for dashboards."""
        self.last_metrics_at = time.monotonic()
        row = Job.objects.filter(pk=self.job_id).values(
            "tokens_computed", "tokens_contributed", "bytes_sent", "energy_j", "cost").first()
        if row is None:
            return
        step = int(row["tokens_contributed"])
        points = [("bytes_sent", float(row["bytes_sent"]))]
        if row["tokens_computed"] > 0:
            points.insert(0, ("goodput", goodput(row["tokens_contributed"], row["tokens_computed"])))
        if self.last_merged_norm is not None:
            points.append(("outer_step_norm", self.last_merged_norm))
        MetricPoint.objects.bulk_create(
            [MetricPoint(job_id=self.job_id, name=n, value=v, step=step) for n, v in points])
        t = time.time()
        publish(self.job_id, {"type": "metrics", "points": [
            {"learner": None, "name": n, "step": step, "value": v, "time": t} for n, v in points]})
        publish(self.job_id, {"type": "job", **row})

    def _metric(self, name: str, value: float, step: int) -> None:
        MetricPoint.objects.create(job_id=self.job_id, name=name, value=value, step=step)
        publish(self.job_id, {"type": "metrics", "points": [
            {"learner": None, "name": name, "step": step, "value": value, "time": time.time()}]})

    def export(self, kind: str) -> Checkpoint:
        from safetensors.torch import save

        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in self.global_state().items()}
        total = self._outer_steps()
        versions = {str(p): v for head, _ in self._heads() for p, v in head.items()}
        config = {"model": self.config.model, "seq_len": self.config.seq_len, "seed": self.config.seed,
                  "spec": self.spec, "job": self.job_id, "outer_steps": total,
                  "versions": dict(sorted(versions.items(), key=lambda kv: int(kv[0])))}
        blob = save(tensors, metadata={"config": json.dumps(config)})
        key = keys.checkpoint_key(self.job_id, total, kind)
        self.store.put(key, blob)
        self.store.put(key.removesuffix(".safetensors") + ".json", json.dumps(config, indent=2).encode())
        ck = Checkpoint.objects.create(job_id=self.job_id, version=total, kind=kind, blob_uri=key,
                                       size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
        event(self.job, Event.Kind.CHECKPOINTED, f"{kind} checkpoint at outer step {total}",
              {"checkpoint": ck.pk, "key": key, "bytes": len(blob)})
        return ck

    # ------------------------------------------------------------------ main loop
    def _pulse(self) -> None:
        """Stamp the lease from a side thread while the main loop keeps ticking (slow builds and
        evaluations must not look like a dead syncer; a hung loop stops the stamps)."""
        from django.db import connection

        while not self._stop.wait(min(0.5, hb_interval())):
            if time.monotonic() - self.tick > 60:
                continue
            try:
                n = self._lease().update(last_heartbeat=now())
                if n == 0:
                    return
            except Exception:
                log.debug("syncer pulse failed", exc_info=True)
        connection.close()

    def run(self) -> str:
        import threading

        self.tick = time.monotonic()
        self._stop = threading.Event()
        pulse = threading.Thread(target=self._pulse, name=f"syncer-{self.job_id}-{self.shard}-pulse",
                                 daemon=True)
        pulse.start()
        try:
            return self._run()
        finally:
            self._stop.set()

    def _run(self) -> str:
        self.build()
        next_hb = 0.0
        status = st.RUNNING
        while True:
            t = self.tick = time.monotonic()
            if t >= next_hb:
                status = self.heartbeat()
                next_hb = t + min(0.5, hb_interval())
                if status not in ACTIVE_JOB and (status == st.PAUSED or status in st.TERMINAL):
                    self._stop.set()
                    self._lease().update(worker="", last_heartbeat=None)
                    return f"stopped: job {status}"
            self.scan()
            self.merge_due()
            self.merge_short()
            if status == st.RUNNING and self._all_learners_finished():
                self.scan()
                if not self._waiting_keys():
                    self.merge_due(force=True)
                    if not self.leader:
                        self.finish_shard()
                        return "completed"
                    if self._other_shards_finished():
                        self.finish()
                        return "completed"
                    # else the leader waits for the other shards to merge their last contributions
            time.sleep(0.05)

    def _waiting_keys(self) -> bool:
        return any(k not in self.seen for k in self.store.list(keys.contrib_prefix(self.job_id)))

    def _other_shards_finished(self) -> bool:
        if self.shards == 1:
            return True
        done = SyncerLease.objects.filter(job_id=self.job_id, finished=True).exclude(shard=self.shard).count()
        return done >= self.shards - 1

    def finish_shard(self) -> None:
        """A shard other than the leader: its fragments are merged to the end."""
        self._lease().update(finished=True)
        event(self.job, Event.Kind.INFO, f"syncer shard {self.shard} finished: {self.commits} outer steps",
              {"shard": self.shard, "commits": self.commits, "commits_this_epoch": self.commits_here,
               "sync_seconds": round(self.sync_seconds, 4), "epoch": self.epoch, **self.counters})

    def _all_learners_finished(self) -> bool:
        states = [f[2] for f in self.fences.values()]
        return bool(states) and all(s in (Learner.State.DONE, Learner.State.REMOVED) for s in states)

    def finish(self) -> None:
        loss = self.evaluate()
        self._metric("val_loss", loss, self._tokens())
        self.export(Checkpoint.Kind.FINAL)
        self.account()  # final energy / cost
        contributed = Job.objects.filter(pk=self.job_id).values_list("tokens_contributed", flat=True).first()
        computed = max(self._computed(), int(contributed or 0))
        Job.objects.filter(pk=self.job_id).update(final_val_loss=loss, tokens_computed=computed,
                                                  tokens_lost=max(0, computed - int(contributed or 0)))
        self.job_metrics()
        self._lease().update(finished=True)
        total = self._outer_steps()
        event(self.job, Event.Kind.INFO, f"syncer finished: {total} outer steps",
              {"commits": self.commits, "commits_this_epoch": self.commits_here,
               "sync_seconds": round(self.sync_seconds, 4),
               "contribution_read_seconds": round(self.blob_seconds, 4),
               "epoch": self.epoch, **{k: round(v, 4) for k, v in self.timing.items()}, **self.counters})
        job = Job.objects.get(pk=self.job_id)
        with contextlib.suppress(st.IllegalTransition):
            job.transition(st.COMPLETED, f"all learners finished; val loss {loss:.4f}")
        publish(self.job_id, {"type": "job", "status": job.status, "outer_steps": total})
        Incident.objects.filter(job_id=self.job_id, healed_at__isnull=True, kind="syncer_lost") \
            .update(healed_at=now())


def goodput(contributed: int, computed: int) -> float:
    """Share of the computed tokens that reached the global model, in [0, 1]."""
    if computed <= 0:
        return 0.0
    return max(0.0, min(1.0, contributed / computed))


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float | int | str | bool) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return str(v)


def run_syncer_body(job_id: int, epoch: int, worker: str, shard: int = 0) -> str:
    close_old_connections()
    lease = SyncerLease.objects.filter(job_id=job_id, shard=shard).first()
    if lease is None or lease.epoch != epoch or lease.finished:
        return "fenced"
    SyncerLease.objects.filter(job_id=job_id, shard=shard, epoch=epoch).update(
        started_at=now(), last_heartbeat=now(), worker=worker)
    Incident.objects.filter(Q(details__shard=shard) | ~Q(details__has_key="shard"), job_id=job_id,
                            kind="syncer_lost", healed_at__isnull=True).update(healed_at=now())
    run = SyncerRun(job_id, epoch, worker, shard=shard)
    try:
        return run.run()
    except LeaseLost as exc:
        return f"fenced: {exc}"
