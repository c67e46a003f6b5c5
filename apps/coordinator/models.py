"""Coordinator bookkeeping: the syncer lease of a job and the runtime side of each learner."""
from __future__ import annotations

from django.db import models
from django.utils import timezone

from trainer.spec import stored_spec


class SyncerLease(models.Model):
    """Who runs a job's syncer (one shard of it), its fencing epoch and its last committed state.

    A syncer commits only while its epoch is the lease's epoch (checked in the commit
    transaction), so a syncer that was given up for dead can never commit again. A job with
    `syncer_shards` S has S leases; shard k merges the fragments p with p % S == k.
    """

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="syncer_leases")
    shard = models.PositiveIntegerField(default=0)
    epoch = models.PositiveIntegerField(default=0)
    worker = models.CharField(max_length=255, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    commits = models.PositiveIntegerField(default=0, help_text="outer steps committed")
    state_key = models.CharField(max_length=300, blank=True, help_text="blob key of the last snapshot")
    head = models.JSONField(default=dict, blank=True, help_text="{fragment: committed version}")
    restarts = models.PositiveIntegerField(default=0)
    duplicates_refused = models.PositiveIntegerField(default=0)
    zombies_refused = models.PositiveIntegerField(default=0)
    finished = models.BooleanField(default=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "shard"], name="one_lease_per_syncer_shard")]

    def __str__(self) -> str:
        shard = f" shard {self.shard}" if self.shard else ""
        return f"syncer{shard} of job {self.job_id} (epoch {self.epoch})"

    @classmethod
    def shards_of(cls, job) -> list[dict]:
        """One row per syncer shard of a job, for the API and the job page."""
        spec = stored_spec(job.spec)
        shards, fragments = (spec.syncer_shards, spec.fragments) if spec else (1, 1)
        return [
            {"shard": lease.shard, "epoch": lease.epoch, "running": bool(lease.worker) and not lease.finished,
             "last_heartbeat": lease.last_heartbeat, "commits": lease.commits, "restarts": lease.restarts,
             "finished": lease.finished,
             "fragments": [p for p in range(fragments) if p % shards == lease.shard]}
            for lease in cls.objects.filter(job=job).order_by("shard")
        ]


class LearnerRuntime(models.Model):
    """Runtime facts of a learner the jobs app does not model: where it runs, where it resumes."""

    learner = models.OneToOneField("jobs.Learner", on_delete=models.CASCADE, related_name="runtime")
    worker = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    move_to = models.ForeignKey("inventory.Pool", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+", help_text="set by the rebalancer: hand off to this pool")
    move_reason = models.CharField(max_length=300, blank=True)
    island_nodes = models.JSONField(
        default=list, blank=True,
        help_text="worker names of the nodes an island over several nodes holds slots on, rank 0's first "
                  "(set at dispatch: the nodes' reservation and where its ranks start)")
    resume_incarnation = models.PositiveIntegerField(null=True, blank=True)
    resume_point = models.JSONField(
        null=True, blank=True,
        help_text='where the current incarnation resumed: {"tokens": T, "frag_pos": {fragment: end}}; '
                  "older incarnations' contributions are accepted only up to frag_pos")
    tokens_computed = models.BigIntegerField(default=0, help_text="all incarnations together")
    tokens_lost = models.BigIntegerField(default=0)
    start_failures = models.PositiveIntegerField(
        default=0, help_text="failed starts in a row (reset by a start that works); the job fails at the cap")
    last_error = models.CharField(max_length=300, blank=True)
    retry_after = models.DateTimeField(null=True, blank=True, help_text="back-off: no dispatch before")
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"runtime of {self.learner}"


class CoordinatorTick(models.Model):
    """When each periodic tick of the coordinator (watchdog, rebalance) last completed: proof that
    housekeeping runs whatever the jobs hold (the syncers run on their own queue and threads)."""

    name = models.CharField(max_length=40, primary_key=True)
    at = models.DateTimeField(default=timezone.now)
    count = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name} tick #{self.count} at {self.at:%H:%M:%S}"

    @classmethod
    def record(cls, name: str) -> None:
        """Stamp tick `name` (one UPDATE; the row is made on the first tick)."""
        t = timezone.now()
        if not cls.objects.filter(name=name).update(at=t, count=models.F("count") + 1):
            cls.objects.get_or_create(name=name, defaults={"at": t, "count": 1})
