"""GET /api/v1/compare/?jobs=1,2,3&baseline=2: the dashboard's compare view as data.

The numbers come from apps.dashboard.compare, so the page, this endpoint and
`diloco jobs compare` agree. Bad input is a 400 naming the parameter; ids the caller may
not see are listed under `missing` exactly like ids that do not exist.
"""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.dashboard import compare

from ..permissions import IsPerson
from .common import SafeQueryMixin

_series = inline_serializer("CompareSeries", {
    "tokens": serializers.ListField(child=serializers.IntegerField()),
    "elapsed_s": serializers.ListField(child=serializers.FloatField(),
                                       help_text="seconds since the job started"),
    "loss": serializers.ListField(child=serializers.FloatField()),
})
_ROW_FIELDS = {
    "id": serializers.IntegerField(), "name": serializers.CharField(), "status": serializers.CharField(),
    "owner": serializers.CharField(), "strategy": serializers.CharField(),
    "baseline": serializers.BooleanField(),
    "final_loss": serializers.FloatField(allow_null=True), "tokens": serializers.IntegerField(),
    "wall_time_s": serializers.FloatField(allow_null=True),
    "common_tokens": serializers.IntegerField(
        allow_null=True, help_text="tokens the shorter of this job and the baseline reached"),
    "loss_at_common_tokens": serializers.FloatField(allow_null=True),
    "baseline_loss_at_common_tokens": serializers.FloatField(allow_null=True),
    "gap_pct": serializers.FloatField(
        allow_null=True, help_text="(loss - baseline loss) / baseline loss x 100 at common_tokens"),
    "series": _series,
}
CompareResponse = inline_serializer("Compare", {
    "metric": serializers.ChoiceField(choices=compare.METRICS),
    "baseline": serializers.IntegerField(),
    "missing": serializers.ListField(child=serializers.IntegerField(),
                                     help_text="ids that do not exist or that you may not see"),
    "jobs": inline_serializer("CompareJob", _ROW_FIELDS, many=True),
})


class CompareView(SafeQueryMixin, APIView):
    """Loss curves of several jobs and the gap of each to a pinned baseline at equal tokens."""

    permission_classes = [IsPerson]

    @extend_schema(
        operation_id="compare_jobs",
        parameters=[
            OpenApiParameter("jobs", str, required=True,
                             description=f"job ids, comma-separated or repeated (1-{compare.MAX_JOBS})"),
            OpenApiParameter("baseline", int, description="one of `jobs` (default the first)"),
            OpenApiParameter("metric", str, enum=list(compare.METRICS),
                             description="default val_loss when every job has it, else train_loss"),
        ],
        responses={200: CompareResponse,
                   400: OpenApiResponse(OpenApiTypes.OBJECT,
                                        description='{"detail": str, "errors": {param: [str]}}')},
    )
    def get(self, request):
        try:
            ids = compare.parse_ids(request.query_params.getlist("jobs"))
            baseline = compare.parse_baseline(request.query_params.get("baseline"), ids)
            metric = compare.parse_metric(request.query_params.get("metric"))
            return Response(compare.compare(request.user, ids, baseline, metric))
        except compare.CompareError as exc:
            raise ValidationError({exc.field: [exc.reason]}) from None
