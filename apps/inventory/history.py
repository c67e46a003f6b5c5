"""Pool and node history: one sample per pool and per live node, every FLEET_SAMPLE_INTERVAL_S.

The pages' history charts read these rows downsampled in the database
(apps.dashboard.data.fleet_history); live figures stay on the learners' rows. Figures are
the same as the fleet table's: utilisation = devices running a learner / devices, tokens/s
= the running learners' own reports, watts = the TDP-based estimate.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from apps.jobs.models import Learner

from .models import FleetSample, Node, Pool, estimated_watts, visible_nodes_q


def _running_by(field: str) -> dict[int, tuple[int, float]]:
    rows = (Learner.objects.filter(state=Learner.State.RUNNING, **{f"{field}__isnull": False})
            .values(field).annotate(busy=Count("id"), tps=Sum("tokens_per_s")).order_by())
    return {r[field]: (r["busy"], r["tps"] or 0.0) for r in rows}


def sample_fleet(now: datetime | None = None) -> int:
    """Write one sample per pool and per visible online/draining node; returns how many."""
    now = now or timezone.now()
    by_pool, by_node = _running_by("pool_id"), _running_by("node_id")
    samples = []
    tdp: dict[int, int] = {}
    for pool in Pool.objects.select_related("accelerator"):
        tdp[pool.pk] = pool.accelerator.tdp_watts
        busy, tps = by_pool.get(pool.pk, (0, 0.0))
        samples.append(FleetSample(
            pool=pool, time=now, devices=pool.device_count, busy=busy, tokens_per_s=tps,
            utilisation=min(1.0, busy / pool.device_count) if pool.device_count else 0.0,
            watts=estimated_watts(pool.accelerator.tdp_watts, pool.device_count, busy)))
    nodes = Node.objects.filter(visible_nodes_q(), state__in=(Node.State.ONLINE, Node.State.DRAINING))
    for node in nodes.only("pk", "pool_id", "device_count"):
        busy, tps = by_node.get(node.pk, (0, 0.0))
        devices = max(node.device_count, busy)
        samples.append(FleetSample(
            pool_id=node.pool_id, node=node, time=now, devices=devices, busy=busy, tokens_per_s=tps,
            utilisation=busy / devices if devices else 0.0,
            watts=estimated_watts(tdp.get(node.pool_id, 0), devices, busy)))
    FleetSample.objects.bulk_create(samples)
    return len(samples)


def forget_old(now: datetime | None = None) -> int:
    """Delete samples older than FLEET_SAMPLE_RETENTION_DAYS."""
    now = now or timezone.now()
    cut = now - timedelta(days=float(settings.FLEET_SAMPLE_RETENTION_DAYS))
    return FleetSample.objects.filter(time__lt=cut).delete()[0]
