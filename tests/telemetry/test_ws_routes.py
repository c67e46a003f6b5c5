"""Websocket paths nobody serves: a denied handshake, never a traceback or a 500."""
from __future__ import annotations

import logging

import pytest
from channels.testing import WebsocketCommunicator

# Imported here, not in the test: its first import runs django.setup(), whose logging config
# would drop caplog's handler mid-test.
from diloco_platform.asgi import application

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("path", ["/ws/nope/", "/", "/ws/agent/extra/", "/ws/jobs/abc/", "/ws/fleet"])
async def test_unknown_websocket_path_is_denied_cleanly(path, caplog):
    comm = WebsocketCommunicator(application, path)
    connected, _ = await comm.connect()  # an unrouted path used to raise "No route found"
    assert not connected
    await comm.wait(2)  # the application instance ended without an exception
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_known_paths_still_route(pool_a, token_a):
    from .conftest import agent

    comm, hello = await agent(token_a)
    assert hello["type"] == "hello" and hello["role"] == "pool"
    await comm.disconnect()
