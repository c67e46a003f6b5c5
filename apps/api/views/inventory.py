"""Accelerator types, pools and nodes: everyone signed in reads, staff with the model permission write."""
from __future__ import annotations

from django.contrib.auth import get_permission_codename
from django.db import IntegrityError, transaction
from django.db.models import Count, ProtectedError, Q
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import filters, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import SAFE_METHODS
from rest_framework.response import Response

from apps.inventory.models import AcceleratorType, Node, Pool
from apps.jobs.models import Event, Learner

from .. import serializers as s
from ..exceptions import Conflict
from ..permissions import IsStaffOrReadOnly
from .common import SafeQueryMixin, publish_fleet

_WRITE_PERMISSION = {"POST": "add", "PUT": "change", "PATCH": "change", "DELETE": "delete"}


class FleetWritePermission(IsStaffOrReadOnly):
    """Signed-in users read; staff write, each write under the model's permission, as in the admin
    (issue 35: staff with only `view_pool` drained pools from the admin). Creating needs `add`,
    editing and the state actions (drain, activate, disable) `change`, removing `delete`."""

    def has_permission(self, request, view) -> bool:
        if not super().has_permission(request, view):
            return False
        if request.method in SAFE_METHODS:
            return True
        verb = _WRITE_PERMISSION.get(request.method, "change")
        if request.method == "POST" and getattr(view, "action", None) != "create":
            verb = "change"  # drain, activate, disable change a row
        opts = view.get_serializer_class().Meta.model._meta
        perm = f"{opts.app_label}.{get_permission_codename(verb, opts)}"
        if request.user.has_perm(perm):
            return True
        self.message = f"You do not have the {perm} permission."
        return False


class _ProtectedDestroyMixin:
    """Integrity problems (a race on a unique slug, a row still in use) are 409s, not 500s."""

    def perform_create(self, serializer):
        try:
            with transaction.atomic():
                serializer.save()
        except IntegrityError as exc:
            raise Conflict(f"Conflicts with an existing record: {str(exc).splitlines()[0][:200]}") from None

    def perform_update(self, serializer):
        self.perform_create(serializer)

    def perform_destroy(self, instance):
        try:
            instance.delete()
        except ProtectedError as exc:
            names = ", ".join(sorted(str(o) for o in list(exc.protected_objects)[:5]))
            raise Conflict(f"{instance} is still in use by: {names}") from None


class AcceleratorTypeViewSet(SafeQueryMixin, _ProtectedDestroyMixin, viewsets.ModelViewSet):
    """The accelerator catalogue."""

    queryset = AcceleratorType.objects.all()
    serializer_class = s.AcceleratorTypeSerializer
    permission_classes = [FleetWritePermission]
    lookup_field = "slug"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    filter_backends = [filters.SearchFilter, filters.OrderingFilter]
    search_fields = ["slug", "vendor", "model", "generation"]
    ordering_fields = ["year", "peak_bf16_tflops", "memory_gib", "tdp_watts"]


@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("state", str, enum=[c for c, _ in Pool.State.choices]),
    OpenApiParameter("provider", str, enum=[c for c, _ in Pool.Provider.choices]),
]))
class PoolViewSet(SafeQueryMixin, _ProtectedDestroyMixin, viewsets.ModelViewSet):
    """Pools of accelerators; `drain`, `activate` and `disable` change what gets placed there."""

    serializer_class = s.PoolSerializer
    permission_classes = [FleetWritePermission]
    lookup_field = "slug"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"
    filter_backends = [filters.SearchFilter, filters.OrderingFilter]
    search_fields = ["slug", "name", "region", "accelerator__model"]
    ordering_fields = ["slug", "region", "device_count"]

    def get_queryset(self):
        qs = Pool.objects.select_related("accelerator").annotate(
            nodes_online=Count("nodes", filter=Q(nodes__state=Node.State.ONLINE), distinct=True),
            learners_running=Count("learners", filter=Q(learners__state=Learner.State.RUNNING),
                                   distinct=True),
        )
        params = self.request.query_params
        if params.get("state") in Pool.State.values:
            qs = qs.filter(state=params["state"])
        if params.get("provider") in Pool.Provider.values:
            qs = qs.filter(provider=params["provider"])
        return qs.order_by("slug")

    def _annotated(self, response):
        """Answer writes with the same annotated row a GET returns."""
        if response.status_code < 300 and isinstance(response.data, dict) and "id" in response.data:
            response.data = self.get_serializer(self.get_queryset().get(pk=response.data["id"])).data
        return response

    def create(self, request, *args, **kwargs):
        return self._annotated(super().create(request, *args, **kwargs))

    def update(self, request, *args, **kwargs):
        return self._annotated(super().update(request, *args, **kwargs))

    def _set_state(self, request, state: str, kind: str):
        pool = self.get_object()
        previous = pool.state
        Pool.objects.filter(pk=pool.pk).update(state=state)
        Event.objects.create(pool=pool, kind=kind, message=f"pool {pool.slug}: {previous} → {state}",
                             payload={"from": previous, "to": state, "by": request.user.username})
        publish_fleet({"type": "pool", "slug": pool.slug, "state": state})
        return Response(self.get_serializer(self.get_queryset().get(pk=pool.pk)).data)

    @extend_schema(request=None, responses=s.PoolSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request, slug=None):
        """Stop placing new learners here; running ones move away at their next rebalance."""
        return self._set_state(request, Pool.State.DRAINING, Event.Kind.DRAINED)

    @extend_schema(request=None, responses=s.PoolSerializer)
    @action(detail=True, methods=["post"])
    def activate(self, request, slug=None):
        return self._set_state(request, Pool.State.ACTIVE, Event.Kind.INFO)

    @extend_schema(request=None, responses=s.PoolSerializer)
    @action(detail=True, methods=["post"])
    def disable(self, request, slug=None):
        return self._set_state(request, Pool.State.DISABLED, Event.Kind.INFO)


@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("pool", str, description="pool slug"),
    OpenApiParameter("state", str, enum=[c for c, _ in Node.State.choices]),
]))
class NodeViewSet(SafeQueryMixin, _ProtectedDestroyMixin, viewsets.ModelViewSet):
    """Worker hosts (they register themselves; staff may edit or remove them)."""

    serializer_class = s.NodeSerializer
    permission_classes = [FleetWritePermission]
    lookup_value_regex = r"[0-9]+"
    filter_backends = [filters.SearchFilter]
    search_fields = ["hostname", "worker_name"]

    def get_queryset(self):
        qs = Node.objects.select_related("pool")
        params = self.request.query_params
        if "pool" in params:
            qs = qs.filter(pool__slug=params["pool"][:40])
        if params.get("state") in Node.State.values:
            qs = qs.filter(state=params["state"])
        return qs.order_by("pool__slug", "hostname")
