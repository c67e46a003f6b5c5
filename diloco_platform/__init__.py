"""Django project of the DiLoCo platform.

Named `diloco_platform`, not `platform`: a package called `platform` would shadow the
standard library's `platform` module, which Django, Celery and uuid import.
"""
from .celery import app as celery_app

__all__ = ["celery_app"]
