from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "apps.inventory"
    label = "inventory"
    verbose_name = "Fleet inventory"

    def ready(self) -> None:
        # Celery worker signals: a pool worker registers itself as a Node (see worker.py).
        from . import worker  # noqa: F401
