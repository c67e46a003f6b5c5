"""Jobs: submit (idempotent), list, retrieve, cancel/pause/resume, dry run, and what a job produced."""
from __future__ import annotations

import re

from django.db.models import F, OuterRef, Q, Subquery, Sum
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from apps.jobs import access, services
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner
from apps.jobs.spec import SpecError, validate_spec

from .. import metrics
from .. import serializers as s
from ..exceptions import Conflict
from ..pagination import BoundedLimitOffsetPagination
from ..permissions import IsPerson
from ..throttling import JobCreateThrottle
from .common import SafeQueryMixin, query_params

IDEMPOTENCY_HEADER = "Idempotency-Key"
_KEY_RE = re.compile(r"^[\x21-\x7e]{1,200}$")

ERRORS = {
    400: OpenApiResponse(OpenApiTypes.OBJECT, description='{"detail": str, "errors": {field.path: [str]}}'),
}


def visible_jobs(user):
    """Jobs `user` may see, with the learners' live token count and the owner's username.

    The count is a correlated subquery, not a join + GROUP BY: the list's COUNT(*) then needs no
    aggregation and `ORDER BY created_at DESC LIMIT n` can walk the (owner, created_at) index
    instead of aggregating every job of the owner first (issue 19's profile).
    """
    tokens = (Learner.objects.filter(job=OuterRef("pk")).order_by().values("job")
              .annotate(n=Sum("tokens")).values("n"))
    # the owner's name, not the whole user row (select_related): 50 User instances and their
    # timestamps parsed were about 0.4 ms of the job list's CPU (issue 19)
    qs = Job.objects.annotate(learner_tokens=Subquery(tokens), owner_username=F("owner__username"))
    return access.visible_jobs(user, qs)


def _spec_error(exc: SpecError) -> SpecError:
    exc.path_prefix = "spec"
    return exc


def idempotency_key(request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not _KEY_RE.match(key):
        raise ValidationError({IDEMPOTENCY_HEADER: ["Must be 1-200 printable ASCII characters, no spaces."]})
    return key


class JobViewSet(SafeQueryMixin, mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                 viewsets.GenericViewSet):
    """Training jobs. Owners and their team see and act on a job, staff on all; others get 404."""

    permission_classes = [IsPerson]
    pagination_class = BoundedLimitOffsetPagination
    lookup_value_regex = r"[0-9]+"

    # Actions that read only the job's id from get_object(): the access check alone, without the
    # owner join, the learners' tokens subquery and the columns the job's own output needs.
    ROW_ONLY_ACTIONS = frozenset({"learners", "metrics", "events", "incidents", "checkpoints"})

    def get_queryset(self):
        if self.action in self.ROW_ONLY_ACTIONS:
            # the id alone: the row's other columns (the spec's JSON above all) are not read
            return access.visible_jobs(self.request.user).only("pk")
        return visible_jobs(self.request.user)

    def get_serializer_class(self):
        if self.action == "retrieve":
            return s.JobDetailSerializer
        if self.action in ("create", "dry_run"):
            return s.JobSubmitSerializer
        return s.JobSerializer

    def get_throttles(self):
        if self.action in ("create", "dry_run"):
            return [JobCreateThrottle()]
        return super().get_throttles()

    @extend_schema(parameters=[
        OpenApiParameter("status", str, many=True, enum=[c for c, _ in Job.STATUS_CHOICES],
                         description="one or more statuses (repeat or comma-separate)"),
        OpenApiParameter("search", str, description="in the job name, or a job id"),
        OpenApiParameter("owner", str, description="owner username (staff)"),
        OpenApiParameter("team", str),
    ])
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    def filter_queryset(self, queryset):
        if self.action != "list":
            return queryset
        q = query_params(self.request, s.JobListQuerySerializer)
        if q.get("status"):
            queryset = queryset.filter(status__in=sorted(q["status"]))
        if q.get("search"):
            term = q["search"].strip()
            cond = Q(name__icontains=term)
            if term.isascii() and term.isdigit() and len(term) <= 18:
                cond |= Q(pk=int(term))
            queryset = queryset.filter(cond)
        if q.get("owner"):
            queryset = queryset.filter(owner__username=q["owner"])
        if "team" in q:
            queryset = queryset.filter(team=q["team"])
        return queryset

    @extend_schema(
        request=s.JobSubmitSerializer,
        parameters=[OpenApiParameter(IDEMPOTENCY_HEADER, str, OpenApiParameter.HEADER,
                                     description="a retry with the same key returns the first job")],
        responses={201: s.JobSerializer, 200: s.JobSerializer, 409: OpenApiTypes.OBJECT, **ERRORS},
    )
    def create(self, request, *args, **kwargs):
        """Submit a job. With an `Idempotency-Key`, a retry returns the job the first call created (200)."""
        ser = s.JobSubmitSerializer(data=request.data, context={"request": request})
        ser.is_valid(raise_exception=True)
        key = idempotency_key(request)
        team = ser.validated_data.get("team", "")
        try:
            spec = validate_spec(ser.validated_data["spec"])
            job, created = services.submit_job(request.user, ser.validated_data["spec"], idempotency_key=key,
                                               team=team)
        except SpecError as exc:
            raise _spec_error(exc) from None
        # A replay must be the same request: another spec or another team is a conflict, never
        # the first job handed back (it would show one team's job as filed for another).
        if not created and (job.spec != spec.model_dump(mode="json") or job.team != team):
            raise Conflict(f"{IDEMPOTENCY_HEADER} {key!r} was already used for job {job.pk} "
                           "with a different spec or team.")
        headers = {"Location": request.build_absolute_uri(f"{job.pk}/")}
        if not created:
            headers["Idempotent-Replayed"] = "true"
        return Response(s.JobSerializer(job, context=self.get_serializer_context()).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK, headers=headers)

    @extend_schema(
        request=s.JobSubmitSerializer,
        responses={200: inline_serializer("DryRun", {
            "valid": serializers.BooleanField(),
            "spec": serializers.JSONField(),
            "total_tokens": serializers.IntegerField(),
            "placement": serializers.JSONField(),
        }), **ERRORS},
    )
    @action(detail=False, methods=["post"], url_path="dry-run")
    def dry_run(self, request):
        """Validate a spec and preview its placement on today's fleet; nothing is created."""
        from ..placement import preview

        ser = s.JobSubmitSerializer(data=request.data, context={"request": request})
        ser.is_valid(raise_exception=True)
        try:
            spec = validate_spec(ser.validated_data["spec"])
        except SpecError as exc:
            raise _spec_error(exc) from None
        return Response({"valid": True, "spec": spec.model_dump(mode="json"),
                         "total_tokens": spec.total_tokens, "placement": preview(spec)})

    def _act(self, fn, verb: str):
        job = self.get_object()
        fn(job, reason=f"{verb} by {self.request.user.get_username()} through the API")
        job.refresh_from_db()
        return Response(s.JobSerializer(job, context=self.get_serializer_context()).data)

    @extend_schema(request=None, responses={200: s.JobSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel a job (409 when it already finished)."""
        return self._act(services.cancel_job, "cancelled")

    @extend_schema(request=None, responses={200: s.JobSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        """Pause a running job: learners stop after checkpointing (409 when not running)."""
        return self._act(services.pause_job, "paused")

    @extend_schema(request=None, responses={200: s.JobSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        """Resume a paused job (409 when not paused)."""
        return self._act(services.resume_job, "resumed")

    @extend_schema(responses=s.LearnerSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def learners(self, request, pk=None):
        job = self.get_object()
        rows = Learner.objects.filter(job=job).select_related("pool", "node").order_by("index")
        return Response(s.LearnerSerializer(rows, many=True).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("name", str, many=True, description="metric names (repeat or comma-separate)"),
            OpenApiParameter("points", int, description="maximum points per series (1-5000, default 500)"),
            OpenApiParameter("learner", str, description="'job', 'all' (default) or a learner index"),
        ],
        responses={200: s.MetricsResponseSerializer, **ERRORS},
    )
    @action(detail=True, methods=["get"], pagination_class=None)
    def metrics(self, request, pk=None):
        """Time series, bucket-averaged in the database to at most `points` per series."""
        job = self.get_object()
        q = query_params(request, s.MetricsQuerySerializer)
        data = metrics.series(job, names=q.get("name"), points=q["points"], learner=q.get("learner", "all"))
        return Response({"job": job.pk, "points": q["points"], "series": data})

    @extend_schema(parameters=[
        OpenApiParameter("kind", str, enum=[c for c, _ in Event.Kind.choices]),
        OpenApiParameter("after", int, description="only events with a larger id, oldest first (follow)"),
    ], responses=s.EventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        job = self.get_object()
        qs = filter_events(Event.objects.filter(job=job), request)
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(s.EventSerializer(page, many=True).data)

    @extend_schema(responses=s.IncidentSerializer(many=True))
    @action(detail=True, methods=["get"])
    def incidents(self, request, pk=None):
        job = self.get_object()
        qs = Incident.objects.filter(job=job).select_related("learner", "pool")
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(s.IncidentSerializer(page, many=True).data)

    @extend_schema(responses=s.CheckpointSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def checkpoints(self, request, pk=None):
        job = self.get_object()
        rows = Checkpoint.objects.filter(job=job).order_by("-version", "-created_at")[:500]
        return Response(s.CheckpointSerializer(rows, many=True, context={"request": request}).data)


class EventQuerySerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=Event.Kind.choices, required=False)
    after = serializers.IntegerField(min_value=0, max_value=2**62, required=False)
    job = serializers.IntegerField(min_value=1, max_value=2**62, required=False)
    pool = serializers.RegexField(r"^[-a-zA-Z0-9_]{1,40}$", required=False)


def filter_events(qs, request):
    q = query_params(request, EventQuerySerializer)
    if "kind" in q:
        qs = qs.filter(kind=q["kind"])
    if "job" in q:
        qs = qs.filter(job_id=q["job"])
    if "pool" in q:
        qs = qs.filter(pool__slug=q["pool"])
    qs = qs.select_related("pool")
    if "after" in q:
        return qs.filter(pk__gt=q["after"]).order_by("pk")
    return qs.order_by("-time", "-pk")


@extend_schema(parameters=[
    OpenApiParameter("job", int), OpenApiParameter("pool", str),
    OpenApiParameter("kind", str, enum=[c for c, _ in Event.Kind.choices]),
    OpenApiParameter("after", int, description="only events with a larger id, oldest first"),
])
class EventViewSet(SafeQueryMixin, viewsets.ReadOnlyModelViewSet):
    """Events of your jobs (all jobs for staff) and of the fleet."""

    serializer_class = s.EventSerializer
    permission_classes = [IsPerson]
    pagination_class = BoundedLimitOffsetPagination
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self):
        qs = Event.objects.all()
        if not self.request.user.is_staff:
            qs = qs.filter(Q(job__isnull=True) | access.job_access_q(self.request.user, "job__"))
        return qs.select_related("pool")

    def filter_queryset(self, queryset):
        return filter_events(queryset, self.request) if self.action == "list" else queryset


class IncidentQuerySerializer(serializers.Serializer):
    job = serializers.IntegerField(min_value=1, max_value=2**62, required=False)
    open = serializers.BooleanField(required=False, allow_null=True, default=None)


@extend_schema(parameters=[OpenApiParameter("job", int), OpenApiParameter("open", bool)])
class IncidentViewSet(SafeQueryMixin, viewsets.ReadOnlyModelViewSet):
    """Failures: when they happened, were detected, and healed."""

    serializer_class = s.IncidentSerializer
    permission_classes = [IsPerson]
    pagination_class = BoundedLimitOffsetPagination
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self):
        qs = Incident.objects.select_related("learner", "pool")
        if not self.request.user.is_staff:
            qs = qs.filter(Q(job__isnull=True) | access.job_access_q(self.request.user, "job__"))
        return qs

    def filter_queryset(self, queryset):
        if self.action != "list":
            return queryset
        q = query_params(self.request, IncidentQuerySerializer)
        if "job" in q:
            queryset = queryset.filter(job_id=q["job"])
        if q.get("open") is not None:
            queryset = queryset.filter(healed_at__isnull=q["open"])
        return queryset
