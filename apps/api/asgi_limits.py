"""ASGI middleware: refuse oversized HTTP request bodies before Django spools them to disk.

Django's ASGI handler reads the whole body into a temporary file before any view runs, and
DATA_UPLOAD_MAX_MEMORY_SIZE is only checked later, when a view reads it. This middleware
answers 413 at once when Content-Length is over `REQUEST_BODY_MAX_BYTES`, and answers 413 to a
body without (or lying about) Content-Length as soon as the streamed part passes the limit,
without waiting for the rest; the app behind then sees a disconnect and stops reading.
"""
from __future__ import annotations

import json

from django.conf import settings


def _limit() -> int:
    return int(getattr(settings, "REQUEST_BODY_MAX_BYTES", 10 * 1024 * 1024))


async def _refuse(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail, "errors": {"detail": [detail]}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def _too_large(send, limit: int) -> None:
    await _refuse(send, 413, f"Request body too large: at most {limit} bytes.")


class BodySizeLimit:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = _limit()
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                if not value.isdigit() or len(value) > 18:
                    return await _refuse(send, 400, "Invalid Content-Length header.")
                if int(value) > limit:
                    return await _too_large(send, limit)
        seen = 0
        started = refused = False

        async def limited_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # the client sent more than it declared or streamed too much
                    refused = True
                    if not started:  # answer now: cutting off alone left the client waiting
                        await _too_large(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refused:
                return  # the 413 (or the cut-off) already ended this request
            started = True
            await send(message)

        return await self.app(scope, limited_receive, guarded_send)
