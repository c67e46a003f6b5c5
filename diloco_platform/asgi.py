"""ASGI entry: HTTP through Django, websockets through Channels."""
from __future__ import annotations

import os
from urllib.parse import urlsplit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "diloco_platform.settings")

from diloco_platform.asgi_handler import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import WebsocketDenier  # noqa: E402
from django.conf import settings  # noqa: E402

from apps.api.asgi_limits import BodySizeLimit  # noqa: E402
from apps.telemetry.routing import websocket_urlpatterns  # noqa: E402

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_tuple(scheme: str, netloc: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of `scheme://netloc`, the default port filled in; None if malformed."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return scheme, parts.hostname.lower(), port


def _scope_is_secure(scope, headers: dict[bytes, bytes]) -> bool:
    if scope.get("scheme") in ("wss", "https"):
        return True
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy:  # ("HTTP_X_FORWARDED_PROTO", "https"), as Django's request.is_secure() reads it
        name = proxy[0].removeprefix("HTTP_").lower().replace("_", "-").encode()
        value = headers.get(name, b"").decode("latin-1").split(",")[0].strip()
        return value == proxy[1]
    return False


def same_origin(scope) -> bool:
    """A browser socket's Origin is this site: scheme, host and port all equal to what the
    browser connected to (as Django's CSRF check compares a form's Origin), or listed in
    CSRF_TRUSTED_ORIGINS. Channels' AllowedHostsOriginValidator compares the host only, so
    http://site:8080 (another service on the same name) or plain http:// passed."""
    headers = dict(scope.get("headers") or [])
    origin = headers.get(b"origin")
    host = headers.get(b"host")
    if origin is None or host is None:
        return True  # no Origin: not a browser (the validator behind refuses it on browser paths)
    origin_s = origin.decode("latin-1").strip()
    if origin_s in getattr(settings, "CSRF_TRUSTED_ORIGINS", []):
        return True
    scheme, _, netloc = origin_s.partition("://")
    got = _origin_tuple(scheme.lower(), netloc) if netloc and "/" not in netloc else None
    want = _origin_tuple("https" if _scope_is_secure(scope, headers) else "http", host.decode("latin-1"))
    return got is not None and got == want


class SameOriginWebsocket:
    """Refuses (403 at the handshake) a browser websocket whose Origin is not this site."""

    EXEMPT = ("/ws/agent/",)  # workers and the coordinator: token, no cookie, no Origin needed

    def __init__(self, app):
        self.app = app
        self.denier = WebsocketDenier.as_asgi()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if not path.startswith(self.EXEMPT) and not same_origin(scope):
            return await self.denier(scope, receive, send)
        return await self.app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": BodySizeLimit(django_asgi_app),  # 413 before Django spools a huge body
        "websocket": SameOriginWebsocket(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
