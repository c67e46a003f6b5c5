"""ASGI entry: HTTP through Django, websockets through Channels."""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "diloco_platform.settings")

from diloco_platform.asgi_handler import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from apps.api.asgi_limits import BodySizeLimit  # noqa: E402
from apps.telemetry.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": BodySizeLimit(django_asgi_app),  # 413 before Django spools a huge body
        "websocket": AuthMiddlewareStack(URLRouter(websocket_urlpatterns)),
    }
)
