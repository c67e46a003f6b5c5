"""HTTP body size limit at the ASGI layer (before Django spools the body)."""
from __future__ import annotations

import json

import pytest
from asgiref.testing import ApplicationCommunicator

from apps.api.asgi_limits import BodySizeLimit


def _scope(headers):
    return {"type": "http", "method": "POST", "path": "/api/v1/jobs/", "headers": headers,
            "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("t", 80),
            "client": ("c", 1)}


async def _echo_app(scope, receive, send):
    """Reads the body like Django does; answers how many bytes it got, or nothing on disconnect."""
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


async def _run(app, headers, chunks):
    comm = ApplicationCommunicator(app, _scope(headers))
    for i, chunk in enumerate(chunks):
        await comm.send_input({"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1})
    if await comm.receive_nothing(timeout=0.5):  # the app ended (client cut off) without answering
        return None, None
    start = await comm.receive_output(2)
    body = await comm.receive_output(2)
    return start["status"], body["body"]


@pytest.mark.parametrize(("headers", "chunks", "status"), [
    ([(b"content-length", b"5")], [b"hello"], 200),
    ([(b"content-length", b"2000")], [b"x" * 100], 413),
    ([(b"content-length", b"-1")], [b""], 400),
    ([(b"content-length", b"9" * 40)], [b""], 400),
    ([], [b"x" * 600, b"x" * 600], 413),  # no Content-Length, streams past the limit: 413 at once
    ([(b"content-length", b"10")], [b"x" * 600, b"x" * 600], 413),  # lies about its length
])
async def test_body_limit(settings, headers, chunks, status):
    settings.REQUEST_BODY_MAX_BYTES = 1000
    got, body = await _run(BodySizeLimit(_echo_app), headers, chunks)
    assert got == status
    if status == 413:
        assert "at most 1000 bytes" in json.loads(body)["detail"]


def test_the_platform_asgi_app_is_wrapped():
    from diloco_platform.asgi import application

    assert isinstance(application.application_mapping["http"], BodySizeLimit)


@pytest.mark.parametrize("platform", [False, True])
async def test_streamed_body_over_the_limit_gets_413_without_waiting_for_the_rest(settings, platform):
    """A chunked body (no Content-Length) that passes the limit is answered 413 at once, while the
    client still has more to send; the app behind never gets the body."""
    from diloco_platform.asgi import application

    settings.REQUEST_BODY_MAX_BYTES = 1000
    app = application.application_mapping["http"] if platform else BodySizeLimit(_echo_app)
    comm = ApplicationCommunicator(app, _scope([(b"transfer-encoding", b"chunked")]))
    for _ in range(2):
        await comm.send_input({"type": "http.request", "body": b"x" * 600, "more_body": True})
    # the rest of the body never comes: the answer may not wait for it
    start = await comm.receive_output(1)
    assert start["status"] == 413
    assert (b"connection", b"close") in start["headers"]
    body = await comm.receive_output(1)
    assert "at most 1000 bytes" in json.loads(body["body"])["detail"]
    await comm.wait(1)  # and the application instance has finished
    assert await comm.receive_nothing(0.1)  # nothing more is sent (no second response)
