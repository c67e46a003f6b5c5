"""The Celery app: one queue per pool (`pool.<slug>`) and a `coordinator` queue."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "diloco_platform.settings")

app = Celery("diloco_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_routes = {
    "apps.coordinator.tasks.*": {"queue": "coordinator"},
}
app.autodiscover_tasks()


def pool_queue(slug: str) -> str:
    """Name of the Celery queue served by the workers of a pool."""
    return f"pool.{slug}"
