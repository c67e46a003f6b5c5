"""Websocket routes (learners, coordinator and dashboards); see docs/telemetry.md."""
from channels.security.websocket import AllowedHostsOriginValidator, WebsocketDenier
from django.urls import path, re_path

from .consumers import AgentConsumer, FleetConsumer, JobConsumer

websocket_urlpatterns: list = [
    # Workers and the coordinator authenticate with a token (no cookies): no Origin check.
    path("ws/agent/", AgentConsumer.as_asgi()),
    # Browser sockets use the session cookie: refuse foreign origins (cross-site hijacking).
    path("ws/jobs/<int:job_id>/", AllowedHostsOriginValidator(JobConsumer.as_asgi())),
    path("ws/fleet/", AllowedHostsOriginValidator(FleetConsumer.as_asgi())),
    # Keep last: any other path gets a denied handshake (403), not URLRouter's "No route
    # found" ValueError, which daphne logs as a traceback and answers with a 500.
    re_path(r"", WebsocketDenier.as_asgi()),
]
