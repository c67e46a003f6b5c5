"""The message rules, without sockets."""
from __future__ import annotations

import pytest

from apps.jobs.models import Event
from apps.telemetry.protocol import EVENT_KINDS, ProtocolError, parse_frame


def test_event_kinds_match_the_model():
    # protocol.py is Django-free (the client imports it), so it keeps its own copy.
    assert set(Event.Kind.values) == EVENT_KINDS


def test_heartbeat_is_normalised():
    msg = parse_frame('{"type":"heartbeat","job":7,"learner":0,"incarnation":1,"step":120,"tokens":123456,'
                      '"loss":2,"tokens_per_s":5321.0,"util":0.97,"power_w":null,"staleness":0,"time":1.8e9}',
                      65536)
    assert msg == {"type": "heartbeat", "job": 7, "learner": 0, "incarnation": 1, "step": 120,
                   "tokens": 123456, "loss": 2.0, "tokens_per_s": 5321.0, "util": 0.97, "power_w": None,
                   "staleness": 0, "time": 1.8e9}


@pytest.mark.parametrize(("frame", "reason"), [
    ('{"type":"heartbeat","job":7,"learner":0,"incarnation":1,"step":1,"tokens":1,"time":1800000000000}',
     "heartbeat.time out of range"),
    ('{"type":"heartbeat","job":0,"learner":0,"incarnation":1,"step":1,"tokens":1}',
     "heartbeat.job out of range"),
    ('{"type":"heartbeat","job":7,"learner":0,"incarnation":1,"step":3000000000,"tokens":1}',
     "heartbeat.step out of range"),
    ('{"type":"metrics","job":7,"points":{}}', "metrics.points must be a list"),
    ('{"type":"metrics","job":7,"points":[1]}', "metrics.points[0] must be an object"),
    ('{"type":"event","job":7,"kind":"info","payload":[]}', "event.payload must be an object"),
    ('{"type":"publish","message":{"type":"<script>"}}', "publish.message.type has an invalid format"),
    ('{"type":"hello","pool":"../etc"}', "hello.pool has an invalid format"),
])
def test_reasons_name_the_field(frame, reason):
    with pytest.raises(ProtocolError) as exc:
        parse_frame(frame, 65536)
    assert reason in exc.value.reason


def test_reason_fits_a_close_frame():
    with pytest.raises(ProtocolError) as exc:
        parse_frame('{"type":"' + "é" * 500 + '"}', 65536)
    assert len(exc.value.reason.encode()) <= 123


def test_multibyte_size_limit():
    text = '{"type":"event","job":7,"kind":"info","message":"' + "€" * 200 + '"}'
    assert len(text) < 300 and len(text.encode()) > 600
    with pytest.raises(ProtocolError, match="larger than 600 bytes"):
        parse_frame(text, 600)
