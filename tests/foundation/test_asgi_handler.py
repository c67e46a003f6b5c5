"""diloco_platform.asgi_handler: the middleware chain runs in sync mode, in one thread hop, and
still does everything it did (headers, sessions, authentication, errors, signals, streaming)."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
from asgiref.testing import ApplicationCommunicator
from django.contrib.auth import get_user_model
from django.core.signals import request_finished, request_started
from django.http import HttpResponse, StreamingHttpResponse
from django.urls import path

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


# --- one hop per request: signals, view and close on one thread; streaming as Django streams --
seen: list[tuple[str, int]] = []


def _record(name):
    def receiver(**kwargs):
        seen.append((name, threading.get_ident()))
    return receiver


def plain_view(request):
    seen.append(("view", threading.get_ident()))
    return HttpResponse(f"users: {get_user_model().objects.count()}")


def streaming_view(request):
    seen.append(("view", threading.get_ident()))

    def chunks():
        for i in range(3):
            seen.append((f"chunk {i}", threading.get_ident()))
            yield f"{i}:{get_user_model().objects.count()};".encode()

    return StreamingHttpResponse(chunks())


urlpatterns = [path("plain/", plain_view), path("stream/", streaming_view)]


@pytest.fixture
def recorded(settings):
    settings.ROOT_URLCONF = __name__
    seen.clear()
    started, finished = _record("started"), _record("finished")
    request_started.connect(started)
    request_finished.connect(finished)
    yield seen
    request_started.disconnect(started)
    request_finished.disconnect(finished)


def test_signals_view_and_close_run_on_one_thread_before_the_response_goes_out(recorded, alice):
    app = SyncChainASGIHandler()
    for _ in range(3):
        recorded.clear()
        status, _, body = asyncio.run(_get(app, "/plain/"))
        assert status == 200 and body == b"users: 1"
        names = [name for name, _ in recorded]
        assert names == ["started", "view", "finished"]  # request_finished: connections go back
        assert len({ident for _, ident in recorded}) == 1
        assert recorded[0][1] != threading.get_ident()  # not the event loop's thread


@pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume synchronous iterators")
def test_a_streaming_response_is_sent_whole_and_closed_after_its_last_chunk(recorded, alice):
    app = SyncChainASGIHandler()
    status, _, body = asyncio.run(_get(app, "/stream/"))
    assert status == 200 and body == b"0:1;1:1;2:1;"
    names = [name for name, _ in recorded]
    assert names == ["started", "view", "chunk 0", "chunk 1", "chunk 2", "finished"]
    chunk_threads = {ident for name, ident in recorded if name.startswith("chunk")}
    finished_thread = recorded[-1][1]
    assert chunk_threads == {finished_thread}  # the chunks' connections are closed where they ran


def test_an_error_page_still_closes_on_the_views_thread(recorded):
    status, _, _ = asyncio.run(_get(SyncChainASGIHandler(), "/nowhere/"))
    assert status == 404
    assert [name for name, _ in recorded] == ["started", "finished"]
    assert len({ident for _, ident in recorded}) == 1
