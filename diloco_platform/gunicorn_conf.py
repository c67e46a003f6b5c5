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
import os
from collections.abc import Mapping


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


worker_class = "uvicorn_worker.UvicornWorker"
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
