"""Websocket routes (learners, coordinator and dashboards)."""
websocket_urlpatterns: list = []
