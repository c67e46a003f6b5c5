"""The chaos drill: a real stack, a failure-free run, then the same job under SIGKILLs.

Sequence on the chaos run (each step waits for the platform to heal before the next):
  1. SIGKILL the worker (main process and pool children) that runs learner 0
  2. SIGKILL the coordinator host: the syncer worker running the job's syncer and the coordinator
     worker (watchdog, placement), and start them again, as a supervisor would
  3. SIGKILL Redis (broker + channel layer) and start it again (a private redis-server, so
     nobody else's Redis is touched; skipped when redis-server is not installed)
  4. drain the pool of learner 1
With `islands` (chaos_drill --islands), then on a stack of one 4-slot CPU node: a job of 2
learners x 2 processes (gloo), SIGKILL of one follower rank of learner 0: the learner is failed
and placed again whole, the other learner keeps its incarnation (report["island"]).
The report (JSON) has per incident the time to detect and to heal, the global downtime
(longest stretch without an outer step, and time lost to stretches longer than 3x the median
spacing), tokens computed / contributed / lost, contributions applied twice (from the
OuterStep rows' token ranges: must be 0), the job's final status and validation loss against
the failure-free run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from django.contrib.auth import get_user_model

from apps.inventory.models import Pool
from apps.jobs import state as st
from apps.jobs.models import Incident, Job, Learner, OuterStep

from .models import SyncerLease
from .stack import RedisServer, Stack

QUICK_SPEC = {
    "name": "chaos drill", "model": "tiny", "learners": 2, "quorum": 2, "inner_steps": 8, "fragments": 1,
    # long enough that the ~10 s of failures fall mid-run even on a quiet machine
    "steps": 600, "batch_size": 8, "seq_len": 32, "warmup_steps": 4, "eval_interval": 8,
    "checkpoint_interval": 50, "grace_cap_s": 0.5, "seed": 3,
}
FULL_SPEC = {**QUICK_SPEC, "learners": 3, "quorum": 2, "steps": 1200, "fragments": 2, "inner_steps": 12}
ISLAND_SPEC = {**QUICK_SPEC, "name": "chaos drill (islands)", "devices_per_learner": 2, "quorum": 1,
               "steps": 400}


def island_follower_pids(job_id: int, index: int) -> list[int]:
    """Pids of the follower ranks of learner `index` of job `job_id` (their command line names them)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "trainer.runtime.island_rank" in cmd and f'"job": "{job_id}"' in cmd \
                and f'"islands": [[{index}, ' in cmd:
            out.append(int(entry.name))
    return out


def duplicate_details(job) -> list[dict]:
    """Applied contributions whose token range overlaps one applied before (same learner, fragment)."""
    ranges: dict[tuple[int, int], list[tuple]] = {}
    for step in OuterStep.objects.filter(job=job):
        for c in step.contributors:
            for r in c.get("ranges", []):
                ranges.setdefault((c["learner"], step.fragment), []).append(
                    (int(r[0]), int(r[1]), step.version, c.get("incarnation")))
    out = []
    for (learner, fragment), rs in ranges.items():
        rs.sort()
        for a, b in zip(rs, rs[1:], strict=False):
            if b[0] < a[1]:
                out.append({"learner": learner, "fragment": fragment, "first": a, "second": b})
    return out


def duplicates_applied(job) -> int:
    return len(duplicate_details(job))


def downtime(job) -> dict:
    times = sorted(OuterStep.objects.filter(job=job).values_list("created_at", flat=True))
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    if not gaps:
        return {"outer_steps": len(times), "max_gap_s": None, "median_gap_s": None, "downtime_s": None}
    med = statistics.median(gaps)
    return {"outer_steps": len(times), "max_gap_s": round(max(gaps), 3), "median_gap_s": round(med, 3),
            "downtime_s": round(sum(g - med for g in gaps if g > 3 * med), 3)}


class Drill:
    def __init__(self, quick: bool = True, tmp: str | None = None, log=print, islands: bool = False):
        self.quick = quick
        self.islands = islands
        self.spec = dict(QUICK_SPEC if quick else FULL_SPEC)
        self.tmp = Path(tmp or tempfile.mkdtemp(prefix="chaos-drill-"))
        self.log = log
        self.report: dict = {"quick": quick, "spec": self.spec, "incidents": [], "steps": []}

    # ------------------------------------------------------------------ helpers
    def owner(self):
        user, _ = get_user_model().objects.get_or_create(username="chaos-drill",
                                                        defaults={"email": "chaos@localhost"})
        return user

    def submit(self, stack: Stack, name: str, spec: dict | None = None) -> Job:
        from apps.jobs.services import submit_job
        from diloco_platform.celery import app

        from .tasks import reconcile_job

        job, _ = submit_job(self.owner(), {**(spec or self.spec), "name": name})
        with app.connection_for_write(stack.redis_url) as conn:  # the stack's own broker
            reconcile_job.apply_async((job.pk,), connection=conn)
        return job

    def wait_end(self, stack: Stack, job: Job, timeout: float) -> Job:
        stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=timeout,
                       what=f"job {job.pk} to finish", interval=0.25)
        job.refresh_from_db()
        return job

    def step(self, name: str, t0: float, **extra) -> None:
        entry = {"step": name, "seconds": round(time.time() - t0, 3), **extra}
        self.report["steps"].append(entry)
        self.log(f"  {name}: {entry['seconds']:.2f}s " + " ".join(f"{k}={v}" for k, v in extra.items()))

    def worker_of(self, stack: Stack, learner: Learner) -> str:
        learner.runtime.refresh_from_db()
        for name in stack.procs:
            if stack.worker_hostname(name) == learner.runtime.worker:
                return name
        raise RuntimeError(f"no stack process runs {learner.runtime.worker!r}")

    # ------------------------------------------------------------------ the drill
    def run(self) -> dict:
        redis = RedisServer(self.tmp) if shutil.which("redis-server") else None
        if redis:
            redis.start()
        try:
            with Stack(self.tmp / "stack", pools={"alpha": 1, "beta": 1, "gamma": 2}, coordinators=2,
                       redis_url=redis.url if redis else None) as stack:
                self._run(stack, redis)
        finally:
            if redis:
                redis.kill()
        if self.islands:
            with Stack(self.tmp / "islands", pools={"alpha": 4}) as stack:  # one node: 2 learners x 2
                self.report["island"] = self._island(stack)
        return self.report

    def _island(self, stack: Stack) -> dict:
        """kill -9 of one follower rank: its learner is failed and placed again whole."""
        timeout = 240 if self.quick else 900
        self.log("islands run ...")
        job = self.submit(stack, ISLAND_SPEC["name"], ISLAND_SPEC)
        stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 2
                       and island_follower_pids(job.pk, 0),
                       timeout=120, what="outer steps with the islands up")
        before = dict(Learner.objects.filter(job=job).values_list("index", "incarnation"))
        victim = island_follower_pids(job.pk, 0)[0]
        t0 = time.time()
        os.kill(victim, signal.SIGKILL)
        back = stack.wait_for(lambda: Learner.objects.filter(
            job=job, index=0, incarnation__gt=before[0], state=Learner.State.RUNNING,
            last_heartbeat__isnull=False).first() if island_follower_pids(job.pk, 0) else None,
            timeout=120, what="learner 0 placed again with a new island")
        self.step("kill -9 island rank", t0, pid=victim,
                  recovery_s=round(back.last_heartbeat.timestamp() - t0, 3))
        job = self.wait_end(stack, job, timeout)
        incident = Incident.objects.filter(job=job, kind="island_rank_lost").first()
        other = Learner.objects.get(job=job, index=1)
        return {
            "job": job.pk, "status": job.status, "spec": ISLAND_SPEC,
            "killed_rank_pid": victim,
            "incident": None if incident is None else {
                "learner": incident.learner.index if incident.learner else None,
                "failed_pids": incident.details.get("failed_pids"),
                "time_to_detect_s": round(incident.time_to_detect_s, 3),
                "time_to_heal_s": round(incident.time_to_heal_s, 3) if incident.healed_at else None},
            "learner_0_incarnations": [before[0], Learner.objects.get(job=job, index=0).incarnation],
            "other_learner_restarted": other.incarnation != before[1],
            "final_val_loss": job.final_val_loss,
            "duplicates_applied": duplicates_applied(job),
        }

    def _run(self, stack: Stack, redis: RedisServer | None) -> None:
        timeout = 240 if self.quick else 900
        self.log("failure-free run ...")
        t0 = time.time()
        base = self.wait_end(stack, self.submit(stack, "chaos drill (failure-free)"), timeout)
        self.report["baseline"] = {
            "job": base.pk, "status": base.status, "seconds": round(time.time() - t0, 2),
            "initial_val_loss": base.initial_val_loss, "final_val_loss": base.final_val_loss,
            "duplicates_applied": duplicates_applied(base), **downtime(base)}
        self.log(f"  done in {time.time() - t0:.1f}s, val loss {base.final_val_loss}")

        self.log("chaos run ...")
        t_start = time.time()
        job = self.submit(stack, "chaos drill (chaos)")
        stack.wait_for(lambda: Learner.objects.filter(job=job, state=Learner.State.RUNNING).count()
                       == self.spec["learners"], timeout=60, what="learners running")
        stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 2, timeout=60, what="outer steps")

        # 1. a learner's worker dies
        victim = Learner.objects.select_related("pool").get(job=job, index=0)
        name, inc = self.worker_of(stack, victim), victim.incarnation
        t0 = time.time()
        stack.kill_worker(name)
        back = stack.wait_for(lambda: Learner.objects.filter(
            job=job, index=0, incarnation__gt=inc, state=Learner.State.RUNNING,
            last_heartbeat__isnull=False).select_related("pool").first(), timeout=60, what="learner 0 back")
        self.step("kill -9 learner worker", t0, worker=name, recovered_on=back.pool.slug,
                  recovery_s=round(back.last_heartbeat.timestamp() - t0, 3))

        # 2. the coordinator host dies: the syncer worker running the syncer and the coordinator
        #    worker (the standbys take over at once); a supervisor starts them again
        t0 = time.time()
        lease = SyncerLease.objects.get(job=job, shard=0)
        commits = lease.commits
        victim = next((n for n in stack.procs if stack.worker_hostname(n) == lease.worker), "syncer")
        for name in (victim, "coordinator"):
            stack.kill(name)
            stack.restart(name, wait=False)
        stack.wait_for(lambda: SyncerLease.objects.get(job=job, shard=0).restarts >= 1
                       or Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=90, what="syncer restart")
        self.step("kill -9 coordinator", t0, worker=victim, resumed_from_commit=commits)

        # 3. Redis dies and comes back (broker and channel layer)
        if redis is not None and Job.objects.get(pk=job.pk).status == st.RUNNING:
            t0 = time.time()
            before = Job.objects.get(pk=job.pk).outer_steps
            redis.restart()
            stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps > before
                           or Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=60,
                           what="an outer step after the Redis restart")
            self.step("kill -9 redis + restart", t0)
        else:
            self.report["steps"].append({"step": "kill -9 redis + restart", "skipped": True})

        # 4. drain the pool of learner 1
        if Job.objects.get(pk=job.pk).status == st.RUNNING:
            lr = Learner.objects.select_related("pool").get(job=job, index=1)
            slug = lr.pool.slug
            t0 = time.time()
            Pool.objects.filter(slug=slug).update(state=Pool.State.DRAINING)
            busy = ("running", "starting")
            stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL or (
                not Learner.objects.filter(job=job, pool__slug=slug, state__in=busy).exists()
                and Learner.objects.filter(job=job, index=1, state__in=("running", "done")).exists()),
                timeout=60, what="drain")
            moved_to = Learner.objects.select_related("pool").get(job=job, index=1).pool.slug
            self.step("drain pool", t0, pool=slug, learner_1_on=moved_to)

        job = self.wait_end(stack, job, timeout)
        self._report(job, base, time.time() - t_start)

    def _report(self, job: Job, base: Job, seconds: float) -> None:
        incidents = []
        for inc in Incident.objects.filter(job=job).order_by("detected_at"):
            incidents.append({"kind": inc.kind, "description": inc.description,
                              "failed_at": inc.failed_at.isoformat(),
                              "time_to_detect_s": round(inc.time_to_detect_s, 3),
                              "time_to_heal_s": round(inc.time_to_heal_s, 3) if inc.healed_at else None,
                              "tokens_lost": inc.tokens_lost})
        lease = SyncerLease.objects.filter(job=job, shard=0).first()
        rel = None
        if job.final_val_loss is not None and base.final_val_loss:
            rel = (job.final_val_loss - base.final_val_loss) / base.final_val_loss
        self.report.update({
            "job": job.pk, "status": job.status, "seconds": round(seconds, 2),
            "incidents": incidents,
            "initial_val_loss": job.initial_val_loss, "final_val_loss": job.final_val_loss,
            "baseline_val_loss": base.final_val_loss,
            "val_loss_rel_diff": round(rel, 4) if rel is not None else None,
            "tokens_computed": job.tokens_computed, "tokens_contributed": job.tokens_contributed,
            "tokens_lost": job.tokens_lost,
            "duplicates_applied": duplicates_applied(job),
            "duplicate_details": duplicate_details(job)[:10],
            "duplicates_refused": lease.duplicates_refused if lease else None,
            "zombie_contributions_refused": lease.zombies_refused if lease else None,
            "syncer_restarts": lease.restarts if lease else None,
            **downtime(job),
            "finished_at": datetime.now(UTC).isoformat(),
        })


def run_drill(quick: bool = True, json_path: str | None = None, tmp: str | None = None, log=print,
              islands: bool = False) -> dict:
    report = Drill(quick=quick, tmp=tmp, log=log, islands=islands).run()
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, default=str))
    return report
