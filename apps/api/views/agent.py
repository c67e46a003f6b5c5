"""Worker endpoints: a pool token reads the assignments of learners placed on its own pool only."""
from __future__ import annotations

import re

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError

from apps.jobs import state as st
from apps.jobs.models import Job, Learner, OuterStep

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


def committed_global_key(job_id: int, fragment: int, version: int | None) -> str | None:
    """The blob key of a committed global fragment (`version`, or the newest), or None.

    A version is committed when the syncer's commit transaction recorded its OuterStep row (with
    the lease checked, so a fenced syncer never records one); the row's blob_uri is the key the
    committing epoch wrote (`keys.global_key(job, p, v, epoch)`). Blobs without a row (written
    before a commit that never came, or by a fenced epoch for the same version) are never served.
    """
    from trainer.runtime import keys

    rows = OuterStep.objects.filter(job_id=job_id, fragment=fragment)
    rows = rows.filter(version=version) if version is not None else rows.order_by("-version")
    row = rows.values("version", "blob_uri").first()
    if row is None:
        return None
    v, uri = row["version"], row["blob_uri"]
    match = _EPOCH.search(uri)
    key = keys.global_key(job_id, fragment, v, int(match.group(1)) if match else None)
    return key if uri == key else None  # a row that names another blob serves nothing


_EPOCH = re.compile(r"-e(\d+)$")


@extend_schema(tags=["agent"], parameters=[
    OpenApiParameter("version", int, description="a committed version (default: the newest committed)")],
    responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY)})
class GlobalFragmentView(AssignmentView):
    """The committed global weights of one fragment (newest version, or ?version=), for a learner
    of the token's pool: workers without blob-store credentials fetch them over HTTPS."""

    def get(self, request, *args, **kwargs):
        learner = self.get_object()
        fragment = int(self.kwargs["fragment"])
        if fragment >= int((learner.job.spec or {}).get("fragments", 1)):
            raise NotFound(f"Job {learner.job_id} has no fragment {fragment}.")
        version = request.query_params.get("version")
        if version is not None and not (version.isascii() and version.isdigit() and len(version) <= 8):
            raise ValidationError({"version": ["Must be a non-negative integer."]})
        key = committed_global_key(learner.job_id, fragment, None if version is None else int(version))
        if key is None:
            raise NotFound(f"Fragment {fragment} of job {learner.job_id} has no committed version"
                           + (f" {int(version)}." if version is not None else " yet."))
        return blob_response(lambda store: key, f"job{learner.job_id}-f{fragment:03d}.bin")
