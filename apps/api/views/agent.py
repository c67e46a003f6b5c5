"""Worker endpoints: a pool token reads the assignments of learners placed on its own pool only."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.exceptions import NotFound, PermissionDenied

from apps.jobs import state as st
from apps.jobs.models import Job, Learner

from .. import serializers as s
from ..authentication import PoolTokenAuthentication
from ..permissions import IsPoolAgent


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
