"""diloco_platform.asgi_handler: the middleware chain runs in sync mode, in one thread hop, and
still does everything it did (headers, sessions, authentication, errors)."""
from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.testing import ApplicationCommunicator

from diloco_platform.asgi_handler import SyncChainASGIHandler

pytestmark = pytest.mark.django_db(transaction=True)


async def _get(app, path: str, headers=()) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"host", b"testserver"), *headers], "http_version": "1.1", "scheme": "http",
             "server": ("testserver", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    comm = ApplicationCommunicator(app, scope)
    await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await comm.receive_output(10)
    body = b""
    while True:
        msg = await comm.receive_output(10)
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await comm.wait(10)  # the handler closes the response (request_finished: the connection goes back)
    return start["status"], dict(start["headers"]), body


def test_the_chain_is_sync():
    handler = SyncChainASGIHandler()
    assert not asyncio.iscoroutinefunction(handler._middleware_chain)


def test_requests_pass_the_middleware(alice):
    from apps.api.models import ApiToken

    _, raw = ApiToken.issue(alice, "t")
    app = SyncChainASGIHandler()
    bearer = [(b"authorization", f"Bearer {raw}".encode())]
    status, headers, body = asyncio.run(_get(app, "/api/v1/auth/me/", bearer))
    assert status == 200 and json.loads(body)["username"] == "alice"
    assert headers[b"X-Frame-Options"] == b"DENY"  # clickjacking middleware
    assert b"X-Content-Type-Options" in headers  # security middleware
    status, _, _ = asyncio.run(_get(app, "/api/v1/auth/me/"))
    assert status == 401
    status, headers, _ = asyncio.run(_get(app, "/accounts/login/"))
    assert status == 200 and b"csrftoken" in headers.get(b"Set-Cookie", b"")  # CSRF middleware
