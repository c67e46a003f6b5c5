from django.urls import path

from . import views

app_name = "dashboard"

urlpatterns = [
    path("", views.overview, name="overview"),
    path("fleet/", views.fleet, name="fleet"),
    path("fleet/live.json", views.fleet_live, name="fleet-live"),
    path("fleet/<slug:slug>/", views.pool_detail, name="pool"),
    path("fleet/<slug:slug>/drain", views.pool_drain, name="pool-drain"),
    path("fleet/<slug:slug>/history.json", views.fleet_history_json, name="pool-history"),
    path("fleet/<slug:slug>/nodes/<int:pk>/", views.node_detail, name="node"),
    path("fleet/<slug:slug>/nodes/<int:pk>/history.json", views.fleet_history_json, name="node-history"),
    path("jobs/", views.job_list, name="jobs"),
    path("account/tokens/", views.tokens, name="tokens"),
    path("jobs/new", views.job_new, name="job-new"),
    path("jobs/<int:pk>/", views.job_detail, name="job"),
    path("jobs/<int:pk>/series.json", views.job_series, name="job-series"),
    path("jobs/<int:pk>/checkpoints.html", views.job_checkpoints, name="job-checkpoints"),
    path("jobs/<int:pk>/markers.json", views.job_markers_json, name="job-markers"),
    path("jobs/<int:pk>/demo/kill-worker", views.demo_kill_worker, name="job-demo-kill"),
    path("compare/", views.compare_jobs, name="compare"),
    path("jobs/<int:pk>/<str:action>", views.job_action, name="job-action"),
    path("jobs/<int:pk>/checkpoints/<int:version>/download", views.checkpoint_download, name="checkpoint"),
]
