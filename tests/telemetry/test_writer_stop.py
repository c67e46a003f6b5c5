"""Stopping the writer never drops the fan-out of rows it already wrote."""
from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from apps.telemetry import publish
from apps.telemetry.writer import TelemetryWriter, event

pytestmark = [pytest.mark.django_db(transaction=True)]


async def test_stop_during_a_flush_lets_its_fan_out_finish(monkeypatch):
    sent, fanning_out = [], asyncio.Event()

    async def slow_group_send(group, message):
        fanning_out.set()
        await asyncio.sleep(0.2)
        sent.append((group, message["message"]["type"]))

    monkeypatch.setattr(publish, "agroup_send", slow_group_send)
    writer = TelemetryWriter(interval=0.01)
    writer.add_event(event(None, None, {"kind": "info", "message": "fleet note", "payload": {}, "time": None},
                           datetime.now(UTC)))
    await asyncio.wait_for(fanning_out.wait(), 5)  # the background flush committed, now fans out
    await writer.stop()
    assert sent == [(publish.FLEET_GROUP, "event")]
