"""gunicorn settings of the web process (`gunicorn -c python:diloco_platform.gunicorn_conf`).

uvicorn workers serve the whole ASGI app, so HTTP and the /ws/ websockets share one port and
one URL. Each request's sync code (middleware and view: diloco_platform/asgi_handler.py) runs
on a thread of the event loop's pool, but one worker's threads share its GIL, so throughput
comes from processes: WEB_CONCURRENCY workers, default 2 per CPU core (measured in docs/api.md,
"Benchmark"). Without REDIS_URL the channel layer lives in memory and cannot
fan out between processes (a dashboard on one worker would miss the events another received),
so the embedded default runs exactly one worker.

Keep CONN_MAX_AGE at 0 here: a persistent connection stays with the thread that opened it, and
Django's own ASGI handler ran each request on a new thread (measured then: 51 idle PostgreSQL
backends after 60 requests with CONN_MAX_AGE=60, until the server ran out of connections).
The workers use a connection pool instead (DB_POOL, on by default here: `web_db_pool`): each
request hands its connection back as it ends, whichever thread served it.
"""
from __future__ import annotations

import gc
import importlib.util
import logging
import os
import re
from collections.abc import Mapping

from uvicorn_worker import UvicornWorker


def web_workers(env: Mapping[str, str] = os.environ, cpus: int | None = None) -> int:
    """How many web workers: one without Redis, else WEB_CONCURRENCY or 2 per core."""
    if not env.get("REDIS_URL"):
        return 1
    if env.get("WEB_CONCURRENCY"):
        return max(1, int(env["WEB_CONCURRENCY"]))
    return max(1, 2 * (cpus or os.cpu_count() or 1))


def web_db_pool(env: Mapping[str, str] = os.environ) -> list[str]:
    """gunicorn's raw_env for the workers: the PostgreSQL connection pool on (DB_POOL=1) unless
    DB_POOL or CONN_MAX_AGE is set, or psycopg_pool is missing. Nothing changes in the importer."""
    if "DB_POOL" in env or env.get("CONN_MAX_AGE", "0") not in ("", "0"):
        return []
    return ["DB_POOL=1"] if importlib.util.find_spec("psycopg_pool") else []


def post_worker_init(worker) -> None:
    """gunicorn hook, in each worker once the app is loaded: import every view now (not on the
    first request), then move the startup heap (Django, DRF, torch: about 290k objects) out of
    the cyclic collector's reach with gc.freeze(). Measured in-process (issue 19): a full
    collection over that heap took about 350 ms, a stall for every request of the worker, and
    one came every few hundred metrics requests; frozen, a full collection takes about 10 ms."""
    from django.urls import get_resolver

    get_resolver().url_patterns  # noqa: B018 - the import is the point
    gc.freeze()


def _env_float(name: str, default: float, env: Mapping[str, str] = os.environ) -> float:
    try:
        return float(env.get(name) or default)
    except ValueError:
        return default


# --- what a client may hold (issue 35: 1000 half-sent requests were held 70 s) ---------------
# The request line and headers must arrive within HEADER_TIMEOUT_S of the connection opening (or
# of the previous response, on a kept-alive connection); then the connection is closed. uvicorn
# has no such timeout of its own: a client sending a byte now and then held a connection (and
# its memory) for as long as it liked. A proxy in front should have its own (docs/security.md).
HEADER_TIMEOUT_S = _env_float("WEB_HEADER_TIMEOUT_S", 15.0)
# Connections (HTTP and websockets) plus running requests per worker; past it, new HTTP requests
# get a 503 at once instead of queueing without end.
MAX_CONNECTIONS = int(_env_float("WEB_MAX_CONNECTIONS", 1000))


def _header_timeout_protocol():
    """uvicorn's httptools protocol with a deadline for each request's headers (None without
    httptools: uvicorn then uses h11, bounded by h11_max_incomplete_event_size only)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is installed with uvicorn[standard]
        return None

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        header_timeout = HEADER_TIMEOUT_S
        _header_timer = None

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


# --- what the logs may hold --------------------------------------------------------------
# Workers put their pool token in the websocket URL (/ws/agent/?token=...); uvicorn logs that
# URL whole, the handshake at INFO on "uvicorn.error" and each request on "uvicorn.access".
_SECRET_PARAM = re.compile(r"(?i)([?&](?:token|access_token|key|password|secret)=)[^&\s\"']*")


def redact(text: str) -> str:
    """`text` with the values of token-like query parameters replaced by [redacted]."""
    return _SECRET_PARAM.sub(r"\1[redacted]", text)


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's business, not ours
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def install_log_redaction() -> None:
    for name in ("uvicorn.access", "uvicorn.error", "gunicorn.access", "gunicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in log.filters):
            log.addFilter(RedactSecrets())


class Worker(UvicornWorker):
    """uvicorn's gunicorn worker with the bounds above and the token redaction of the logs."""

    CONFIG_KWARGS = {**UvicornWorker.CONFIG_KWARGS, "limit_concurrency": MAX_CONNECTIONS}
    _protocol = _header_timeout_protocol()
    if _protocol is not None:
        CONFIG_KWARGS["http"] = _protocol

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install_log_redaction()


worker_class = "diloco_platform.gunicorn_conf.Worker"
# X-Forwarded-For and X-Forwarded-Proto are believed from these addresses only: none unless
# FORWARDED_ALLOW_IPS names the proxy in front (comma-separated addresses or networks). gunicorn's
# default trusted 127.0.0.1, and the uvicorn workers inherit it, so any client on the web host
# could pick the address the sign-in throttle counts against (issue 35).
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "")
raw_env = web_db_pool()
workers = web_workers()
# A request that takes longer than this is stuck: the worker is replaced (websockets are not
# affected: the uvicorn worker's event loop keeps notifying the arbiter while they stay open).
timeout = 60
graceful_timeout = 10
keepalive = 5
# Access lines go nowhere by default (the platform logs what matters itself); errors to stderr.
accesslog = os.environ.get("WEB_ACCESS_LOG") or None
errorlog = "-"
loglevel = os.environ.get("LOG_LEVEL", "info").lower()
