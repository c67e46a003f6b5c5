"""Options of the PostgreSQL connection pool (Django's `OPTIONS["pool"]`, psycopg_pool).

Why a pool: Django's ASGI handler runs each request's sync code on a thread of its own, so
without one every request opens (and closes) a PostgreSQL connection; persistent connections
(CONN_MAX_AGE) would leave one idle connection behind per request thread. With a pool, closing
a connection at the end of a request hands it back, and the next request's thread takes it.
"""
from __future__ import annotations

from typing import Any


def pool_options(env: Any) -> dict[str, Any]:
    """psycopg_pool.ConnectionPool keyword arguments from DB_POOL_* (django-environ `env`).

    Each process holds at most DB_POOL_MAX_SIZE connections: with WEB_CONCURRENCY workers the
    web tier holds up to WEB_CONCURRENCY x that many, which must fit PostgreSQL's
    max_connections beside the Celery workers. Django passes the pool a check (one round trip as
    a connection leaves it) when CONN_HEALTH_CHECKS is on, as settings turn it on: a database
    restart costs no failed request. psycopg_pool is declared in pyproject (psycopg[pool]).
    """
    min_size = env.int("DB_POOL_MIN_SIZE", default=2)
    return {
        "min_size": min_size,
        "max_size": max(min_size, env.int("DB_POOL_MAX_SIZE", default=8)),
        "timeout": env.float("DB_POOL_TIMEOUT", default=10.0),  # waiting for a free connection
    }
