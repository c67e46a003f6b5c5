"""Fixtures for the telemetry tests: two pools with tokens, a running job placed on both."""
from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from apps.inventory.models import AcceleratorType, Pool, PoolToken
from apps.jobs.models import Job, Learner
from apps.telemetry import scope
from apps.telemetry.auth import coordinator_token


@pytest.fixture
def accel(db):
    return AcceleratorType.objects.get_or_create(
        slug="tele-cpu",
        defaults={"vendor": "Test", "model": "CPU", "kind": "cpu", "generation": "x86", "year": 2024,
                  "memory_gib": 16, "peak_bf16_tflops": 1.0, "tdp_watts": 100},
    )[0]


def make_pool(accel, slug):
    return Pool.objects.create(slug=slug, name=slug, region="local", accelerator=accel, device_count=2,
                               link_gbps=10)


@pytest.fixture
def pool_a(accel):
    return make_pool(accel, "tele-a")


@pytest.fixture
def pool_b(accel):
    return make_pool(accel, "tele-b")


@pytest.fixture
def token_a(pool_a):
    return PoolToken.issue(pool_a)[1]


@pytest.fixture
def token_b(pool_b):
    return PoolToken.issue(pool_b)[1]


@pytest.fixture
def coord_token(settings):
    return coordinator_token()


def make_job(owner, pools, status="running"):
    job = Job.objects.create(owner=owner, name="tele", spec={"name": "tele"}, status=status)
    for i, pool in enumerate(pools):
        Learner.objects.create(job=job, index=i, incarnation=1, pool=pool, state="running")
    return job


@pytest.fixture
def job(alice, pool_a, pool_b):
    """Learner 0 on pool A, learner 1 on pool B."""
    return make_job(alice, [pool_a, pool_b])


@pytest.fixture(autouse=True)
def _fresh_scope_cache():
    scope.cache.invalidate()
    yield
    scope.cache.invalidate()


@pytest.fixture(autouse=True)
def _fast_flush(settings):
    settings.TELEMETRY_FLUSH_INTERVAL_S = 0.1


def hb(job, learner=0, incarnation=1, step=10, tokens=1000, **kw):
    msg = {"type": "heartbeat", "job": job.pk if hasattr(job, "pk") else job, "learner": learner,
           "incarnation": incarnation, "step": step, "tokens": tokens, "loss": 2.5, "tokens_per_s": 100.0}
    msg.update(kw)
    return msg


async def agent(token=None, *, query=False, path="/ws/agent/"):
    """An accepted agent connection; returns (communicator, server hello or first message)."""
    from diloco_platform.asgi import application

    headers = []
    if token and not query:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if token and query:
        path += f"?token={token}"
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await comm.connect()
    assert connected
    first = await comm.receive_json_from()
    return comm, first


async def until(comm, pred, timeout=2.0):
    """Receive JSON messages until pred(msg); returns that message (others are skipped)."""
    while True:
        msg = await comm.receive_json_from(timeout=timeout)
        if pred(msg):
            return msg


async def expect_close(comm, timeout=2.0):
    """Read until the server closes; returns (close code, [messages received before])."""
    msgs = []
    while True:
        out = await comm.receive_output(timeout)
        if out["type"] == "websocket.close":
            # Let the consumer instance finish (it would otherwise linger on the channel layer).
            await comm.send_input({"type": "websocket.disconnect", "code": out.get("code")})
            await comm.wait(2)
            return out.get("code"), msgs
        msgs.append(json.loads(out["text"]))


def session_cookie(user) -> str:
    c = Client()
    c.force_login(user)
    return c.cookies["sessionid"].value


async def browser(path, user=None, origin=b"http://testserver"):
    from diloco_platform.asgi import application

    headers = [(b"origin", origin)] if origin else []
    if user is not None:
        # Not directly: ORM calls inside the event loop open connections nobody closes.
        cookie = await database_sync_to_async(session_cookie)(user)
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await comm.connect()
    return comm, connected, code


@pytest.fixture(autouse=True)
async def _close_thread_connections():
    """Async tests touch the DB from asgiref's executor thread; close its connection afterwards
    so the test database can be dropped."""
    yield
    from asgiref.sync import sync_to_async
    from django.db import connections

    from apps.telemetry.writer import get_writer

    await get_writer().stop()
    await sync_to_async(connections.close_all)()


@pytest.fixture(scope="session", autouse=True)
def _close_executor_connections_at_end(django_db_setup):
    """Runs before the test database is dropped: close the connection asgiref's shared
    executor thread may still hold (database_sync_to_async work done late in a test)."""
    yield
    from asgiref.sync import SyncToAsync
    from django.db import connections

    SyncToAsync.single_thread_executor.submit(connections.close_all).result(10)
