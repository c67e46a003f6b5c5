"""WSGI entry (the API and admin also work under a plain WSGI server)."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "diloco_platform.settings")
application = get_wsgi_application()
