from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from .views import agent, auth, checkpoints, compare, inventory, jobs
from .views.common import not_found

router = DefaultRouter()
router.register("accelerator-types", inventory.AcceleratorTypeViewSet, basename="acceleratortype")
router.register("pools", inventory.PoolViewSet, basename="pool")
router.register("nodes", inventory.NodeViewSet, basename="node")
router.register("jobs", jobs.JobViewSet, basename="job")
router.register("events", jobs.EventViewSet, basename="event")
router.register("incidents", jobs.IncidentViewSet, basename="incident")
router.register("checkpoints", checkpoints.CheckpointViewSet, basename="checkpoint")
router.register("auth/tokens", auth.ApiTokenViewSet, basename="apitoken")

v1 = [
    path("auth/token/", auth.ObtainTokenView.as_view(), name="auth-token"),
    path("auth/me/", auth.MeView.as_view(), name="auth-me"),
    path("compare/", compare.CompareView.as_view(), name="compare"),
    path("agent/assignments/", agent.AssignmentListView.as_view(), name="agent-assignments"),
    re_path(r"^agent/jobs/(?P<job_id>[0-9]+)/learners/(?P<index>[0-9]+)/$",
            agent.AssignmentView.as_view(), name="agent-assignment"),
    re_path(r"^agent/jobs/(?P<job_id>[0-9]+)/learners/(?P<index>[0-9]+)/global/(?P<fragment>[0-9]{1,4})/$",
            agent.GlobalFragmentView.as_view(), name="agent-global-fragment"),
    path("", include(router.urls)),
    re_path(r"^.*$", not_found),  # JSON 404 for every other /api/v1/ path
]

urlpatterns = [
    path("v1/", include((v1, "api"), namespace="api")),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]
