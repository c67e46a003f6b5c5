"""Websocket routes (learners, coordinator and dashboards); see docs/telemetry.md."""
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import AgentConsumer, FleetConsumer, JobConsumer

websocket_urlpatterns: list = [
    # Workers and the coordinator authenticate with a token (no cookies): no Origin check.
    path("ws/agent/", AgentConsumer.as_asgi()),
    # Browser sockets use the session cookie: refuse foreign origins (cross-site hijacking).
    path("ws/jobs/<int:job_id>/", AllowedHostsOriginValidator(JobConsumer.as_asgi())),
    path("ws/fleet/", AllowedHostsOriginValidator(FleetConsumer.as_asgi())),
]
