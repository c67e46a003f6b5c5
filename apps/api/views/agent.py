"""Worker endpoints: a pool token reads the assignments of learners placed on its own pool only."""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError

from apps.jobs import state as st
from apps.jobs.models import Job, Learner

from .. import serializers as s
from ..authentication import PoolTokenAuthentication
from ..permissions import IsPoolAgent
from .checkpoints import blob_response


class AgentMixin:
    authentication_classes = [PoolTokenAuthentication]
    permission_classes = [IsPoolAgent]
    pagination_class = None
    serializer_class = s.AssignmentSerializer


@extend_schema(tags=["agent"])
class AssignmentListView(AgentMixin, generics.ListAPIView):
    """Learners of live jobs currently placed on the token's pool."""

    def get_queryset(self):
        return (Learner.objects.select_related("job", "pool")
                .filter(pool=self.request.auth).exclude(job__status__in=st.TERMINAL)
                .order_by("job_id", "index"))


@extend_schema(tags=["agent"])
class AssignmentView(AgentMixin, generics.RetrieveAPIView):
    """One learner's assignment; refused (403) unless the learner is placed on the token's pool."""

    def get_object(self):
        pool = self.request.auth
        job_id, index = int(self.kwargs["job_id"]), int(self.kwargs["index"])
        if not Job.objects.filter(pk=job_id).exists():
            raise NotFound("No such job.")
        learner = Learner.objects.select_related("job", "pool").filter(job_id=job_id, index=index).first()
        if learner is None or learner.pool_id != pool.pk:
            raise PermissionDenied(f"Pool {pool.slug!r} does not serve learner {index} of job {job_id}.")
        if learner.job.status in st.TERMINAL:
            raise PermissionDenied(f"Job {job_id} is {learner.job.status}; it has no live assignments.")
        return learner


@extend_schema(tags=["agent"], parameters=[
    OpenApiParameter("version", int, description="a given version (default: the newest)")],
    responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY)})
class GlobalFragmentView(AssignmentView):
    """The global weights of one fragment (newest version, or ?version=), for a learner of the
    token's pool: workers without blob-store credentials fetch them over HTTPS."""

    def get(self, request, *args, **kwargs):
        from trainer.runtime import keys

        learner = self.get_object()
        fragment = int(self.kwargs["fragment"])
        if fragment >= int((learner.job.spec or {}).get("fragments", 1)):
            raise NotFound(f"Job {learner.job_id} has no fragment {fragment}.")
        version = request.query_params.get("version")
        if version is not None and not (version.isascii() and version.isdigit() and len(version) <= 8):
            raise ValidationError({"version": ["Must be a non-negative integer."]})
        prefix = keys.global_key(learner.job_id, fragment, 0).rsplit("/", 1)[0] + "/"

        def locate(store):
            if version is not None:
                return keys.global_key(learner.job_id, fragment, int(version))
            return store.latest(prefix)

        return blob_response(locate, f"job{learner.job_id}-f{fragment:03d}.bin")
