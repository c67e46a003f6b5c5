"""Serializers: what the API shows of each model and what it accepts."""
from __future__ import annotations

import heapq

from django.contrib.auth import get_user_model
from django.db.models import Count, Sum
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.validators import UniqueValidator

from apps.inventory.models import AcceleratorType, Node, Pool
from apps.jobs.access import team_error, team_names
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner
from trainer.spec import stored_spec

from .fast_output import FastOutputMixin
from .models import ApiToken

_SLUG = r"^[-a-zA-Z0-9_]+$"


MAX_UNKNOWN_NAMED = 10  # unknown keys named one by one in a 400; the rest are counted


def unknown_fields(data, known) -> dict[str, list[str]]:
    """{key: ["Unknown field."]} for at most MAX_UNKNOWN_NAMED of `data`'s keys not in `known`
    (the first in sorted order), then {"non_field_errors": ["... and N more unknown fields."]}.

    Echoing every key made a 820 KiB body of junk keys cost seconds of CPU and a 1.7 MiB reply."""
    extra = [k for k in data if k not in known]
    if not extra:
        return {}
    named = heapq.nsmallest(MAX_UNKNOWN_NAMED, (str(k) for k in extra))
    out = {k[:100]: ["Unknown field."] for k in named}
    if len(extra) > len(named):
        out["non_field_errors"] = [f"... and {len(extra) - len(named)} more unknown fields."]
    return out


class StrictSerializerMixin:
    """Refuse fields the serializer does not know instead of silently dropping them."""

    def to_internal_value(self, data):
        unknown = {}
        if isinstance(data, dict):
            known = {name for name, f in self.fields.items() if not f.read_only}
            unknown = unknown_fields(data, known)
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if unknown and isinstance(exc.detail, dict):
                merged = {**exc.detail, **unknown}
                both = "non_field_errors" in exc.detail and "non_field_errors" in unknown
                if both:
                    merged["non_field_errors"] = [*exc.detail["non_field_errors"],
                                                  *unknown["non_field_errors"]]
                raise serializers.ValidationError(merged) from None
            raise
        if unknown:
            raise serializers.ValidationError(unknown)
        return value


# --- inventory -----------------------------------------------------------------------------

class AcceleratorTypeSerializer(StrictSerializerMixin, serializers.ModelSerializer):
    slug = serializers.RegexField(_SLUG, max_length=40, validators=[
        UniqueValidator(AcceleratorType.objects.all(), message="An accelerator type with this slug exists.")])
    year = serializers.IntegerField(min_value=1990, max_value=2100)
    memory_gib = serializers.FloatField(min_value=0, max_value=1e6)
    peak_bf16_tflops = serializers.FloatField(min_value=0, max_value=1e7)
    tdp_watts = serializers.IntegerField(min_value=0, max_value=100_000)

    class Meta:
        model = AcceleratorType
        fields = ["id", "slug", "vendor", "model", "kind", "generation", "year", "memory_gib",
                  "peak_bf16_tflops", "tdp_watts"]


class PoolSerializer(StrictSerializerMixin, serializers.ModelSerializer):
    slug = serializers.RegexField(_SLUG, max_length=40, validators=[
        UniqueValidator(Pool.objects.all(), message="A pool with this slug exists.")])
    accelerator = serializers.SlugRelatedField(slug_field="slug", queryset=AcceleratorType.objects.all())
    device_count = serializers.IntegerField(min_value=0, max_value=1_000_000)
    cost_per_device_hour = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=0,
                                                    coerce_to_string=False)
    link_gbps = serializers.FloatField(min_value=0, max_value=1e6)
    latency_ms = serializers.FloatField(min_value=0, max_value=1e6, required=False)
    speed_factor = serializers.FloatField(min_value=0.001, max_value=1.0, required=False)
    state = serializers.CharField(read_only=True)
    nodes_online = serializers.IntegerField(read_only=True)
    learners_running = serializers.IntegerField(read_only=True)
    total_peak_tflops = serializers.FloatField(read_only=True)
    total_watts = serializers.IntegerField(read_only=True)
    cost_per_hour = serializers.FloatField(read_only=True)

    class Meta:
        model = Pool
        fields = ["id", "slug", "name", "region", "provider", "accelerator", "device_count",
                  "cost_per_device_hour", "link_gbps", "latency_ms", "speed_factor", "state", "notes",
                  "nodes_online", "learners_running", "total_peak_tflops", "total_watts", "cost_per_hour",
                  "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]


class NodeSerializer(StrictSerializerMixin, serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="slug", queryset=Pool.objects.all())
    device_count = serializers.IntegerField(min_value=0, max_value=100_000, required=False)
    measured_tokens_per_s = serializers.FloatField(min_value=0, max_value=1e12, required=False,
                                                   allow_null=True)

    class Meta:
        model = Node
        fields = ["id", "pool", "hostname", "worker_name", "devices", "device_count", "agent_version",
                  "pid", "state", "registered_at", "last_seen", "measured_tokens_per_s"]
        read_only_fields = ["devices", "pid", "registered_at", "last_seen"]


# --- jobs ----------------------------------------------------------------------------------

class JobSubmitSerializer(StrictSerializerMixin, serializers.Serializer):
    """Body of POST /jobs/ and /jobs/dry-run/: the spec (trainer.spec.JobSpec) and an optional team."""

    spec = serializers.JSONField(help_text="a job spec, see trainer/spec.py (JobSpec)")
    team = serializers.RegexField(
        r"^[\w .-]*$", max_length=60, required=False, allow_blank=True, default="",
        help_text="a team you belong to (a group staff create in the admin): its members see the job too")

    def validate_team(self, value):
        request = self.context.get("request")
        error = team_error(request.user, value) if request is not None else None
        if error:
            raise serializers.ValidationError(error)
        return value

    def validate_spec(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("The spec must be a JSON object.")
        return value


class JobSerializer(FastOutputMixin, serializers.ModelSerializer):
    owner = serializers.SerializerMethodField(help_text="the owner's username")
    total_tokens = serializers.SerializerMethodField()
    tokens_done = serializers.SerializerMethodField(
        help_text="live progress: tokens computed so far (learners' counters while running)")
    progress = serializers.SerializerMethodField(help_text="tokens_done / total_tokens, 0..1")

    class Meta:
        model = Job
        fields = ["id", "name", "owner", "team", "status", "status_reason", "spec", "created_at",
                  "updated_at", "started_at", "finished_at", "outer_steps", "tokens_computed",
                  "tokens_contributed", "tokens_lost", "bytes_sent", "initial_val_loss", "final_val_loss",
                  "energy_j", "cost", "total_tokens", "tokens_done", "progress"]
        read_only_fields = fields

    def get_owner(self, job) -> str:
        name = getattr(job, "owner_username", None)  # annotated by the API's queries (views.jobs)
        return job.owner.username if name is None else name

    def get_total_tokens(self, job) -> int:
        # progress needs it too: the stored spec is validated once per spec object (a reload
        # of the job brings a new one)
        memo = job.__dict__.get("_api_total_tokens")
        if memo is None or memo[0] is not job.spec:
            spec = stored_spec(job.spec)
            memo = job.__dict__["_api_total_tokens"] = (job.spec, spec.total_tokens if spec else 0)
        return memo[1]

    def get_tokens_done(self, job) -> int:
        live = getattr(job, "learner_tokens", None)
        if live is None:
            live = Learner.objects.filter(job=job).aggregate(n=Sum("tokens"))["n"]
        return max(job.tokens_computed, int(live or 0))

    def get_progress(self, job) -> float:
        total = self.get_total_tokens(job)
        return round(min(1.0, self.get_tokens_done(job) / total), 4) if total else 0.0


class SyncerShardSerializer(serializers.Serializer):
    shard = serializers.IntegerField()
    epoch = serializers.IntegerField(help_text="fencing epoch: how many times this shard was started")
    running = serializers.BooleanField(help_text="a worker holds the lease (not stopped, not finished)")
    last_heartbeat = serializers.DateTimeField(allow_null=True)
    commits = serializers.IntegerField(help_text="outer steps this shard committed")
    restarts = serializers.IntegerField(help_text="restarts after a missed heartbeat")
    finished = serializers.BooleanField()
    fragments = serializers.ListField(child=serializers.IntegerField(), help_text="fragments it merges")


class JobDetailSerializer(JobSerializer):
    latest = serializers.SerializerMethodField(help_text="latest job-level value of each metric")
    learner_counts = serializers.SerializerMethodField()
    syncer = serializers.SerializerMethodField(help_text="one entry per syncer shard (syncer_shards)")

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "latest", "learner_counts", "syncer"]
        read_only_fields = fields

    @extend_schema_field(SyncerShardSerializer(many=True))
    def get_syncer(self, job) -> list[dict]:
        from apps.coordinator.models import SyncerLease

        rows = SyncerLease.shards_of(job)
        return SyncerShardSerializer(rows, many=True).data

    def get_latest(self, job) -> dict[str, float]:
        from .metrics import latest_values

        return latest_values(job)

    def get_learner_counts(self, job) -> dict[str, int]:
        # one small GROUP BY over the job's learners: compiled and run, it costs less than seven
        # filtered COUNTs in the job's own query (issue 19: 1.95 -> 1.47 ms of the web process's
        # CPU per detail, PostgreSQL's no more)
        rows = dict(Learner.objects.filter(job_id=job.pk).order_by().values_list("state")
                    .annotate(n=Count("id")))
        return {state: rows[state] for state in Learner.State.values if rows.get(state)}


class LearnerSerializer(serializers.ModelSerializer):
    # null until placed (pool) or picked up by a worker (node); allow_null puts that in the schema
    pool = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    node = serializers.SlugRelatedField(slug_field="worker_name", read_only=True, allow_null=True)

    class Meta:
        model = Learner
        fields = ["id", "index", "incarnation", "pool", "node", "state", "work_size", "wire_dtype", "tokens",
                  "tokens_contributed", "inner_steps", "data_cursor", "tokens_per_s", "loss", "staleness",
                  "rejected_contributions", "last_heartbeat", "started_at"]
        read_only_fields = fields


class EventSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)

    class Meta:
        model = Event
        fields = ["id", "job", "pool", "kind", "message", "payload", "time"]
        read_only_fields = fields


class IncidentSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    learner = serializers.IntegerField(source="learner.index", read_only=True, allow_null=True, default=None)
    time_to_detect_s = serializers.FloatField(read_only=True)
    time_to_heal_s = serializers.FloatField(read_only=True, allow_null=True)
    is_open = serializers.BooleanField(read_only=True)

    class Meta:
        model = Incident
        fields = ["id", "job", "learner", "pool", "kind", "description", "failed_at", "detected_at",
                  "healed_at", "tokens_lost", "details", "time_to_detect_s", "time_to_heal_s", "is_open"]
        read_only_fields = fields


class CheckpointSerializer(serializers.ModelSerializer):
    download_url = serializers.SerializerMethodField()

    class Meta:
        model = Checkpoint
        fields = ["id", "job", "version", "kind", "size_bytes", "sha256", "created_at", "download_url"]
        read_only_fields = fields

    def get_download_url(self, ckpt) -> str:
        from django.urls import reverse

        url = reverse("api:checkpoint-download", args=[ckpt.pk])
        request = self.context.get("request")
        return request.build_absolute_uri(url) if request else url


class JobListQuerySerializer(serializers.Serializer):
    status = serializers.MultipleChoiceField(choices=[s for s, _ in Job.STATUS_CHOICES], required=False)
    search = serializers.CharField(max_length=100, required=False, allow_blank=True)
    owner = serializers.CharField(max_length=150, required=False)
    team = serializers.CharField(max_length=60, required=False)


class MetricsQuerySerializer(serializers.Serializer):
    name = serializers.ListField(child=serializers.RegexField(r"^[\w.-]{1,40}$"), required=False,
                                 max_length=20)
    points = serializers.IntegerField(min_value=1, max_value=5000, default=500)
    learner = serializers.CharField(required=False, max_length=10,
                                    help_text="'job' for job-level series, 'all', or a learner index")

    def validate_learner(self, value: str) -> str | int:
        if value in ("job", "all"):
            return value
        if value.isascii() and value.isdigit() and len(value) <= 4:
            return int(value)
        raise serializers.ValidationError("Must be 'job', 'all' or a learner index.")


class MetricSeriesSerializer(serializers.Serializer):
    name = serializers.CharField()
    learner = serializers.IntegerField(allow_null=True)
    points = serializers.ListField(child=serializers.ListField(child=serializers.FloatField()),
                                   help_text="[step, value, unix time] per bucket, sorted by step")


class MetricsResponseSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    points = serializers.IntegerField(help_text="maximum points per series")
    series = MetricSeriesSerializer(many=True)


# --- auth ----------------------------------------------------------------------------------

class TokenCreateSerializer(StrictSerializerMixin, serializers.Serializer):
    username = serializers.CharField(max_length=150, required=False)
    password = serializers.CharField(max_length=256, required=False, trim_whitespace=False,
                                     style={"input_type": "password"})
    name = serializers.RegexField(r"^[\w .@:/-]+$", max_length=60, required=False, default="cli")
    expires_in_days = serializers.IntegerField(min_value=1, max_value=3650, required=False, allow_null=True)


class ApiTokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at", "expires_at", "revoked_at"]
        read_only_fields = fields


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="the key: shown once, store it now")
    username = serializers.CharField(source="user.username", read_only=True)

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token", "username"]
        read_only_fields = fields


class MeSerializer(serializers.ModelSerializer):
    teams = serializers.SerializerMethodField(help_text="teams you submit jobs for and whose jobs you see")

    class Meta:
        model = get_user_model()
        fields = ["id", "username", "email", "is_staff", "teams"]
        read_only_fields = fields

    def get_teams(self, user) -> list[str]:
        return sorted(team_names(user))


# --- agent ---------------------------------------------------------------------------------

class AssignmentSerializer(serializers.ModelSerializer):
    job = serializers.IntegerField(source="job_id", read_only=True)
    pool = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    job_status = serializers.CharField(source="job.status", read_only=True)
    spec = serializers.JSONField(source="job.spec", read_only=True)

    class Meta:
        model = Learner
        fields = ["job", "index", "incarnation", "pool", "state", "work_size", "wire_dtype", "data_cursor",
                  "job_status", "spec"]
        read_only_fields = fields
