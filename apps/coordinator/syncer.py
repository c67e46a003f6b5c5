"""The syncer task body: `trainer.runtime.syncer_loop.SyncerLoop` with the database as its host.

The protocol (scan, admit, fence, merge, commit order, snapshots, resume) is the loop's; this
module is the `SyncerHost` behind it: the lease (`SyncerLease`, one row per job shard, fenced by
epoch), the commit transaction (OuterStep row, lease commits/state_key/head, job counters),
learners' incarnations and resume points, events, metrics, evaluation, exports and accounting.
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
from trainer.runtime import keys
from trainer.runtime.syncer_loop import Beat, Commit, LearnerView, LeaseLost, Ledger, Resume, SyncerLoop

from .common import corpus, event, hb_interval, hb_timeout, job_spec, log, now, publish, store, train_config
from .models import LearnerRuntime, SyncerLease

__all__ = ["DjangoSyncerHost", "LeaseLost", "Ledger", "SyncerRun", "goodput", "run_syncer_body"]

ACTIVE_JOB = (st.RUNNING, st.PAUSING)
LIVE = (Learner.State.RUNNING, Learner.State.STARTING, Learner.State.PENDING)
FINISHED = (Learner.State.DONE, Learner.State.REMOVED)
ACCOUNT_EVERY_BEATS = 10  # running energy / cost totals for dashboards (final figures at the end)


class DjangoSyncerHost:
    """The database side of one syncer shard of a job (see SyncerHost)."""

    def __init__(self, job_id: int, epoch: int, worker: str, shard: int = 0):
        self.job_id = job_id
        self.epoch = epoch
        self.worker = worker
        self.shard = shard
        self.leader = shard == 0
        self.store = store()
        self.job = Job.objects.get(pk=job_id)
        self.spec = job_spec(self.job)
        self.config = train_config(self.job)
        self.shards = max(1, min(self.config.fragments, self.spec.syncer_shards))
        self.eval_model = None
        self.beats = 0
        self.accounted_at = None  # wall time of the last energy/cost tick
        self.last_merged_norm: float | None = None

    # ------------------------------------------------------------------ lease
    def _lease(self):
        return SyncerLease.objects.filter(job_id=self.job_id, shard=self.shard, epoch=self.epoch)

    def beat(self) -> Beat:
        n = self._lease().update(last_heartbeat=now(), worker=self.worker)
        if n == 0:
            raise LeaseLost(f"syncer epoch {self.epoch} superseded")
        status = Job.objects.filter(pk=self.job_id).values_list("status", flat=True).first()
        learners = {
            index: LearnerView(incarnation=inc, resume_point=point, live=state in LIVE,
                               finished=state in FINISHED)
            for index, inc, point, state in Learner.objects.filter(job_id=self.job_id).values_list(
                "index", "incarnation", "runtime__resume_point", "state")}
        self.beats += 1
        if self.beats % ACCOUNT_EVERY_BEATS == 1 and self.leader:
            self.account()
        stop = status not in ACTIVE_JOB and (status == st.PAUSED or status in st.TERMINAL)
        return Beat(status=status, learners=learners, stop=stop, may_finish=status == st.RUNNING)

    def resume_point(self) -> Resume | None:
        lease = SyncerLease.objects.get(job_id=self.job_id, shard=self.shard)
        if not lease.state_key:
            return None
        saved = dict(lease.head)
        epochs = {int(k): int(v) for k, v in (saved.pop("epochs", None) or {}).items()}
        return Resume(commits=lease.commits, state_key=lease.state_key,
                      head={int(k): int(v) for k, v in saved.items()}, head_epochs=epochs)

    def stopped(self, status: str) -> None:
        self._lease().update(worker="", last_heartbeat=None)

    # ------------------------------------------------------------------ commit
    def commit(self, c: Commit) -> None:
        head = {**{str(k): x for k, x in c.head.items()},
                "epochs": {str(k): x for k, x in c.head_epochs.items()}}
        with transaction.atomic():
            lease = self._lease().select_for_update().first()
            if lease is None:
                raise LeaseLost("lease lost before commit")
            OuterStep.objects.create(job_id=self.job_id, fragment=c.fragment, version=c.version,
                                     contributors=c.contributors, merged_norm=c.merged_norm,
                                     duration_s=c.duration_s, blob_uri=c.blob_key)
            SyncerLease.objects.filter(pk=lease.pk).update(
                commits=c.commits, state_key=c.state_key, head=head, last_heartbeat=now(),
                duplicates_refused=c.counters["duplicates_refused"],
                zombies_refused=c.counters["zombies_refused"])
            Job.objects.filter(pk=self.job_id).update(
                outer_steps=F("outer_steps") + 1, tokens_contributed=F("tokens_contributed") + c.tokens,
                tokens_computed=Greatest(Value(self._computed()), F("tokens_contributed") + c.tokens),
                bytes_sent=F("bytes_sent") + c.blob_bytes)
            for learner, tokens in c.learner_tokens:
                Learner.objects.filter(job_id=self.job_id, index=learner).update(
                    tokens_contributed=F("tokens_contributed") + tokens)

    def committed(self, c: Commit, outer_steps: int, metrics_due: bool) -> None:
        publish(self.job_id, {"type": "job", "status": st.RUNNING, "outer_steps": outer_steps})
        self.last_merged_norm = c.merged_norm
        if metrics_due:
            self.job_metrics()

    def refused(self, ref: keys.ContribRef, reason: str) -> None:
        if reason not in ("duplicate", "zombie"):
            Learner.objects.filter(job_id=self.job_id, index=ref.learner).update(
                rejected_contributions=F("rejected_contributions") + 1)
        event(self.job, Event.Kind.REJECTED,
              f"contribution of learner {ref.learner}.{ref.incarnation} fragment {ref.fragment} "
              f"v{ref.base_version}: {reason}",
              {"learner": ref.learner, "incarnation": ref.incarnation, "fragment": ref.fragment,
               "base_version": ref.base_version, "start": ref.start, "end": ref.end, "reason": reason})

    def outer_steps(self) -> int:
        return int(Job.objects.filter(pk=self.job_id).values_list("outer_steps", flat=True).first() or 0)

    def others_finished(self) -> bool:
        if self.shards == 1:
            return True
        done = SyncerLease.objects.filter(job_id=self.job_id, finished=True).exclude(shard=self.shard).count()
        return done >= self.shards - 1

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
        devices = self.spec.devices_per_learner  # an island's every device draws power and costs
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
                    energy += float(watts or 0) * devices * busy
                    cost += float(price or 0) * devices * busy / 3600.0
        Job.objects.filter(pk=self.job_id).update(
            energy_j=F("energy_j") + energy, cost=F("cost") + cost,
            tokens_computed=Greatest(Value(self._computed()), F("tokens_contributed")))

    # ------------------------------------------------------------------ eval / metrics / export
    def evaluate(self, state: dict[str, torch.Tensor] | None, step: int) -> float:
        """Validation loss of `state` (the model as built when None), recorded at `step`."""
        from trainer.data import evaluate

        if self.eval_model is None:
            self.eval_model = self._build_model()
        if state is not None:
            self.eval_model.load_state_dict(state, strict=False)
        data = corpus(self.config.dataset, self.config.cache_dir, self.job_id)
        loss = float(evaluate(self.eval_model, data, self.config.eval_batch_size or self.config.batch_size,
                              self.config.seq_len, batches=self.config.eval_batches, seed=0))
        self._metric("val_loss", loss, step)
        return loss

    def _build_model(self):
        from trainer.models import build_model

        data = corpus(self.config.dataset, self.config.cache_dir, self.job_id)
        return build_model(self.config.model, seq_len=self.config.seq_len, seed=self.config.seed,
                           vocab_size=data.vocab_size)

    def job_metrics(self) -> None:
        """`goodput` (tokens contributed / computed, at most 1), `bytes_sent` (cumulative) and
        `outer_step_norm` (the latest merged pseudo-gradient's norm) points at the job's
        contributed tokens, plus a live job message for dashboards."""
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

    def checkpoint(self, kind: str, state: dict[str, torch.Tensor], outer_steps: int,
                   versions: dict[str, int]) -> Checkpoint:
        from safetensors.torch import save

        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
        config = {"model": self.config.model, "seq_len": self.config.seq_len, "seed": self.config.seed,
                  "spec": self.job.spec, "job": self.job_id, "outer_steps": outer_steps, "versions": versions}
        blob = save(tensors, metadata={"config": json.dumps(config)})
        key = keys.checkpoint_key(self.job_id, outer_steps, kind)
        self.store.put(key, blob)
        self.store.put(key.removesuffix(".safetensors") + ".json", json.dumps(config, indent=2).encode())
        ck = Checkpoint.objects.create(job_id=self.job_id, version=outer_steps, kind=kind, blob_uri=key,
                                       size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
        event(self.job, Event.Kind.CHECKPOINTED, f"{kind} checkpoint at outer step {outer_steps}",
              {"checkpoint": ck.pk, "key": key, "bytes": len(blob)})
        return ck

    # ------------------------------------------------------------------ the end
    def finished(self, summary: dict, loss: float | None) -> None:
        if loss is None:  # a shard other than the leader: its fragments are merged to the end
            self._lease().update(finished=True)
            event(self.job, Event.Kind.INFO,
                  f"syncer shard {self.shard} finished: {summary['commits']} outer steps", summary)
            return
        self.account()  # final energy / cost
        contributed = Job.objects.filter(pk=self.job_id).values_list("tokens_contributed", flat=True).first()
        computed = max(self._computed(), int(contributed or 0))
        Job.objects.filter(pk=self.job_id).update(final_val_loss=loss, tokens_computed=computed,
                                                  tokens_lost=max(0, computed - int(contributed or 0)))
        self.job_metrics()
        self._lease().update(finished=True)
        total = self.outer_steps() if self.shards > 1 else summary["commits"]
        event(self.job, Event.Kind.INFO, f"syncer finished: {total} outer steps", summary)
        job = Job.objects.get(pk=self.job_id)
        with contextlib.suppress(st.IllegalTransition):
            job.transition(st.COMPLETED, f"all learners finished; val loss {loss:.4f}")
        publish(self.job_id, {"type": "job", "status": job.status, "outer_steps": total})
        Incident.objects.filter(job_id=self.job_id, healed_at__isnull=True, kind="syncer_lost") \
            .update(healed_at=now())


class SyncerRun(DjangoSyncerHost):
    """The wiring of one syncer shard: the engine, the loop over the blob store, this host, and a
    side thread that stamps the lease while the loop is busy."""

    loop: SyncerLoop

    def build(self) -> None:
        from trainer.clock import WallClock
        from trainer.syncer import Syncer

        torch.set_num_threads(1)
        model = self.eval_model = self._build_model()
        engine = Syncer(self.config, model, WallClock(), job=str(self.job_id))
        self.loop = SyncerLoop(engine, self.store, self, job=self.job_id, epoch=self.epoch, shard=self.shard,
                               shards=self.shards, eval_interval=self.spec.eval_interval,
                               checkpoint_interval=self.spec.checkpoint_interval,
                               heartbeat_interval=min(0.5, hb_interval()))
        if not self.loop.start() and self.job.initial_val_loss is None and self.leader:
            loss = self.evaluate(None, 0)
            Job.objects.filter(pk=self.job_id).update(initial_val_loss=loss)

    # what the tests of the runtime look at
    syncer = property(lambda self: self.loop.syncer)
    shapes = property(lambda self: self.loop.shapes)
    ledger = property(lambda self: self.loop.ledger)
    pending = property(lambda self: self.loop.pending)
    counters = property(lambda self: self.loop.counters)

    def heartbeat(self) -> Beat:
        return self.loop.heartbeat()

    def scan(self) -> int:
        return self.loop.scan()

    def merge_due(self, force: bool = False) -> int:
        return self.loop.merge_due(force=force)

    def _pulse(self) -> None:
        """Stamp the lease from a side thread while the main loop keeps ticking (slow builds and
        evaluations must not look like a dead syncer; a hung loop stops the stamps)."""
        from django.db import connection

        while not self._stop.wait(min(0.5, hb_interval())):
            ticked = self.loop.ticked_at if hasattr(self, "loop") else self._started
            if time.monotonic() - ticked > 60:
                continue
            try:
                if self._lease().update(last_heartbeat=now()) == 0:
                    return
            except Exception:
                log.debug("syncer pulse failed", exc_info=True)
        connection.close()

    def run(self) -> str:
        import threading

        self._started = time.monotonic()
        self._stop = threading.Event()
        pulse = threading.Thread(target=self._pulse, name=f"syncer-{self.job_id}-{self.shard}-pulse",
                                 daemon=True)
        pulse.start()
        try:
            self.build()
            return self.loop.run()
        finally:
            self._stop.set()


def goodput(contributed: int, computed: int) -> float:
    """Share of the computed tokens that reached the global model, in [0, 1]."""
    if computed <= 0:
        return 0.0
    return max(0.0, min(1.0, contributed / computed))


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
