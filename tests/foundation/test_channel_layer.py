"""The Redis channel layer as configured: an idle consumer blocks quietly instead of erroring."""

from __future__ import annotations

import asyncio

import pytest
from channels.layers import get_channel_layer
from django.conf import settings

pytestmark = pytest.mark.skipif(not settings.REDIS_URL, reason="the embedded default has no Redis")


def test_socket_timeout_outlasts_the_blocking_read():
    layer = get_channel_layer()
    timeouts = [host.get("socket_timeout") for host in layer.hosts]
    assert timeouts and all(t is not None and t > layer.brpop_timeout for t in timeouts)


def test_idle_receive_waits_past_the_blocking_read_without_a_redis_timeout():
    """redis-py's default socket timeout (5 s) equals channels-redis' BZPOPMIN timeout, and
    every idle websocket consumer used to raise "Timeout reading from ..." into the logs."""
    layer = get_channel_layer()

    async def idle_receive() -> str:
        channel = await layer.new_channel()
        try:
            await asyncio.wait_for(layer.receive(channel), layer.brpop_timeout + 1.5)
        except TimeoutError:
            return "still waiting"
        finally:
            await layer.flush()
        return "received"

    assert asyncio.run(idle_receive()) == "still waiting"
