"""Issue 35: telemetry as untrusted input, and live sockets that end when access ends.

One test (or a few) per finding:
- Medium 3: a metric step beyond the documented bound is refused; a step near 2^63 already
  stored does not turn the overview, the job page, its series and both compare views into 500s.
- Medium 4: learner-level points under a job-level name (val_loss...) are not the job's
  figures; pools may only send `info` events, which get the server's time.
- Medium 5: a dashboard socket closes when its user leaves the job's team, when its session
  logs out, and when the job moves away (periodic re-check).
- Medium 7: bytes per second per pool token, sockets per token, payload size, events per job.
- Low: control characters from pools stripped or refused; a revoked token's idle socket closed.
"""
from __future__ import annotations

import json
import logging
import time

import pytest
from channels.db import database_sync_to_async as sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from apps.inventory.models import PoolToken
from apps.jobs.models import Event, Job, Learner, MetricPoint
from apps.telemetry import guards, publish
from apps.telemetry.consumers import STATS
from apps.telemetry.protocol import ProtocolError, clean_text, parse_frame
from apps.telemetry.writer import get_writer

from .conftest import agent, expect_close, until

HUGE = 2**63 - 1


async def _flush():
    await get_writer().stop()


async def _reply(comm):
    return await until(comm, lambda m: m["type"] in ("ack", "error"))


# -- Medium 3: bounds, and downsampling that cannot overflow -------------------------------------

def test_protocol_bounds_match_the_docs():
    def metrics(step):
        return json.dumps({"type": "metrics", "job": 7, "points": [
            {"learner": 0, "name": "train_loss", "step": step, "value": 1.0}]})

    assert parse_frame(metrics(2**53 - 1), 65536)["points"][0]["step"] == 2**53 - 1
    for step in (2**53, HUGE):
        with pytest.raises(ProtocolError, match="step out of range"):
            parse_frame(metrics(step), 65536)
    beat = {"type": "heartbeat", "job": 7, "learner": 0, "incarnation": 1, "step": 1, "tokens": HUGE}
    with pytest.raises(ProtocolError, match="tokens out of range"):
        parse_frame(json.dumps(beat), 65536)
    with pytest.raises(ProtocolError, match="step out of range"):
        parse_frame(json.dumps({**beat, "tokens": 1, "step": 2**31}), 65536)


@pytest.mark.django_db(transaction=True)
async def test_a_huge_step_from_a_pool_is_refused(job, token_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "metrics", "job": job.pk, "points": [
        {"learner": 0, "name": "train_loss", "step": HUGE, "value": 1.0}]})
    code, msgs = await expect_close(comm)
    assert code == 4400 and "step out of range" in msgs[-1]["reason"]
    await _flush()
    assert not await sync_to_async(MetricPoint.objects.filter(job=job).exists)()


@pytest.fixture
def stored_huge(alice, pool_a):
    """Two running jobs of alice; the first has a point at step 2^63-1 (stored before the bound)."""
    jobs = []
    for name in ("huge", "fine"):
        job = Job.objects.create(owner=alice, name=name, spec={"name": name}, status="running",
                                 started_at=timezone.now())
        lrn = Learner.objects.create(job=job, index=0, incarnation=1, pool=pool_a, state="running")
        rows = [MetricPoint(job=job, learner=lrn, name="train_loss", step=1000 * i, value=3.0 - i / 10)
                for i in range(1, 6)]
        rows += [MetricPoint(job=job, name="val_loss", step=1000 * i, value=3.1 - i / 10)
                 for i in range(1, 6)]
        MetricPoint.objects.bulk_create(rows)
        jobs.append(job)
    lrn = jobs[0].learners.get()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=jobs[0], learner=lrn, name="train_loss", step=HUGE, value=0.5),
        MetricPoint(job=jobs[0], name="val_loss", step=HUGE, value=0.5),
        MetricPoint(job=jobs[0], learner=lrn, name="goodput", step=HUGE, value=0.5),
    ])
    return jobs


@pytest.mark.django_db
def test_a_stored_huge_step_does_not_break_any_page(alice, stored_huge):
    from apps.api.models import ApiToken

    huge, fine = stored_huge
    web = Client()
    web.force_login(alice)
    _, token = ApiToken.issue(alice, "t")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    pages = [(web, "/"), (web, f"/jobs/{huge.pk}/"), (web, f"/jobs/{huge.pk}/series.json"),
             (web, f"/compare/?jobs={huge.pk},{fine.pk}"),
             (api, f"/api/v1/compare/?jobs={huge.pk},{fine.pk}"), (api, f"/api/v1/jobs/{huge.pk}/metrics/"),
             (api, f"/api/v1/jobs/{huge.pk}/")]
    for client, url in pages:
        r = client.get(url)
        assert r.status_code == 200, (url, r.status_code)
    series = api.get(f"/api/v1/jobs/{huge.pk}/metrics/?name=train_loss&points=2").json()["series"]
    assert series[0]["points"][-1][0] == pytest.approx(float(HUGE))


# -- Medium 4: job-level figures are the coordinator's; pool events ------------------------------------

@pytest.fixture
def forged_val_loss(alice, pool_a):
    """Job-level val_loss 5.25, 4.25 ... from the coordinator, and two learner-level 0.0001s."""
    job = Job.objects.create(owner=alice, name="v", spec={"name": "v"}, status="running",
                             started_at=timezone.now())
    lrn = Learner.objects.create(job=job, index=0, incarnation=1, pool=pool_a, state="running")
    MetricPoint.objects.bulk_create(
        [MetricPoint(job=job, name="val_loss", step=1000 * i, value=5.25 - i) for i in range(4)]
        + [MetricPoint(job=job, learner=lrn, name="val_loss", step=s, value=0.0001) for s in (0, 3000)]
        + [MetricPoint(job=job, learner=lrn, name="train_loss", step=1000 * i, value=6 - i)
           for i in range(4)])
    return job


@pytest.mark.django_db
def test_learner_level_val_loss_is_not_the_jobs(alice, forged_val_loss):
    from apps.api.metrics import latest_values, series
    from apps.dashboard import compare, data

    job = forged_val_loss
    curve = data.downsample([job.pk], ["val_loss", "train_loss"], 200)[job.pk]
    assert [round(y, 4) for _x, _t, y in curve["val_loss"]] == [5.25, 4.25, 3.25, 2.25]
    assert [y for _x, _t, y in curve["train_loss"]] == [6, 5, 4, 3]  # learner series still count
    spark = data.downsample([job.pk], ["val_loss"], 20, recent=3)[job.pk]["val_loss"]
    assert min(y for _x, _t, y in spark) == pytest.approx(2.25)
    assert latest_values(job)["val_loss"] == pytest.approx(2.25)
    assert [(s["name"], s["learner"]) for s in series(job)] == [("train_loss", 0), ("val_loss", None)]
    fig = compare.compare(alice, [job.pk], metric="val_loss")
    row = fig["jobs"][0]
    assert row["final_loss"] == pytest.approx(2.25) and min(row["series"]["loss"]) == pytest.approx(2.25)


@pytest.mark.django_db(transaction=True)
async def test_a_pool_may_not_write_job_level_series_even_per_learner(job, token_a):
    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "metrics", "job": job.pk, "points": [
        {"learner": 0, "name": "train_loss", "step": 10, "value": 2.0},
        {"learner": 0, "name": "val_loss", "step": 10, "value": 0.0001}]})
    err = await _reply(comm)
    assert err["type"] == "error" and err["code"] == "forbidden" and "val_loss" in err["reason"]
    await comm.disconnect()
    await _flush()
    assert not await sync_to_async(MetricPoint.objects.filter(job=job).exists)()


@pytest.mark.django_db(transaction=True)
async def test_pools_send_info_events_only_at_the_servers_time(job, token_a, coord_token):
    from apps.dashboard.markers import job_markers

    guards.events_gate().jobs.clear()
    comm, _ = await agent(token_a)
    for kind in ("status", "checkpointed", "reassigned", "rebalanced", "drained", "failed", "placed"):
        await comm.send_json_to({"type": "event", "job": job.pk, "kind": kind, "message": "job completed",
                                 "payload": {"to": "tele-a"}})
        err = await _reply(comm)
        assert err["type"] == "error" and err["code"] == "forbidden", kind
    before = time.time()
    await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info", "message": "job completed",
                             "time": 9.9e9, "learner": 0})
    assert (await _reply(comm))["type"] == "ack"
    # a learner of another pool: refused
    await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info", "learner": 1})
    assert (await _reply(comm))["type"] == "error"
    await comm.disconnect()
    # the coordinator's own events keep their kind and time
    coord, _ = await agent(coord_token)
    await coord.send_json_to({"type": "event", "job": job.pk, "kind": "checkpointed", "message": "v1",
                              "time": 1.8e9})
    assert (await _reply(coord))["type"] == "ack"
    await coord.disconnect()
    await _flush()
    rows = await sync_to_async(lambda: list(Event.objects.filter(job=job).order_by("id")))()
    assert [(e.kind, e.message) for e in rows] == [("info", "pool tele-a: job completed"),
                                                   ("checkpointed", "v1")]
    assert before - 1 <= rows[0].time.timestamp() <= time.time() + 1
    assert rows[1].time.timestamp() == 1.8e9
    assert await sync_to_async(job_markers)(job) == []


# -- Medium 5: dashboard sockets end when access ends ---------------------------------------------------

async def _watch(path, client):
    from diloco_platform.asgi import application

    cookie = client.cookies["sessionid"].value
    comm = WebsocketCommunicator(application, path, headers=[(b"origin", b"http://testserver"),
                                                             (b"cookie", f"sessionid={cookie}".encode())])
    connected, _ = await comm.connect()
    assert connected
    return comm


def _login(user):
    c = Client()
    c.force_login(user)
    return c


@pytest.fixture
def team_job(alice, vision, pool_a):
    job = Job.objects.create(owner=alice, team="vision", name="t", spec={"name": "t"}, status="running")
    Learner.objects.create(job=job, index=0, incarnation=1, pool=pool_a, state="running")
    return job


@pytest.mark.django_db(transaction=True)
async def test_leaving_the_team_closes_the_job_socket(team_job, bob, vision):
    comm = await _watch(f"/ws/jobs/{team_job.pk}/", await sync_to_async(_login)(bob))
    assert (await comm.receive_json_from())["type"] == "job"
    await comm.receive_json_from()  # the learner
    await publish.apublish_job(team_job.pk, {"type": "event", "message": "before"})
    assert (await comm.receive_json_from())["message"] == "before"
    await sync_to_async(lambda: bob.groups.remove(vision))()
    code, msgs = await expect_close(comm)
    assert code == 4403 and [m["type"] for m in msgs] == ["error"]


@pytest.mark.django_db(transaction=True)
async def test_a_job_moved_away_is_rechecked_before_forwarding(team_job, bob, monkeypatch):
    from apps.telemetry import consumers

    monkeypatch.setattr(consumers, "ACCESS_RECHECK_S", 0.0)
    comm = await _watch(f"/ws/jobs/{team_job.pk}/", await sync_to_async(_login)(bob))
    await comm.receive_json_from()
    await comm.receive_json_from()
    # no signal for this one: the job's team changes under the socket
    await sync_to_async(lambda: Job.objects.filter(pk=team_job.pk).update(team=""))()
    await publish.apublish_job(team_job.pk, {"type": "event", "message": "secret"})
    code, msgs = await expect_close(comm)
    assert code == 4403 and all(m.get("message") != "secret" for m in msgs)


@pytest.mark.django_db(transaction=True)
async def test_logout_closes_that_sessions_sockets_only(team_job, alice):
    one, two = await sync_to_async(_login)(alice), await sync_to_async(_login)(alice)
    job_sock = await _watch(f"/ws/jobs/{team_job.pk}/", one)
    fleet_sock = await _watch("/ws/fleet/", one)
    other = await _watch(f"/ws/jobs/{team_job.pk}/", two)
    for comm in (job_sock, other):
        await comm.receive_json_from()
        await comm.receive_json_from()
    await sync_to_async(one.logout)()
    assert (await expect_close(job_sock))[0] == 4403
    assert (await expect_close(fleet_sock))[0] == 4403
    await publish.apublish_job(team_job.pk, {"type": "event", "message": "still here"})
    assert (await other.receive_json_from(timeout=3))["message"] == "still here"
    await other.disconnect()


# -- Medium 7: floods ----------------------------------------------------------------------------

def _big_metrics(job, n=600):
    return {"type": "metrics", "job": job.pk, "points": [
        {"learner": 0, "name": "train_loss", "step": i, "value": 1.0 + i / 1e6, "time": 1.8e9}
        for i in range(n)]}


@pytest.mark.django_db(transaction=True)
async def test_bytes_per_second_are_limited_per_token(job, token_a, settings):
    settings.TELEMETRY_MAX_BYTES_PER_S = 50_000  # a bucket of 100 kB, shared by the token's sockets
    msg = _big_metrics(job)
    size = len(json.dumps(msg))
    assert 40_000 < size < 60_000
    before = STATS["throttled_bytes"]
    a, _ = await agent(token_a)
    b, _ = await agent(token_a)  # a second socket of the same token does not get a fresh bucket
    t0 = time.monotonic()
    for comm in (a, b, a, b):
        await comm.send_json_to(msg)
    for comm in (a, b):
        await until(comm, lambda m: m["type"] == "ack" and m["n"] == 2, timeout=10)
    elapsed = time.monotonic() - t0
    assert STATS["throttled_bytes"] > before
    assert elapsed >= (4 * size - 100_000) / 50_000 * 0.8
    for comm in (a, b):
        await comm.disconnect()
    await _flush()


@pytest.mark.django_db(transaction=True)
async def test_sockets_per_token_are_capped(job, token_a, token_b, settings):
    settings.TELEMETRY_MAX_SOCKETS_PER_TOKEN = 2
    a1, _ = await agent(token_a)
    a2, _ = await agent(token_a)
    a3, first = await agent(token_a)
    assert first["code"] == "too_many_sockets"
    assert (await expect_close(a3))[0] == 4429
    b1, hello = await agent(token_b)  # another token is not affected
    assert hello["type"] == "hello"
    await a1.disconnect()
    a4, hello = await agent(token_a)  # a slot is free again
    assert hello["type"] == "hello"
    for comm in (a2, a4, b1):
        await comm.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_event_size_and_events_per_job_are_capped(job, token_a, settings):
    settings.TELEMETRY_MAX_POOL_EVENTS_PER_MIN = 3
    guards.events_gate().jobs.clear()
    comm, _ = await agent(token_a)
    replies = []
    for i in range(5):
        await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info", "message": f"n{i}"})
        replies.append(await _reply(comm))
    assert [r["type"] for r in replies] == ["ack", "ack", "ack", "error", "error"]
    assert replies[-1]["code"] == "rate_limited"
    # a payload over 2 KiB (the frame limit is 64 KiB): malformed
    await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info", "payload": {"x": "y" * 3000}})
    code, msgs = await expect_close(comm)
    assert code == 4400 and "payload larger than 2048" in msgs[-1]["reason"]
    await _flush()
    assert await sync_to_async(Event.objects.filter(job=job).count)() == 3


# -- Low: control characters, revoked tokens ------------------------------------------------------------

def test_clean_text():
    assert clean_text("ok\nINFO forged\r\x1b[2J\x1b]8;;http://x\x07link\x1b]8;;\x07\u202e\x85z") == \
        "ok INFO forged [2J]8;;http://xlink]8;; z"
    assert clean_text("plain € text") == "plain € text"


@pytest.mark.django_db(transaction=True)
async def test_control_characters_from_pools_never_reach_rows_or_logs(job, token_a, caplog):
    guards.events_gate().jobs.clear()
    caplog.set_level(logging.INFO, logger="apps.telemetry")
    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "event", "job": job.pk, "kind": "info",
                             "message": "done\n2026-12-07 INFO job completed\x1b[2J\x1b]8;;http://evil\x07",
                             "payload": {"reason\n": "a\x1b[31mred\r\nline"}})
    assert (await _reply(comm))["type"] == "ack"
    # a worker name with a line break is malformed (it is logged with every refusal)
    await comm.send_json_to({"type": "hello", "worker": "w1\nCRITICAL forged"})
    code, msgs = await expect_close(comm)
    assert code == 4400 and "control characters" in msgs[-1]["reason"]
    # an unknown field's name is quoted in the reason, which is logged
    comm, _ = await agent(token_a)
    await comm.send_json_to({"type": "ping", "x\nCRITICAL forged": 1})
    code, msgs = await expect_close(comm)
    assert code == 4400 and "\n" not in msgs[-1]["reason"]
    await _flush()
    ev = await sync_to_async(Event.objects.get)(job=job)
    assert ev.message == "pool tele-a: done 2026-12-07 INFO job completed[2J]8;;http://evil"
    assert ev.payload == {"reason ": "a[31mred  line"}
    for rec in caplog.records:
        text = rec.getMessage()
        assert "\n" not in text and "\x1b" not in text, text


@pytest.mark.django_db(transaction=True)
async def test_a_revoked_tokens_idle_socket_is_closed(job, pool_a, token_a, token_b):
    idle, _ = await agent(token_a)
    await idle.send_json_to({"type": "subscribe", "job": job.pk, "learner": 0})
    assert (await _reply(idle))["type"] == "ack"
    other, _ = await agent(token_b)
    # the admin action's path: a queryset update
    await sync_to_async(lambda: PoolToken.objects.filter(pool=pool_a).update(revoked_at=timezone.now()))()
    code, msgs = await expect_close(idle)
    assert code == 4401 and msgs[-1]["reason"] == "token revoked"
    # control for its learner no longer reaches anyone; the other pool's socket is open
    await publish.asend_control(job.pk, 0, {"action": "stop"})
    await other.send_json_to({"type": "ping"})
    assert (await until(other, lambda m: m["type"] == "pong"))["type"] == "pong"
    await other.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_token_revoked_by_save_or_behind_our_back_is_closed(job, pool_a, pool_b, token_a, token_b,
                                                                   settings):
    settings.TELEMETRY_TOKEN_CHECK_S = 0.2
    a, _ = await agent(token_a)
    b, _ = await agent(token_b)

    def save_revoked():
        tok = PoolToken.objects.get(pool=pool_a)
        tok.revoked_at = timezone.now()
        tok.save()

    await sync_to_async(save_revoked)()
    assert (await expect_close(a))[0] == 4401
    # no signal at all (raw SQL): the periodic check finds it
    from django.db import connection

    def raw_revoke():
        with connection.cursor() as cur:
            cur.execute(f"UPDATE {PoolToken._meta.db_table} SET revoked_at = now() WHERE pool_id = %s",  # noqa: S608
                        [pool_b.pk])

    await sync_to_async(raw_revoke)()
    assert (await expect_close(b, timeout=3))[0] == 4401
