"""Operator admin for the fleet: catalogue, pools (with their nodes), nodes, pool tokens."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import Count, Q
from django.utils import timezone
from django.utils.html import format_html

from .models import AcceleratorType, Node, Pool, PoolToken


def _fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


@admin.register(AcceleratorType)
class AcceleratorTypeAdmin(admin.ModelAdmin):
    list_display = ("slug", "vendor", "model", "kind", "generation", "year", "memory_gib",
                    "peak_bf16_tflops", "tdp_watts", "tflops_per_watt", "pool_count")
    list_filter = ("vendor", "kind", "generation", "year")
    search_fields = ("slug", "vendor", "model", "generation")
    ordering = ("-year", "vendor", "model")

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(_pools=Count("pools"))

    @admin.display(description="pools", ordering="_pools")
    def pool_count(self, obj):
        return obj._pools

    @admin.display(description="TFLOP/s per W")
    def tflops_per_watt(self, obj):
        return _fmt(obj.peak_bf16_tflops / obj.tdp_watts, 2) if obj.tdp_watts else "-"


class NodeInline(admin.TabularInline):
    model = Node
    extra = 0
    fields = ("worker_name", "hostname", "state", "device_count", "agent_version", "last_seen",
              "measured_tokens_per_s")
    readonly_fields = ("worker_name", "hostname", "device_count", "agent_version", "last_seen",
                       "measured_tokens_per_s")
    show_change_link = True


class PoolTokenInline(admin.TabularInline):
    model = PoolToken
    extra = 0
    fields = ("prefix", "created_at", "revoked_at")
    readonly_fields = ("prefix", "created_at")
    can_delete = True

    def has_add_permission(self, request, obj=None):
        # A token's secret is shown once; issue them with the "issue token" action.
        return False


def _set_state(modeladmin, request, queryset, state: str, label: str):
    n = queryset.update(state=state)
    modeladmin.message_user(request, f"{n} {queryset.model._meta.verbose_name_plural} {label}.",
                            messages.SUCCESS)


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "region", "provider", "accelerator", "generation", "device_count",
                    "state_badge", "nodes_online", "total_peak_tflops_display", "total_watts_display",
                    "cost_per_hour_display", "link_gbps", "latency_ms", "speed_factor")
    list_filter = ("state", "provider", "region", "accelerator__generation", "accelerator__vendor")
    search_fields = ("slug", "name", "region", "notes", "accelerator__model")
    list_select_related = ("accelerator",)
    prepopulated_fields = {"slug": ("name",)}
    readonly_fields = ("queue", "total_peak_tflops_display", "total_watts_display", "cost_per_hour_display",
                       "created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("slug", "name", "state", "notes")}),
        ("Place", {"fields": ("region", "provider", "link_gbps", "latency_ms")}),
        ("Hardware", {"fields": ("accelerator", "device_count", "cost_per_device_hour", "speed_factor")}),
        ("Derived", {"fields": ("queue", "total_peak_tflops_display", "total_watts_display",
                                "cost_per_hour_display", "created_at", "updated_at")}),
    )
    inlines = (NodeInline, PoolTokenInline)
    actions = ("drain", "activate", "disable", "issue_token")

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(
            _online=Count("nodes", filter=Q(nodes__state=Node.State.ONLINE))
        )

    @admin.display(description="generation", ordering="accelerator__generation")
    def generation(self, obj):
        return obj.accelerator.generation

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj):
        colour = {"active": "#2e7d32", "draining": "#ef6c00", "disabled": "#757575"}[obj.state]
        return format_html('<b style="color:{}">{}</b>', colour, obj.get_state_display())

    @admin.display(description="nodes online", ordering="_online")
    def nodes_online(self, obj):
        return getattr(obj, "_online", None)

    @admin.display(description="peak TFLOP/s (total)")
    def total_peak_tflops_display(self, obj):
        return _fmt(obj.total_peak_tflops) if obj.pk else "-"

    @admin.display(description="watts (total TDP)")
    def total_watts_display(self, obj):
        return f"{obj.total_watts:,}" if obj.pk else "-"

    @admin.display(description="cost per hour")
    def cost_per_hour_display(self, obj):
        return _fmt(obj.cost_per_hour, 2) if obj.pk else "-"

    @admin.action(description="Drain selected pools (finish running work, take no new work)",
                  permissions=("change",))
    def drain(self, request, queryset):
        _set_state(self, request, queryset, Pool.State.DRAINING, "draining")

    @admin.action(description="Activate selected pools", permissions=("change",))
    def activate(self, request, queryset):
        _set_state(self, request, queryset, Pool.State.ACTIVE, "activated")

    @admin.action(description="Disable selected pools", permissions=("change",))
    def disable(self, request, queryset):
        _set_state(self, request, queryset, Pool.State.DISABLED, "disabled")

    def has_issue_token_permission(self, request):
        """A worker token is a live credential: it needs the right to change the pool and to add
        pool tokens (the `inventory.add_pooltoken` permission), not only to view the pool."""
        token_opts = PoolToken._meta
        return self.has_change_permission(request) and request.user.has_perm(
            f"{token_opts.app_label}.{get_permission_codename('add', token_opts)}")

    @admin.action(description="Issue a worker token for each selected pool (shown once)",
                  permissions=("issue_token",))
    def issue_token(self, request, queryset):
        for pool in queryset:
            _, raw = PoolToken.issue(pool)
            self.message_user(
                request, f"{pool.slug}: DILOCO_POOL_TOKEN={raw}  (copy it now: it is not stored)",
                messages.WARNING,
            )


class StaleFilter(admin.SimpleListFilter):
    title = "heartbeat"
    parameter_name = "heartbeat"

    def lookups(self, request, model_admin):
        return (("fresh", "fresh"), ("stale", "stale (past HEARTBEAT_TIMEOUT_S)"))

    def queryset(self, request, queryset):
        cutoff = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_S)
        if self.value() == "fresh":
            return queryset.filter(last_seen__gte=cutoff)
        if self.value() == "stale":
            return queryset.filter(last_seen__lt=cutoff)
        return queryset


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("worker_name", "pool", "hostname", "state", "device_count", "devices_summary",
                    "agent_version", "last_seen", "seen_ago", "measured_tokens_per_s")
    list_filter = ("state", "pool", "pool__region", "pool__provider", "pool__accelerator__generation",
                   StaleFilter)
    search_fields = ("worker_name", "hostname", "pool__slug")
    list_select_related = ("pool",)
    readonly_fields = ("hostname", "worker_name", "devices", "device_count", "agent_version", "pid",
                       "registered_at", "last_seen", "measured_tokens_per_s")
    actions = ("drain", "activate", "disable")

    @admin.display(description="devices")
    def devices_summary(self, obj):
        parts = []
        for d in obj.devices or []:
            if isinstance(d, dict):
                parts.append(str(d.get("name") or d.get("kind") or "?"))
        return ", ".join(parts)[:80] or "-"

    @admin.display(description="seen", ordering="last_seen")
    def seen_ago(self, obj):
        return f"{(timezone.now() - obj.last_seen).total_seconds():.0f} s ago"

    @admin.action(description="Drain selected nodes", permissions=("change",))
    def drain(self, request, queryset):
        _set_state(self, request, queryset, Node.State.DRAINING, "draining")

    @admin.action(description="Activate selected nodes (mark online)", permissions=("change",))
    def activate(self, request, queryset):
        _set_state(self, request, queryset, Node.State.ONLINE, "online")

    @admin.action(description="Disable selected nodes (mark offline)", permissions=("change",))
    def disable(self, request, queryset):
        _set_state(self, request, queryset, Node.State.OFFLINE, "offline")


@admin.register(PoolToken)
class PoolTokenAdmin(admin.ModelAdmin):
    list_display = ("pool", "prefix", "created_at", "revoked_at", "active")
    list_filter = ("pool", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("pool__slug", "prefix")
    readonly_fields = ("pool", "prefix", "key_hash", "created_at")
    actions = ("revoke",)

    def has_add_permission(self, request):
        return False  # issued from the pool page (the secret is shown once)

    @admin.display(boolean=True)
    def active(self, obj):
        return obj.revoked_at is None

    @admin.action(description="Revoke selected tokens", permissions=("change",))
    def revoke(self, request, queryset):
        n = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"{n} tokens revoked.", messages.SUCCESS)
