"""Records of the training side: jobs, learners, outer steps, metrics, events, checkpoints."""
from __future__ import annotations

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from . import state as st


class Job(models.Model):
    STATUS_CHOICES = [(s, s.capitalize()) for s in st.STATUSES]

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    team = models.CharField(max_length=60, blank=True, default="")
    name = models.CharField(max_length=100)
    spec = models.JSONField(help_text="validated trainer.spec.JobSpec")
    status = models.CharField(max_length=10, choices=STATUS_CHOICES, default=st.QUEUED)
    status_reason = models.TextField(blank=True, default="")
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Running totals kept by the coordinator.
    outer_steps = models.PositiveIntegerField(default=0)
    tokens_computed = models.BigIntegerField(default=0)
    tokens_contributed = models.BigIntegerField(default=0)
    tokens_lost = models.BigIntegerField(default=0)
    bytes_sent = models.BigIntegerField(default=0)
    initial_val_loss = models.FloatField(null=True, blank=True)
    final_val_loss = models.FloatField(null=True, blank=True)
    energy_j = models.FloatField(default=0)
    cost = models.FloatField(default=0)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="unique_idempotency_key_per_owner",
            )
        ]
        indexes = [
            models.Index(fields=["status"]),
            # the API's job list: a user's jobs, newest first (issue 19)
            models.Index(fields=["owner", "-created_at"], name="jobs_job_owner_created_idx"),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.name}"

    @property
    def is_terminal(self) -> bool:
        return self.status in st.TERMINAL

    def transition(self, target: str, reason: str = "") -> None:
        """Move to `target` if the state machine allows it, atomically; else IllegalTransition."""
        with transaction.atomic():
            current = Job.objects.select_for_update().values_list("status", flat=True).get(pk=self.pk)
            st.check_transition(current, target)
            now = timezone.now()
            fields = {"status": target, "status_reason": reason, "updated_at": now}
            if target == st.RUNNING and self.started_at is None:
                fields["started_at"] = now
            if target in st.TERMINAL:
                fields["finished_at"] = now
            Job.objects.filter(pk=self.pk).update(**fields)
            for k, v in fields.items():
                setattr(self, k, v)
        Event.objects.create(job=self, kind=Event.Kind.STATUS, message=f"{current} → {target}",
                             payload={"from": current, "to": target, "reason": reason})


class Learner(models.Model):
    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        STARTING = "starting", "Starting"
        RUNNING = "running", "Running"
        LOST = "lost", "Lost"
        STOPPED = "stopped", "Stopped"
        DONE = "done", "Done"
        REMOVED = "removed", "Removed"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="learners")
    index = models.PositiveIntegerField()
    incarnation = models.PositiveIntegerField(default=0)
    pool = models.ForeignKey("inventory.Pool", null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="learners")
    node = models.ForeignKey("inventory.Node", null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="learners")
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    work_size = models.PositiveIntegerField(default=0, help_text="inner steps per fragment cycle")
    wire_dtype = models.CharField(max_length=8, default="none")
    tokens = models.BigIntegerField(default=0)
    tokens_contributed = models.BigIntegerField(default=0)
    inner_steps = models.PositiveIntegerField(default=0)
    data_cursor = models.BigIntegerField(default=0)
    tokens_per_s = models.FloatField(null=True, blank=True)
    loss = models.FloatField(null=True, blank=True)
    staleness = models.IntegerField(default=0)
    rejected_contributions = models.PositiveIntegerField(default=0)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="unique_learner_index")]

    def __str__(self) -> str:
        return f"job {self.job_id} learner {self.index}.{self.incarnation}"


class OuterStep(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="outer_step_records")
    fragment = models.PositiveIntegerField()
    version = models.PositiveIntegerField()
    contributors = models.JSONField(
        default=list, help_text="[{learner, incarnation, base_version, tokens, weight, norm, cosine}]"
    )
    merged_norm = models.FloatField()
    duration_s = models.FloatField(default=0)
    blob_uri = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "created_at"]
        constraints = [
            models.UniqueConstraint(fields=["job", "fragment", "version"], name="unique_outer_step")
        ]


class MetricPoint(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    learner = models.ForeignKey(Learner, null=True, blank=True, on_delete=models.CASCADE)
    step = models.BigIntegerField(default=0, help_text="tokens or step, see name")
    name = models.CharField(max_length=40)
    value = models.FloatField()
    time = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["job", "name", "time"])]


class Event(models.Model):
    class Kind(models.TextChoices):
        STATUS = "status", "Status"
        PLACED = "placed", "Placed"
        FAILED = "failed", "Failed"
        REASSIGNED = "reassigned", "Reassigned"
        REBALANCED = "rebalanced", "Rebalanced"
        JOINED = "joined", "Joined"
        LEFT = "left", "Left"
        CHECKPOINTED = "checkpointed", "Checkpointed"
        MERGED = "merged", "Merged"
        REJECTED = "rejected", "Rejected"
        DRAINED = "drained", "Drained"
        INFO = "info", "Info"

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="events")
    pool = models.ForeignKey("inventory.Pool", null=True, blank=True, on_delete=models.SET_NULL)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    message = models.CharField(max_length=300, blank=True)
    payload = models.JSONField(default=dict, blank=True)
    time = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-time"]


class Incident(models.Model):
    """A failure: when it happened, when it was detected, when the work ran again."""

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.CASCADE, related_name="incidents")
    learner = models.ForeignKey(Learner, null=True, blank=True, on_delete=models.SET_NULL)
    pool = models.ForeignKey("inventory.Pool", null=True, blank=True, on_delete=models.SET_NULL)
    kind = models.CharField(max_length=30, default="learner_lost")
    description = models.CharField(max_length=300, blank=True)
    failed_at = models.DateTimeField(help_text="last sign of life")
    detected_at = models.DateTimeField(default=timezone.now)
    healed_at = models.DateTimeField(null=True, blank=True)
    tokens_lost = models.BigIntegerField(default=0)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-detected_at"]

    @property
    def is_open(self) -> bool:
        return self.healed_at is None

    @property
    def time_to_detect_s(self) -> float:
        return (self.detected_at - self.failed_at).total_seconds()

    @property
    def time_to_heal_s(self) -> float | None:
        return (self.healed_at - self.detected_at).total_seconds() if self.healed_at else None


class Checkpoint(models.Model):
    class Kind(models.TextChoices):
        PERIODIC = "periodic", "Periodic"
        FINAL = "final", "Final model export"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    version = models.PositiveIntegerField()
    kind = models.CharField(max_length=10, choices=Kind.choices, default=Kind.PERIODIC)
    blob_uri = models.CharField(max_length=500)
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "-version"]
