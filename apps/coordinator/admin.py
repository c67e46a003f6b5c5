"""Admin for the coordinator's bookkeeping: who runs each syncer shard, where learners resume.

Read-only: the runtime writes these rows; an operator reads them when a job misbehaves.
"""
from __future__ import annotations

from django.contrib import admin

from apps.jobs.admin import JobAdmin, ReadOnlyAdmin

from .models import CoordinatorTick, LearnerRuntime, SyncerLease


@admin.register(SyncerLease)
class SyncerLeaseAdmin(ReadOnlyAdmin):
    list_display = ("job", "shard", "epoch", "worker", "last_heartbeat", "commits", "restarts", "finished",
                    "duplicates_refused", "zombies_refused")
    list_filter = ("finished",)
    search_fields = ("job__name", "worker")
    list_select_related = ("job",)


@admin.register(LearnerRuntime)
class LearnerRuntimeAdmin(ReadOnlyAdmin):
    list_display = ("learner", "worker", "pid", "resume_incarnation", "tokens_computed", "tokens_lost",
                    "move_to", "updated_at")
    search_fields = ("learner__job__name", "worker")
    list_select_related = ("learner", "learner__job", "move_to")


@admin.register(CoordinatorTick)
class CoordinatorTickAdmin(ReadOnlyAdmin):
    """When the watchdog and the rebalancer last completed a tick (and how many so far)."""

    list_display = ("name", "at", "count")


class SyncerLeaseInline(admin.TabularInline):
    """On the job page: one row per syncer shard."""

    model = SyncerLease
    extra = 0
    can_delete = False
    fields = ("shard", "epoch", "worker", "last_heartbeat", "commits", "restarts", "finished")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


# The job page shows its syncer shards: the coordinator adds its inline to the jobs admin (the
# coordinator depends on jobs, never the reverse).
JobAdmin.inlines = (*JobAdmin.inlines, SyncerLeaseInline)
