"""/healthz: the state of the database, the broker and the channel layer, as JSON."""
from __future__ import annotations

import asyncio

from django.conf import settings
from django.db import connection
from django.http import JsonResponse


def _database() -> str:
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    return "ok"


def _broker() -> str:
    if not settings.REDIS_URL:
        import os
        from pathlib import Path

        opts = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}) or {}
        for key in ("data_folder_in", "data_folder_out"):
            folder = Path(opts.get(key, "."))
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise RuntimeError(f"broker folder {folder} is missing or not writable")
        return "ok (filesystem)"
    import redis

    redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1).ping()
    return "ok (redis)"


def _channel_layer() -> str:
    from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers

    # A layer of its own per probe: the shared one belongs to one event loop, and concurrent
    # probes (each with asyncio.run in its own thread) would otherwise collide in receive().
    layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)

    async def roundtrip() -> None:
        try:
            name = await layer.new_channel()
            await layer.send(name, {"type": "healthz.ping"})
            await layer.receive(name)
        finally:
            close = getattr(layer, "close_pools", None)
            if close is not None:
                await close()

    asyncio.run(asyncio.wait_for(roundtrip(), timeout=2))
    return "ok (" + type(layer).__name__ + ")"


def healthz(request):
    checks, ok = {}, True
    for name, probe in (("database", _database), ("broker", _broker), ("channel_layer", _channel_layer)):
        try:
            checks[name] = probe()
        except Exception as exc:  # noqa: BLE001 - any failure means "down"
            checks[name] = f"down: {type(exc).__name__}: {exc}"[:300]
            ok = False
    return JsonResponse({"status": "ok" if ok else "degraded", "checks": checks}, status=200 if ok else 503)
