"""Admin for the training records. Mostly read-only: the runtime writes these rows.

Status changes go through the state machine (actions call apps.jobs.services), never
through a free-form edit of the status field.
"""
from __future__ import annotations

import json

from django.contrib import admin, messages
from django.utils.html import format_html

from . import services
from . import state as st
from .models import Checkpoint, Event, Incident, Job, Learner, MetricPoint, OuterStep


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written by the runtime: viewable, deletable by a superuser, never hand-edited."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class LearnerInline(admin.TabularInline):
    model = Learner
    extra = 0
    can_delete = False
    fields = ("index", "incarnation", "state", "pool", "node", "tokens", "inner_steps", "tokens_per_s",
              "loss", "staleness", "last_heartbeat")
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "team", "status", "learner_count", "outer_steps",
                    "tokens_computed", "goodput", "final_val_loss", "created_at", "finished_at")
    list_filter = ("status", "team", "created_at")
    search_fields = ("name", "owner__username", "team", "idempotency_key")
    list_select_related = ("owner",)
    date_hierarchy = "created_at"
    readonly_fields = ("owner", "spec_pretty", "status", "status_reason", "idempotency_key", "created_at",
                       "updated_at", "started_at", "finished_at", "outer_steps", "tokens_computed",
                       "tokens_contributed", "tokens_lost", "goodput", "bytes_sent", "initial_val_loss",
                       "final_val_loss", "energy_j", "cost")
    fieldsets = (
        (None, {"fields": ("name", "team", "owner", "status", "status_reason", "idempotency_key")}),
        ("Spec", {"fields": ("spec_pretty",)}),
        ("Progress", {"fields": ("outer_steps", "tokens_computed", "tokens_contributed", "tokens_lost",
                                 "goodput", "bytes_sent", "initial_val_loss", "final_val_loss",
                                 "energy_j", "cost")}),
        ("Times", {"fields": ("created_at", "updated_at", "started_at", "finished_at")}),
    )
    inlines = (LearnerInline,)
    actions = ("cancel", "pause", "resume")

    def has_add_permission(self, request):
        return False  # jobs are submitted through the dashboard, the API or the CLI (one validation path)

    @admin.display(description="learners")
    def learner_count(self, obj):
        return obj.learners.count()

    @admin.display(description="goodput")
    def goodput(self, obj):
        if not obj.tokens_computed:
            return "-"
        return f"{100 * obj.tokens_contributed / obj.tokens_computed:.1f}%"

    @admin.display(description="spec")
    def spec_pretty(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.spec, indent=2, sort_keys=True))

    def _apply(self, request, queryset, fn, verb):
        done, refused = 0, []
        for job in queryset:
            try:
                fn(job, f"{verb} by {request.user.get_username()} (admin)")
                done += 1
            except st.IllegalTransition as exc:
                refused.append(f"#{job.pk}: {exc}")
        if done:
            self.message_user(request, f"{done} jobs {verb}.", messages.SUCCESS)
        for msg in refused:
            self.message_user(request, msg, messages.ERROR)

    @admin.action(description="Cancel selected jobs", permissions=("change",))
    def cancel(self, request, queryset):
        self._apply(request, queryset, services.cancel_job, "cancelled")

    @admin.action(description="Pause selected jobs", permissions=("change",))
    def pause(self, request, queryset):
        self._apply(request, queryset, services.pause_job, "paused")

    @admin.action(description="Resume selected jobs", permissions=("change",))
    def resume(self, request, queryset):
        self._apply(request, queryset, services.resume_job, "resumed")


@admin.register(Learner)
class LearnerAdmin(ReadOnlyAdmin):
    list_display = ("__str__", "job", "index", "incarnation", "state", "pool", "node", "tokens",
                    "inner_steps", "tokens_per_s", "loss", "last_heartbeat")
    list_filter = ("state", "pool", "pool__accelerator__generation")
    search_fields = ("job__name", "node__worker_name", "pool__slug")
    list_select_related = ("job", "pool", "node")


@admin.register(OuterStep)
class OuterStepAdmin(ReadOnlyAdmin):
    list_display = ("job", "fragment", "version", "contributor_count", "merged_norm", "duration_s",
                    "created_at")
    list_filter = ("fragment",)
    search_fields = ("job__name",)
    list_select_related = ("job",)

    @admin.display(description="contributors")
    def contributor_count(self, obj):
        return len(obj.contributors or [])


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("time", "job", "pool", "kind", "message")
    list_filter = ("kind", "pool")
    search_fields = ("message", "job__name")
    list_select_related = ("job", "pool")
    date_hierarchy = "time"


@admin.register(Incident)
class IncidentAdmin(ReadOnlyAdmin):
    list_display = ("detected_at", "job", "kind", "pool", "learner", "open", "detect_s", "heal_s",
                    "tokens_lost")
    list_filter = ("kind", "pool", ("healed_at", admin.EmptyFieldListFilter))
    search_fields = ("description", "job__name")
    list_select_related = ("job", "pool", "learner")

    @admin.display(boolean=True, description="open")
    def open(self, obj):
        return obj.is_open

    @admin.display(description="time to detect (s)")
    def detect_s(self, obj):
        return f"{obj.time_to_detect_s:.1f}"

    @admin.display(description="time to heal (s)")
    def heal_s(self, obj):
        v = obj.time_to_heal_s
        return "-" if v is None else f"{v:.1f}"


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ("job", "version", "kind", "size_bytes", "sha256_short", "blob_uri", "created_at")
    list_filter = ("kind",)
    search_fields = ("job__name", "sha256", "blob_uri")
    list_select_related = ("job",)

    @admin.display(description="sha256")
    def sha256_short(self, obj):
        return obj.sha256[:12]


@admin.register(MetricPoint)
class MetricPointAdmin(ReadOnlyAdmin):
    list_display = ("time", "job", "learner", "name", "step", "value")
    list_filter = ("name",)
    search_fields = ("job__name", "name")
    list_select_related = ("job", "learner")
    show_full_result_count = False  # metric tables get large
