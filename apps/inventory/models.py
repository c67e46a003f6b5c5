"""Fleet inventory: accelerator catalogue, pools of devices, nodes (worker hosts)."""
from __future__ import annotations

import hashlib
import secrets

from django.db import models
from django.utils import timezone


class AcceleratorType(models.Model):
    """A kind of accelerator with its public figures (vendor datasheets)."""

    class Kind(models.TextChoices):
        GPU = "gpu", "GPU"
        TPU = "tpu", "TPU"
        CPU = "cpu", "CPU"

    slug = models.SlugField(max_length=40, unique=True)
    vendor = models.CharField(max_length=40)
    model = models.CharField(max_length=80)
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.GPU)
    generation = models.CharField(max_length=40, help_text="architecture, e.g. Hopper, v5p")
    year = models.PositiveIntegerField()
    memory_gib = models.FloatField()
    peak_bf16_tflops = models.FloatField(help_text="peak dense bf16 TFLOP/s per device")
    tdp_watts = models.PositiveIntegerField()
    source = models.CharField(
        max_length=300, blank=True, help_text="where the figures come from; estimates are marked as such"
    )

    class Meta:
        ordering = ["-year", "vendor", "model"]

    def __str__(self) -> str:
        return f"{self.vendor} {self.model}"


class Pool(models.Model):
    """A pool of identical accelerators in one place, served by one Celery queue."""

    class Provider(models.TextChoices):
        ONPREM = "onprem", "On-prem"
        AWS = "aws", "AWS"
        GCP = "gcp", "Google Cloud"
        AZURE = "azure", "Azure"
        OTHER = "other", "Other cloud"

    class State(models.TextChoices):
        ACTIVE = "active", "Active"
        DRAINING = "draining", "Draining"
        DISABLED = "disabled", "Disabled"

    slug = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=100)
    region = models.CharField(max_length=60)
    provider = models.CharField(max_length=10, choices=Provider.choices, default=Provider.ONPREM)
    accelerator = models.ForeignKey(AcceleratorType, on_delete=models.PROTECT, related_name="pools")
    device_count = models.PositiveIntegerField()
    cost_per_device_hour = models.DecimalField(max_digits=10, decimal_places=4, default=0)
    link_gbps = models.FloatField(help_text="link bandwidth to the coordinator, Gbit/s")
    latency_ms = models.FloatField(default=1.0, help_text="latency to the coordinator, ms")
    speed_factor = models.FloatField(
        default=1.0,
        help_text="throttle for demo pools that stand for older generations on one CPU (1 = full)",
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.ACTIVE)
    notes = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def queue(self) -> str:
        return f"pool.{self.slug}"

    @property
    def total_peak_tflops(self) -> float:
        return self.device_count * self.accelerator.peak_bf16_tflops

    @property
    def total_watts(self) -> int:
        return self.device_count * self.accelerator.tdp_watts

    @property
    def cost_per_hour(self) -> float:
        return float(self.cost_per_device_hour) * self.device_count


class PoolTokenQuerySet(models.QuerySet):
    def update(self, **kwargs):
        """A revocation (`revoked_at` set, e.g. the admin action) also closes the tokens' open
        agent sockets at once, after the commit (apps.telemetry.publish)."""
        revoking = kwargs.get("revoked_at") is not None
        hashes = (list(self.filter(revoked_at__isnull=True).values_list("key_hash", flat=True))
                  if revoking else [])
        n = super().update(**kwargs)
        if hashes:
            from django.db import transaction

            from apps.telemetry.publish import close_token_sockets

            transaction.on_commit(lambda: close_token_sockets(hashes), robust=True)
        return n


class PoolToken(models.Model):
    """A worker credential scoped to one pool; only its hash is stored."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="tokens")
    prefix = models.CharField(max_length=8)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = PoolTokenQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.pool.slug}:{self.prefix}…"

    @staticmethod
    def hash(raw: str) -> str:
        return hashlib.sha256(raw.encode()).hexdigest()

    @classmethod
    def issue(cls, pool: Pool) -> tuple[PoolToken, str]:
        raw = f"pt_{pool.slug}_{secrets.token_urlsafe(24)}"
        return cls.objects.create(pool=pool, prefix=raw[-8:], key_hash=cls.hash(raw)), raw

    @classmethod
    def authenticate(cls, raw: str) -> Pool | None:
        tok = (
            cls.objects.select_related("pool")
            .filter(key_hash=cls.hash(raw or ""), revoked_at__isnull=True)
            .first()
        )
        return tok.pool if tok else None


class Node(models.Model):
    """A worker host of a pool; registers itself when its Celery worker starts."""

    class State(models.TextChoices):
        ONLINE = "online", "Online"
        DRAINING = "draining", "Draining"
        OFFLINE = "offline", "Offline"
        LOST = "lost", "Lost"

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="nodes")
    hostname = models.CharField(max_length=255)
    worker_name = models.CharField(max_length=255, unique=True)
    devices = models.JSONField(default=list, blank=True, help_text="devices detected at start")
    device_count = models.PositiveIntegerField(default=1)
    agent_version = models.CharField(max_length=40, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    address = models.GenericIPAddressField(
        null=True, blank=True,
        help_text="where the node's peers reach it (DILOCO_NODE_ADDRESS, else its address towards the "
                  "broker): the rendezvous of a learner island whose rank 0 runs here")
    state = models.CharField(max_length=10, choices=State.choices, default=State.ONLINE)
    registered_at = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now)
    measured_tokens_per_s = models.FloatField(null=True, blank=True)
    purged_at = models.DateTimeField(
        null=True, blank=True,
        help_text="hidden from the fleet view since (offline too long); a heartbeat after it shows it again",
    )

    class Meta:
        ordering = ["pool__slug", "hostname"]

    def __str__(self) -> str:
        return self.worker_name

    @property
    def is_purged(self) -> bool:
        return self.purged_at is not None and self.last_seen <= self.purged_at


def visible_nodes_q(prefix: str = "") -> models.Q:
    """Nodes the fleet view shows: never purged, or seen again since their purge."""
    return models.Q(**{f"{prefix}purged_at__isnull": True}) | models.Q(
        **{f"{prefix}last_seen__gt": models.F(f"{prefix}purged_at")})


def estimated_watts(tdp_watts: float, devices: int, busy: int) -> float:
    """TDP-based draw: devices running learners draw their TDP, idle ones about 15 %."""
    return float(tdp_watts) * (busy + 0.15 * max(devices - busy, 0))


class FleetSample(models.Model):
    """One reading of a pool (node empty) or of one node: the points of its history charts."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="samples")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.CASCADE, related_name="samples")
    time = models.DateTimeField(default=timezone.now, db_index=True)
    devices = models.PositiveIntegerField(default=0)
    busy = models.PositiveIntegerField(default=0, help_text="devices running a learner")
    utilisation = models.FloatField(default=0.0)
    tokens_per_s = models.FloatField(default=0.0)
    watts = models.FloatField(default=0.0, help_text="TDP-based estimate")

    class Meta:
        indexes = [models.Index(fields=["pool", "time"]), models.Index(fields=["node", "time"])]
