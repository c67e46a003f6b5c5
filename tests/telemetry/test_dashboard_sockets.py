"""Dashboard sockets: who may watch a job or the fleet; what they receive."""
from __future__ import annotations

import pytest
from channels.db import database_sync_to_async

from apps.telemetry import publish

from .conftest import browser, expect_close

pytestmark = [pytest.mark.django_db(transaction=True)]


async def test_job_socket_permission_matrix(job, alice, bob, staff_user):
    # owner: snapshot (job + its learners), then live messages
    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=alice)
    assert ok
    first = await comm.receive_json_from()
    assert (first["type"], first["id"], first["status"]) == ("job", job.pk, "running")
    learners = [await comm.receive_json_from() for _ in range(2)]
    assert sorted((m["index"], m["pool"]) for m in learners) == [(0, "tele-a"), (1, "tele-b")]
    await publish.apublish_job(job.pk, {"type": "event", "kind": "info", "message": "hello"})
    assert (await comm.receive_json_from())["message"] == "hello"
    await comm.disconnect()

    # staff: allowed
    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=staff_user)
    assert ok and (await comm.receive_json_from())["type"] == "job"
    await comm.disconnect()

    # another user: 4403, and nothing about the job leaks
    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=bob)
    code, msgs = await expect_close(comm)
    assert code == 4403 and [m["type"] for m in msgs] == ["error"]

    # anonymous: 4403
    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/")
    assert (await expect_close(comm))[0] == 4403

    # missing job: 4404 for staff, 4403 for others
    comm, ok, _ = await browser("/ws/jobs/987654321/", user=staff_user)
    assert (await expect_close(comm))[0] == 4404
    comm, ok, _ = await browser("/ws/jobs/987654321/", user=alice)
    assert (await expect_close(comm))[0] == 4403
    comm, ok, _ = await browser("/ws/jobs/99999999999999999999999/", user=staff_user)
    assert (await expect_close(comm))[0] == 4404


async def test_other_users_do_not_receive_job_messages(job, alice, bob, alice_job_other_user):
    watcher, ok, _ = await browser(f"/ws/jobs/{alice_job_other_user.pk}/", user=bob)
    assert ok
    await watcher.receive_json_from()  # snapshot: job
    await publish.apublish_job(job.pk, {"type": "event", "kind": "info", "message": "secret"})
    assert await watcher.receive_nothing(0.3)
    await watcher.disconnect()


@pytest.fixture
def alice_job_other_user(bob, pool_a):
    from .conftest import make_job

    return make_job(bob, [])


async def test_fleet_socket(alice, db):
    comm, ok, _ = await browser("/ws/fleet/", user=alice)
    assert ok
    await database_sync_to_async(publish.publish_fleet)({"type": "pool", "slug": "x", "state": "active"})
    assert await comm.receive_json_from() == {"type": "pool", "slug": "x", "state": "active"}
    await comm.send_json_to({"type": "ping"})
    assert (await comm.receive_json_from())["type"] == "pong"
    await comm.disconnect()
    comm, ok, _ = await browser("/ws/fleet/")
    assert (await expect_close(comm))[0] == 4403


async def test_foreign_origin_is_refused(job, alice):
    comm, ok, code = await browser(f"/ws/jobs/{job.pk}/", user=alice, origin=b"https://evil.example")
    assert not ok
    comm, ok, code = await browser("/ws/fleet/", user=alice, origin=b"https://evil.example")
    assert not ok


async def test_sync_publish_from_inside_the_event_loop(job, alice):
    """publish_job called by sync code running in the loop's thread schedules the send."""
    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=alice)
    assert ok
    for _ in range(3):  # snapshot
        await comm.receive_json_from()
    assert publish.publish_job(job.pk, {"type": "job", "status": "paused"})
    assert await comm.receive_json_from(timeout=2) == {"type": "job", "status": "paused"}
    await comm.disconnect()


async def test_teammate_may_watch_a_team_job(job, bob):
    from django.contrib.auth.models import Group

    @database_sync_to_async
    def share():
        team = Group.objects.create(name="vision")
        job.owner.groups.add(team)
        bob.groups.add(team)
        job.team = "vision"
        job.save(update_fields=["team"])

    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=bob)
    assert (await expect_close(comm))[0] == 4403  # not yet shared
    await share()
    comm, ok, _ = await browser(f"/ws/jobs/{job.pk}/", user=bob)
    assert ok and (await comm.receive_json_from())["id"] == job.pk
    await comm.disconnect()
