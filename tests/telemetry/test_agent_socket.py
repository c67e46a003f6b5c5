"""The agent websocket: auth, scoping, malformed frames, batching, control delivery."""
from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async as sync_to_async

from apps.inventory.models import Node, PoolToken
from apps.jobs.models import Event, Learner, MetricPoint
from apps.telemetry import publish
from apps.telemetry.consumers import STATS
from apps.telemetry.writer import get_writer

from .conftest import agent, expect_close, hb, make_job, until

pytestmark = [pytest.mark.django_db(transaction=True)]


async def _flush():
    await get_writer().stop()


# -- auth -------------------------------------------------------------------------------------------

async def test_agent_auth(pool_a, token_a):
    # no token, a wrong one: 4401 with the reason in an error frame first
    for token in (None, "pt_nope_" + "x" * 20):
        comm, first = await agent(token)
        assert first["type"] == "error" and first["code"] == "unauthorized" and first["fatal"]
        assert (await expect_close(comm))[0] == 4401
    # a pool token in the header or the query string
    for query in (False, True):
        comm, hello = await agent(token_a, query=query)
        assert hello == {"type": "hello", "role": "pool", "pool": "tele-a", "max_frame_bytes": 65536,
                         "heartbeat_interval_s": hello["heartbeat_interval_s"]}
        await comm.disconnect()
    # revoked
    revoke = PoolToken.objects.filter(pool=pool_a)
    await sync_to_async(lambda: revoke.update(revoked_at="2026-01-01T00:00Z"))()
    comm, first = await agent(token_a)
    assert first["code"] == "unauthorized"
    assert (await expect_close(comm))[0] == 4401


async def test_coordinator_token(coord_token, settings):
    comm, hello = await agent(coord_token)
    assert hello["role"] == "coordinator"
    await comm.disconnect()
    settings.COORDINATOR_TOKEN = "explicit-coordinator-secret-123"
    comm, first = await agent(coord_token)  # the derived one no longer works
    assert first["code"] == "unauthorized"
    await expect_close(comm)
    comm, hello = await agent("explicit-coordinator-secret-123")
    assert hello["role"] == "coordinator"
    await comm.disconnect()


# -- heartbeats, batching -----------------------------------------------------------------------------

async def test_heartbeat_updates_learner_and_node_in_one_batch(job, pool_a, token_a):
    node = await sync_to_async(Node.objects.create)(pool=pool_a, hostname="h", worker_name="w1@h")
    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "hello", "worker": "w1@h", "pool": "tele-a"})
    writer = get_writer()
    writer.interval = 30  # only the explicit flush below writes
    for step in range(1, 51):
        await comm.send_json_to(hb(job, step=step, tokens=step * 100, tokens_per_s=200.0 + step, staleness=1))
    ack = await until(comm, lambda m: m["type"] == "ack" and m["n"] == 51)
    assert ack["n"] == 51
    before = await sync_to_async(lambda: Learner.objects.get(job=job, index=0).tokens)()
    assert before == 0  # nothing written per message
    await writer.flush()
    assert writer.stats["flushes"] == 1
    lrn = await sync_to_async(Learner.objects.get)(job=job, index=0)
    got = (lrn.tokens, lrn.inner_steps, lrn.tokens_per_s, lrn.loss, lrn.staleness)
    assert got == (5000, 50, 250.0, 2.5, 1)
    assert lrn.last_heartbeat is not None
    node = await sync_to_async(Node.objects.get)(pk=node.pk)
    assert node.measured_tokens_per_s == 250.0
    assert node.last_seen >= lrn.last_heartbeat
    await comm.disconnect()
    await _flush()


async def test_flush_happens_by_itself_within_the_interval(job, token_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job, step=7, tokens=700))
    for _ in range(50):
        lrn = await sync_to_async(Learner.objects.get)(job=job, index=0)
        if lrn.tokens == 700:
            break
        await sync_to_async(lambda: __import__("time").sleep(0.05))()
    assert lrn.tokens == 700 and lrn.inner_steps == 7
    await comm.disconnect()
    await _flush()


async def test_flush_on_item_count(job, token_a):
    comm, _ = await agent(token_a)
    writer = get_writer()
    writer.interval, writer.max_items = 30, 100
    points = [{"learner": 0, "name": "train_loss", "step": i, "value": 1.0 / (i + 1)} for i in range(100)]
    await comm.send_json_to({"type": "metrics", "job": job.pk, "points": points})
    await until(comm, lambda m: m["type"] == "ack")
    for _ in range(40):
        n = await sync_to_async(MetricPoint.objects.filter(job=job).count)()
        if n == 100:
            break
        await sync_to_async(lambda: __import__("time").sleep(0.05))()
    assert n == 100
    await comm.disconnect()
    await _flush()


async def test_zombie_incarnation_is_refused_and_fenced(job, token_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job, incarnation=0))
    err = await until(comm, lambda m: m["type"] == "error")
    assert err["code"] == "stale_incarnation"
    # Accepted, then the watchdog bumps the incarnation before the flush: the write is fenced.
    writer = get_writer()
    writer.interval = 30
    await comm.send_json_to(hb(job, incarnation=1, tokens=999))
    await until(comm, lambda m: m["type"] == "ack")
    await sync_to_async(lambda: Learner.objects.filter(job=job, index=0).update(incarnation=2))()
    await writer.flush()
    assert writer.stats["heartbeats_fenced"] == 1
    assert (await sync_to_async(Learner.objects.get)(job=job, index=0)).tokens == 0
    # The new incarnation is honoured despite the cached placement (re-read after 0.25 s at most).
    await sync_to_async(lambda: __import__("time").sleep(0.3))()
    await comm.send_json_to(hb(job, incarnation=2, tokens=1234))
    assert (await until(comm, lambda m: m["type"] in ("ack", "error")))["type"] == "ack"
    await writer.flush()
    assert (await sync_to_async(Learner.objects.get)(job=job, index=0)).tokens == 1234
    await comm.disconnect()


# -- scoping ------------------------------------------------------------------------------------------

async def test_pool_token_cannot_report_for_other_pools_learner(job, token_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job, learner=1))  # learner 1 is on pool B
    err = await until(comm, lambda m: m["type"] == "error")
    assert err["code"] == "forbidden" and "not placed on pool tele-a" in err["reason"]
    await comm.send_json_to({"type": "metrics", "job": job.pk,
                             "points": [{"learner": 1, "name": "train_loss", "value": 1.0}]})
    err = await until(comm, lambda m: m["type"] == "error")
    assert err["code"] == "forbidden"
    await comm.send_json_to(hb(job, learner=0))  # its own learner still works
    await until(comm, lambda m: m["type"] == "ack" and m["n"] == 3)
    await _flush()
    rows = await sync_to_async(lambda: dict(Learner.objects.filter(job=job).values_list("index", "tokens")))()
    assert rows == {0: 1000, 1: 0}
    assert await sync_to_async(MetricPoint.objects.filter(job=job).count)() == 0
    await comm.disconnect()


async def test_pool_token_cannot_report_for_a_job_it_does_not_serve(alice, pool_b, token_a):
    other = await sync_to_async(make_job)(alice, [pool_b])
    comm, _ = await agent(token_a)
    for msg in (
        hb(other),
        {"type": "metrics", "job": other.pk, "points": [{"learner": None, "name": "val_loss", "value": 3.0}]},
        {"type": "event", "job": other.pk, "kind": "info", "message": "hi"},
        {"type": "subscribe", "job": other.pk, "learner": 0},
        hb(999_999),
    ):
        await comm.send_json_to(msg)
        err = await until(comm, lambda m: m["type"] == "error")
        assert err["code"] == "forbidden", err
    await _flush()
    assert await sync_to_async(Event.objects.filter(job=other).count)() == 0
    await comm.disconnect()


async def test_terminal_job_is_refused(alice, pool_a, token_a):
    done = await sync_to_async(make_job)(alice, [pool_a], status="cancelled")
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(done))
    err = await until(comm, lambda m: m["type"] == "error")
    assert err["code"] == "job_finished"
    await comm.disconnect()


async def test_learner_moved_to_this_pool_is_honoured_quickly(job, token_a, pool_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job, learner=1))
    assert (await until(comm, lambda m: m["type"] == "error"))["code"] == "forbidden"
    await sync_to_async(lambda: Learner.objects.filter(job=job, index=1).update(pool=pool_a))()
    await sync_to_async(lambda: __import__("time").sleep(0.3))()
    await comm.send_json_to(hb(job, learner=1))
    ack = await until(comm, lambda m: m["type"] in ("ack", "error"))
    assert ack["type"] == "ack"
    await comm.disconnect()
    await _flush()


async def test_repeated_abuse_closes_4403(job, token_a, settings):
    settings.TELEMETRY_ABUSE_LIMIT = 3
    comm, _ = await agent(token_a)
    for _ in range(4):
        await comm.send_json_to(hb(job, learner=1))
    code, msgs = await expect_close(comm)
    assert code == 4403
    assert msgs[-1]["code"] == "abuse" and msgs[-1]["fatal"] is True


# -- malformed frames ------------------------------------------------------------------------------------

BAD_FRAMES = {
    "not json": "hello there",
    "array": "[1, 2, 3]",
    "no type": '{"job": 1}',
    "unknown type": '{"type": "launch_missiles"}',
    "job as string": '{"type":"heartbeat","job":"7","learner":0,"incarnation":1,"step":1,"tokens":1}',
    "bool as int": '{"type":"heartbeat","job":7,"learner":true,"incarnation":1,"step":1,"tokens":1}',
    "NaN": '{"type":"heartbeat","job":7,"learner":0,"incarnation":1,"step":1,"tokens":1,"loss":NaN}',
    "Infinity": '{"type":"metrics","job":7,"points":[{"name":"train_loss","value":Infinity}]}',
    "huge number": '{"type":"heartbeat","job":7,"learner":0,"incarnation":1,"step":1,"tokens":'
                   + "9" * 30 + "}",
    "negative": '{"type":"heartbeat","job":7,"learner":-1,"incarnation":1,"step":1,"tokens":1}',
    "missing field": '{"type":"heartbeat","job":7,"learner":0}',
    "unknown field": '{"type":"heartbeat","job":7,"learner":0,"incarnation":1,"step":1,"tokens":1,"x":1}',
    "bad metric name": '{"type":"metrics","job":7,"points":[{"name":"DROP TABLE","value":1}]}',
    "unknown event kind": '{"type":"event","job":7,"kind":"explode"}',
    "huge frame": json.dumps({"type": "event", "job": 7, "kind": "info", "payload": {"x": "y" * 70_000}}),
    "deep nesting": '{"type":"event","job":7,"kind":"info","payload":' + '{"a":' * 5000 + "1" + "}" * 5001,
    "nul in string": '{"type":"hello","worker":"a\\u0000b"}',
    "nul in payload": '{"type":"event","job":7,"kind":"info","payload":{"k":["x\\u0000"]}}',
    "lone surrogate": '{"type":"event","job":7,"kind":"info","message":"\\ud800"}',
}


async def test_malformed_frames_close_4400_others_keep_working(job, token_a):
    bystander, _ = await agent(token_a)
    reasons = {}
    malformed_before = STATS["malformed"]
    for name, frame in [*BAD_FRAMES.items(), ("binary", b"\x00\x01")]:
        comm, _ = await agent(token_a)
        if isinstance(frame, bytes):
            await comm.send_to(bytes_data=frame)
        else:
            await comm.send_to(text_data=frame)
        code, msgs = await expect_close(comm)
        assert code == 4400, name
        err = msgs[-1]
        assert err["type"] == "error" and err["code"] == "malformed" and err["fatal"], name
        reasons[name] = err["reason"]
        await bystander.send_json_to(hb(job, tokens=len(reasons)))  # still served
        assert (await until(bystander, lambda m: m["type"] in ("ack", "error")))["type"] == "ack", name
    # the reasons say what was wrong
    assert "invalid JSON" in reasons["not json"]
    assert "heartbeat.job must be an integer" in reasons["job as string"]
    assert "non-finite" in reasons["NaN"] and "non-finite" in reasons["Infinity"]
    assert "larger than 65536" in reasons["huge frame"]
    assert "unknown message type" in reasons["unknown type"]
    assert "unknown field(s) x" in reasons["unknown field"]
    assert "out of range" in reasons["huge number"]
    assert "binary frames are not accepted" in reasons["binary"]
    assert STATS["malformed"] == malformed_before + len(BAD_FRAMES) + 1
    await bystander.disconnect()
    await _flush()
    assert (await sync_to_async(Learner.objects.get)(job=job, index=0)).tokens == len(BAD_FRAMES) + 1


async def test_ack_before_close_points_at_the_offender(job, token_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job))
    await comm.send_json_to({"type": "ping"})
    await comm.send_to(text_data="{broken")
    code, msgs = await expect_close(comm)
    assert code == 4400
    assert [m for m in msgs if m["type"] == "ack"][-1]["n"] == 2
    await _flush()


# -- metrics, events, fan-out, control -------------------------------------------------------------------

async def test_metrics_and_events_are_written_and_fanned_out(job, token_a, coord_token):
    from .conftest import browser

    watcher, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=await sync_to_async(lambda: job.owner)())
    assert ok
    snapshot = [await watcher.receive_json_from() for _ in range(3)]  # job + 2 learners
    assert snapshot[0]["type"] == "job" and {m["type"] for m in snapshot[1:]} == {"learner"}

    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "metrics", "job": job.pk, "points": [
        {"learner": 0, "name": "train_loss", "step": 100, "value": 2.75, "time": 1.8e9},
    ]})
    # a pool may put notes (info) on the timeline; checkpoints and moves are the coordinator's
    await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info", "message": "v3",
                             "payload": {"version": 3}, "learner": 0})
    await comm.send_json_to(hb(job))
    await until(comm, lambda m: m["type"] == "ack" and m["n"] == 3)
    # job-level points (learner null) are the coordinator's (a pool token's are refused)
    coord, _ = await agent(coord_token)
    await coord.send_json_to({"type": "metrics", "job": job.pk, "points": [
        {"learner": None, "name": "goodput", "step": 100, "value": 0.9},
    ]})
    await until(coord, lambda m: m["type"] == "ack" and m["n"] == 1)
    await coord.disconnect()
    await _flush()

    rows = await sync_to_async(lambda: list(
        MetricPoint.objects.filter(job=job).order_by("name")
        .values_list("name", "learner__index", "step", "value")
    ))()
    assert rows == [("goodput", None, 100, 0.9), ("train_loss", 0, 100, 2.75)]
    ev = await sync_to_async(Event.objects.get)(job=job, kind="info")
    assert ev.message == "pool tele-a: v3" and ev.payload == {"version": 3, "learner": 0}
    assert ev.pool_id == (await sync_to_async(lambda: job.learners.get(index=0).pool_id)())

    got = {}
    while len(got) < 4:
        m = await watcher.receive_json_from(timeout=2)
        got.setdefault(m["type"], m)
    assert got["metrics"]["points"][0]["value"] == 2.75
    assert got["metrics"]["points"][0]["time"] == 1.8e9
    lrn = got["learner"]
    assert (lrn["index"], lrn["tokens"], lrn["pool"]) == (0, 1000, "tele-a")
    assert got["event"]["kind"] == "info" and got["event"]["pool"] == "tele-a"
    assert got["job"]["status"] == "running"
    await comm.disconnect()
    await watcher.disconnect()


async def test_control_reaches_the_connection_serving_the_learner(job, token_a, token_b):
    a, _ = await agent(token_a)
    b, _ = await agent(token_b)
    await a.send_json_to(hb(job, learner=0))
    await b.send_json_to({"type": "subscribe", "job": job.pk, "learner": 1})
    await until(a, lambda m: m["type"] == "ack")
    await until(b, lambda m: m["type"] == "ack")
    assert await sync_to_async(publish.send_control)(job.pk, 0, {"action": "resize", "work_size": 12})
    msg = await until(a, lambda m: m["type"] == "control")
    assert msg == {"type": "control", "job": job.pk, "learner": 0, "action": "resize", "work_size": 12}
    assert await b.receive_nothing(0.2)
    await publish.asend_control(job.pk, 1, {"action": "stop"})
    msg = await until(b, lambda m: m["type"] == "control")
    assert (msg["learner"], msg["action"]) == (1, "stop")
    await a.disconnect()
    await b.disconnect()
    await _flush()


async def test_coordinator_publish_and_fleet_events(job, coord_token, token_a, pool_a, staff_user):
    from .conftest import browser

    fleet, ok, _ = await browser("/ws/fleet/", user=staff_user)
    assert ok
    coord, _ = await agent(coord_token)
    pool_msg = {"type": "pool", "slug": "tele-a", "state": "draining"}
    await coord.send_json_to({"type": "publish", "message": pool_msg})
    assert await fleet.receive_json_from(timeout=2) == pool_msg
    await coord.send_json_to({"type": "event", "job": None, "kind": "drained", "pool": "tele-a",
                              "message": "pool tele-a drained"})
    await until(coord, lambda m: m["type"] == "ack")
    await _flush()
    ev = await fleet.receive_json_from(timeout=2)
    assert (ev["type"], ev["kind"], ev["pool"], ev["job"]) == ("event", "drained", "tele-a", None)
    # pool tokens may not publish nor send job-less events
    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "publish", "message": {"type": "pool"}})
    assert (await until(comm, lambda m: m["type"] == "error"))["code"] == "forbidden"
    await comm.send_json_to({"type": "event", "job": None, "kind": "info"})
    assert (await until(comm, lambda m: m["type"] == "error"))["code"] == "forbidden"
    assert await fleet.receive_nothing(0.2)
    for c in (comm, coord, fleet):
        await c.disconnect()


async def test_heartbeat_never_moves_tokens_backwards(job, token_a):
    comm, _ = await agent(token_a)
    await sync_to_async(lambda: Learner.objects.filter(job=job, index=0).update(tokens=5000))()
    await comm.send_json_to(hb(job, tokens=4000))  # e.g. replayed from a buffer after an outage
    await until(comm, lambda m: m["type"] == "ack")
    writer = get_writer()
    await writer.flush()
    assert writer.stats["heartbeats_stale"] == 1
    assert (await sync_to_async(Learner.objects.get)(job=job, index=0)).tokens == 5000
    await comm.disconnect()


async def test_rows_of_a_job_deleted_before_the_flush_are_skipped(job, token_a):
    comm, _ = await agent(token_a)
    writer = get_writer()
    writer.interval = 30
    await comm.send_json_to({"type": "metrics", "job": job.pk,
                             "points": [{"learner": 0, "name": "train_loss", "value": 1.0}]})
    await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info"})
    await comm.send_json_to(hb(job))
    await until(comm, lambda m: m["type"] == "ack" and m["n"] == 3)
    await sync_to_async(lambda: type(job).objects.filter(pk=job.pk).delete())()
    await writer.flush()
    assert writer.stats["flush_errors"] == 0 and writer.stats["points_written"] == 0
    await comm.disconnect()


async def test_server_error_closes_1011_without_acking_the_frame(job, token_a, monkeypatch):
    from apps.telemetry import scope

    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "ping"})
    await until(comm, lambda m: m["type"] == "pong")

    async def broken(job_id):
        raise RuntimeError("database away")

    monkeypatch.setattr(scope.cache, "_fetch", broken)
    await comm.send_json_to(hb(job))
    code, msgs = await expect_close(comm)
    assert code == 1011
    assert msgs[-1]["code"] == "server_error"
    assert [m["n"] for m in msgs if m["type"] == "ack"][-1:] == [1]  # the ping only: hb will be re-sent


async def test_node_from_placement_when_no_hello(job, pool_a, token_a):
    node = await sync_to_async(Node.objects.create)(pool=pool_a, hostname="h2", worker_name="w2@h2",
                                                    last_seen="2026-01-01T00:00Z")
    await sync_to_async(lambda: Learner.objects.filter(job=job, index=0).update(node=node))()
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job, tokens_per_s=321.0))
    await until(comm, lambda m: m["type"] == "ack")
    await get_writer().flush()
    node = await sync_to_async(Node.objects.get)(pk=node.pk)
    lrn = await sync_to_async(Learner.objects.get)(job=job, index=0)
    assert node.measured_tokens_per_s == 321.0 and node.last_seen == lrn.last_heartbeat
    await comm.disconnect()


async def test_fast_sender_is_slowed_down_not_refused(job, token_a, settings):
    settings.TELEMETRY_MAX_ITEMS_PER_S = 100  # bucket: 200 items
    comm, _ = await agent(token_a)
    before = STATS["throttled"]
    points = [{"learner": 0, "name": "train_loss", "step": i, "value": 1.0} for i in range(150)]
    for _ in range(2):  # 300 points: the second message waits for the bucket to refill
        await comm.send_json_to({"type": "metrics", "job": job.pk, "points": points})
    ack = await until(comm, lambda m: m["type"] in ("ack", "error") and m.get("n", 0) == 2, timeout=5)
    assert ack["type"] == "ack"
    assert STATS["throttled"] == before + 1
    await comm.disconnect()
    await _flush()
    assert await sync_to_async(MetricPoint.objects.filter(job=job).count)() == 300


async def test_token_revoked_while_connected_is_cut_off(job, pool_a, token_a, monkeypatch):
    from apps.telemetry import consumers

    monkeypatch.setattr(consumers, "REAUTH_S", 0.0)  # check on every frame
    comm, _ = await agent(token_a)
    await comm.send_json_to(hb(job))
    assert (await until(comm, lambda m: m["type"] in ("ack", "error")))["type"] == "ack"
    tokens = PoolToken.objects.filter(pool=pool_a)
    await sync_to_async(lambda: tokens.update(revoked_at="2026-01-01T00:00Z"))()
    await comm.send_json_to(hb(job))
    code, msgs = await expect_close(comm)
    assert code == 4401 and msgs[-1]["reason"] == "token revoked"
