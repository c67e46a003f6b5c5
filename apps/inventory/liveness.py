"""Silent nodes: marked lost after NODE_OFFLINE_AFTER_S, purged after NODE_PURGE_AFTER_S.

The watchdog already marks a node lost when its learners miss their heartbeats; a node with
no learner that goes silent (its worker killed while idle) is only caught here. Purging hides
a node that has stayed offline or lost for the purge interval from the fleet view, with an
event: its row, its samples and the events and incidents that name it all stay. A purged node
whose worker comes back shows again by itself (its `last_seen` passes its `purged_at`).
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.jobs.models import Event

from .models import Node, visible_nodes_q


def mark_silent_lost(now: datetime | None = None) -> list[Node]:
    """Online nodes not seen for NODE_OFFLINE_AFTER_S become lost (a heartbeat brings them back)."""
    now = now or timezone.now()
    after = float(settings.NODE_OFFLINE_AFTER_S)
    cut = now - timedelta(seconds=after)
    lost = []
    with transaction.atomic():
        for node in Node.objects.select_for_update(skip_locked=True).select_related("pool").filter(
                state=Node.State.ONLINE, last_seen__lt=cut):
            Node.objects.filter(pk=node.pk).update(state=Node.State.LOST)
            node.state = Node.State.LOST
            silent = (now - node.last_seen).total_seconds()
            msg = f"node {node.worker_name} lost: no heartbeat for {silent:.0f} s"
            Event.objects.create(pool=node.pool, kind=Event.Kind.FAILED, message=msg[:300],
                                 payload={"node": node.worker_name, "reason": f"silent over {after:g} s"})
            lost.append(node)
    return lost


def purge_stale(now: datetime | None = None) -> list[Node]:
    """Offline or lost nodes not seen for NODE_PURGE_AFTER_S leave the fleet view, with an event."""
    now = now or timezone.now()
    after = float(settings.NODE_PURGE_AFTER_S)
    cut = now - timedelta(seconds=after)
    purged = []
    with transaction.atomic():
        gone = (Node.State.OFFLINE, Node.State.LOST)
        stale = (Node.objects.select_for_update(skip_locked=True).select_related("pool")
                 .filter(visible_nodes_q(), state__in=gone, last_seen__lt=cut))
        for node in stale:
            Node.objects.filter(pk=node.pk).update(purged_at=now)
            node.purged_at = now
            days = (now - node.last_seen).total_seconds() / 86400
            Event.objects.create(pool=node.pool, kind=Event.Kind.LEFT,
                                 message=f"node {node.worker_name} purged: {node.state} and not seen "
                                         f"for {days:.1f} days"[:300],
                                 payload={"node": node.worker_name, "state": node.state, "purged": True,
                                          "last_seen": node.last_seen.isoformat()})
            purged.append(node)
    return purged

