"""Issue 35, Low findings on the web server (gunicorn + uvicorn workers, diloco_platform/gunicorn_conf.py)
and on the HTTP/websocket edges (CSP, the websocket Origin check).

- X-Forwarded-For was believed from 127.0.0.1 (gunicorn's default forwarded_allow_ips, which
  the uvicorn workers inherit): a client on the web host picked its throttle address.
- No header timeout: a half-sent request was held as long as the client liked.
- A pool token in `?token=` was written whole in the logs.
- No Content-Security-Policy.
- The websocket Origin check compared the host only (not scheme and port).
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from channels.testing import WebsocketCommunicator

from diloco_platform import gunicorn_conf

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------- gunicorn settings
def test_forwarded_headers_trusted_from_nobody_by_default(monkeypatch):
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    import importlib

    conf = importlib.reload(gunicorn_conf)
    assert conf.forwarded_allow_ips == ""
    from gunicorn.config import Config

    cfg = Config()
    cfg.set("forwarded_allow_ips", conf.forwarded_allow_ips)
    assert cfg.forwarded_allow_ips == []  # what the uvicorn workers get: trust no proxy
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "10.0.0.5")
    assert importlib.reload(gunicorn_conf).forwarded_allow_ips == "10.0.0.5"
    monkeypatch.delenv("FORWARDED_ALLOW_IPS")
    importlib.reload(gunicorn_conf)


def test_worker_bounds_connections_and_header_time():
    kwargs = gunicorn_conf.Worker.CONFIG_KWARGS
    assert kwargs["limit_concurrency"] == gunicorn_conf.MAX_CONNECTIONS
    assert kwargs["http"].header_timeout == gunicorn_conf.HEADER_TIMEOUT_S
    assert gunicorn_conf.worker_class == "diloco_platform.gunicorn_conf.Worker"


@pytest.mark.parametrize(("line", "want"), [
    ('127.0.0.1:5 - "GET /ws/agent/?token=dlp_abc123 HTTP/1.1" 404',
     '127.0.0.1:5 - "GET /ws/agent/?token=[redacted] HTTP/1.1" 404'),
    ('1.2.3.4:1 - "WebSocket /ws/agent/?pool=a&token=dlp_x&y=1" [accepted]',
     '1.2.3.4:1 - "WebSocket /ws/agent/?pool=a&token=[redacted]&y=1" [accepted]'),
    ('"GET /jobs/?q=token HTTP/1.1" 200', '"GET /jobs/?q=token HTTP/1.1" 200'),
])
def test_redact(line, want):
    assert gunicorn_conf.redact(line) == want


def test_log_filter_rewrites_uvicorn_records(caplog):
    gunicorn_conf.install_log_redaction()
    log = logging.getLogger("uvicorn.error")
    old = log.propagate
    log.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="uvicorn.error"):
            log.info('%s - "WebSocket %s" [accepted]', "127.0.0.1:9", "/ws/agent/?token=dlp_SECRET")
    finally:
        log.propagate = old
    assert "dlp_SECRET" not in caplog.text
    assert "token=[redacted]" in caplog.text


# ------------------------------------------------------------------------- the real web server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("web") / "access.log"
    env = {**os.environ, "WEB_CONCURRENCY": "1", "WEB_HEADER_TIMEOUT_S": "1.5", "WEB_ACCESS_LOG": str(log),
           "SECRET_KEY": os.environ.get("SECRET_KEY", "x"),}
    env.pop("FORWARDED_ALLOW_IPS", None)
    env.pop("LOG_LEVEL", None)
    out = log.with_name("gunicorn.out")
    gunicorn = Path(sys.executable).with_name("gunicorn")
    with out.open("wb") as fh:
        proc = subprocess.Popen([str(gunicorn), "-c", "python:diloco_platform.gunicorn_conf",
                                 "-b", f"127.0.0.1:{port}", "diloco_platform.asgi:application"],
                                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while b"Application startup complete" not in out.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(out.read_text(errors="replace")[-3000:])
        time.sleep(0.3)
    yield port, log, proc
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def _get(port: int, path: str, headers: str = "") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{headers}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def test_half_sent_request_is_closed_after_the_header_timeout(web):
    port, _, _ = web
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /favicon.ico HTTP/1.1\r\nHost: localhost\r\n")
        t0 = time.monotonic()
        for _ in range(8):  # a byte now and then: it used to keep the connection open for ever
            time.sleep(0.5)
            try:
                s.sendall(b"X")
            except OSError:
                break
        s.settimeout(5)
        try:
            rest = s.recv(1024)
        except (ConnectionResetError, TimeoutError):
            rest = b""
        assert rest == b"" or b"HTTP/1.1" not in rest
        assert time.monotonic() - t0 < 6
    assert b"HTTP/1.1" in _get(port, "/favicon.ico")  # a whole request still works


def test_access_log_trusts_no_forwarded_for_and_redacts_tokens(web):
    port, log, _ = web
    _get(port, "/favicon.ico", headers="X-Forwarded-For: 203.0.113.9\r\n")
    _get(port, "/ws/agent/?token=dlp_SEKRIT123&x=1")
    time.sleep(0.5)
    text = log.read_text()
    assert "/favicon.ico" in text
    assert "203.0.113.9" not in text  # the client's real address is logged (and throttled)
    assert "dlp_SEKRIT123" not in text and "token=[redacted]" in text


def test_responses_carry_a_content_security_policy(web):
    port, _, _ = web
    resp = _get(port, "/accounts/login/").decode(errors="replace")
    head = resp.split("\r\n\r\n", 1)[0].lower()
    assert "content-security-policy: default-src 'self'" in head
    assert "script-src 'self';" in head


# ------------------------------------------------------------------------- CSP (in process)
@pytest.mark.django_db
def test_dashboard_pages_have_a_strict_csp(client, alice):
    from diloco_platform.csp import policy_for

    client.force_login(alice)
    for path in ("/", "/jobs/", "/fleet/", "/account/tokens/"):
        resp = client.get(path)
        assert resp.status_code == 200
        csp = resp["Content-Security-Policy"]
        assert "script-src 'self';" in csp and "style-src 'self';" in csp and "'unsafe-inline'" not in csp
        assert "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
        html = resp.content.decode()
        assert " onfocus=" not in html and " onclick=" not in html and " style=" not in html
    assert "'unsafe-inline'" in policy_for("/api/docs/").split("script-src")[1].split(";")[0]
    assert "'unsafe-inline'" not in policy_for("/admin/").split("script-src")[1].split(";")[0]


@pytest.mark.django_db
def test_new_token_page_has_no_inline_handler(client, alice):
    client.force_login(alice)
    resp = client.post("/account/tokens/", {"action": "create", "name": "ci"})
    html = resp.content.decode()
    assert "data-select-on-focus" in html and "onfocus" not in html


# ------------------------------------------------------------------------- websocket Origin
async def _handshake(path: str, origin: bytes, host: bytes = b"testserver", extra=()) -> bool:
    from diloco_platform.asgi import application

    comm = WebsocketCommunicator(application, path, headers=[(b"origin", origin), (b"host", host), *extra])
    connected, _ = await comm.connect(timeout=3)
    await comm.disconnect()
    return connected


@pytest.mark.parametrize(("origin", "host"), [
    (b"http://testserver:8080", b"testserver"),      # another port on the same name
    (b"https://testserver", b"testserver"),          # https page, plain-http socket
    (b"http://testserver", b"testserver:8000"),
    (b"null", b"testserver"),
    (b"http://evil.example", b"testserver"),
])
def test_same_origin_refuses_other_scheme_or_port(origin, host):
    from diloco_platform.asgi import same_origin

    scope = {"type": "websocket", "scheme": "ws", "path": "/ws/fleet/",
             "headers": [(b"origin", origin), (b"host", host)]}
    assert not same_origin(scope)


@pytest.mark.parametrize(("origin", "host", "scheme", "extra"), [
    (b"http://testserver", b"testserver", "ws", []),
    (b"http://testserver:80", b"testserver", "ws", []),
    (b"http://localhost:8000", b"localhost:8000", "ws", []),
    (b"https://site.example", b"site.example", "wss", []),
])
def test_same_origin_accepts_this_site(origin, host, scheme, extra):
    from diloco_platform.asgi import same_origin

    scope = {"type": "websocket", "scheme": scheme, "path": "/ws/fleet/",
             "headers": [(b"origin", origin), (b"host", host), *extra]}
    assert same_origin(scope)


def test_same_origin_behind_a_tls_proxy(settings):
    from diloco_platform.asgi import same_origin

    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    scope = {"type": "websocket", "scheme": "ws", "path": "/ws/fleet/",
             "headers": [(b"origin", b"https://site.example"), (b"host", b"site.example"),
                         (b"x-forwarded-proto", b"https")]}
    assert same_origin(scope)
    settings.CSRF_TRUSTED_ORIGINS = ["https://dash.example"]
    scope["headers"][0] = (b"origin", b"https://dash.example")
    assert same_origin(scope)


@pytest.mark.django_db(transaction=True)
async def test_fleet_socket_refused_from_another_port():
    assert not await _handshake("/ws/fleet/", b"http://testserver:8080")
