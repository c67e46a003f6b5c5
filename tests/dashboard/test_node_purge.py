"""Silent nodes are marked lost, long-gone ones purged from the fleet view with an event."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.inventory import liveness
from apps.inventory.models import Node
from apps.inventory.tasks import fleet_tick
from apps.jobs.models import Event


@pytest.fixture
def nodes(fleet, settings):
    settings.NODE_OFFLINE_AFTER_S, settings.NODE_PURGE_AFTER_S = 30, 3600
    now = timezone.now()
    pool = fleet["h100-east"]
    Node.objects.filter(pool=pool).delete()
    mk = lambda name, state, ago: Node.objects.create(  # noqa: E731
        pool=pool, hostname=name, worker_name=f"h100-east@{name}", state=state,
        last_seen=now - timedelta(seconds=ago))
    return {"fresh": mk("fresh", "online", 2), "silent": mk("silent", "online", 90),
            "gone": mk("gone", "offline", 2 * 3600), "lost-long": mk("lost-long", "lost", 5 * 3600),
            "lost-recent": mk("lost-recent", "lost", 600), "draining": mk("draining", "draining", 5 * 3600)}


@pytest.mark.django_db
def test_silent_node_is_marked_lost_with_an_event(nodes):
    lost = liveness.mark_silent_lost()
    assert [n.hostname for n in lost] == ["silent"]
    assert Node.objects.get(pk=nodes["silent"].pk).state == "lost"
    assert Node.objects.get(pk=nodes["fresh"].pk).state == "online"
    ev = Event.objects.get(message__startswith="node h100-east@silent lost")
    assert ev.pool_id == nodes["silent"].pool_id and ev.kind == "failed"
    assert liveness.mark_silent_lost() == []  # once


@pytest.mark.django_db
def test_purge_hides_from_the_fleet_view_and_keeps_the_rows(client, staff_user, nodes):
    purged = liveness.purge_stale()
    assert sorted(n.hostname for n in purged) == ["gone", "lost-long"]  # not draining, not recent
    assert Node.objects.filter(pk__in=[n.pk for n in purged], purged_at__isnull=False).count() == 2
    assert Event.objects.filter(kind="left", message__contains="purged").count() == 2
    assert liveness.purge_stale() == []  # once: one event per purge
    client.force_login(staff_user)
    body = client.get("/fleet/h100-east/").content.decode()
    assert "<code>h100-east@fresh</code>" in body and "<code>h100-east@lost-recent</code>" in body
    assert "<code>h100-east@gone</code>" not in body and "<code>h100-east@lost-long</code>" not in body
    assert "node h100-east@gone purged" in body  # the pool's events say so
    assert 'id="purged-nodes"' in body and "2 nodes offline" in body
    body = client.get("/fleet/").content.decode()
    assert "4/" not in body and "/4 nodes online" in body  # fresh, silent, lost-recent, draining
    # the API and the admin still list every node: a purge is not a delete
    assert Node.objects.filter(pool=nodes["gone"].pool).count() == 6


@pytest.mark.django_db
def test_a_purged_node_that_comes_back_shows_again(client, staff_user, nodes):
    liveness.purge_stale()
    Node.objects.filter(pk=nodes["gone"].pk).update(last_seen=timezone.now(), state="online")  # its heartbeat
    client.force_login(staff_user)
    body = client.get("/fleet/h100-east/").content.decode()
    assert "<code>h100-east@gone</code>" in body and "1 node offline" in body


@pytest.mark.django_db
def test_the_tick_does_both_and_reports_only_changes(nodes):
    out = fleet_tick()
    assert out == {"nodes_lost": 1, "nodes_purged": 2}
    assert fleet_tick() == {"nodes_lost": 0, "nodes_purged": 0}
