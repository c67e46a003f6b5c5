"""Pool and node history: sampled by the fleet tick, downsampled in the database, drawn on the pages."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.dashboard import data
from apps.inventory import history
from apps.inventory.models import FleetSample, Node
from apps.jobs.models import Learner


@pytest.mark.django_db
def test_sample_matches_the_fleet_table(alice, job_factory, fleet):
    job = job_factory(alice, learners=3, pools=[fleet["h100-east"]])  # tokens/s 1000, 2000, 3000
    node = Node.objects.get(worker_name="h100-east@node1")
    Learner.objects.filter(job=job).update(node=node)
    Learner.objects.filter(job=job, index=2).update(state=Learner.State.LOST)
    history.sample_fleet()
    s = FleetSample.objects.get(pool=fleet["h100-east"], node=None)
    row = data.pool_rows([fleet["h100-east"]])[0]
    assert (s.busy, s.devices) == (2, 8) and s.utilisation == pytest.approx(row["utilisation"]) == 0.25
    assert s.tokens_per_s == pytest.approx(row["tokens_per_s"]) == 3000
    assert s.watts == pytest.approx(row["watts"]) == pytest.approx(700 * (2 + 0.15 * 6))
    n = FleetSample.objects.get(node=node)
    assert (n.busy, n.tokens_per_s) == (2, 3000)
    idle = FleetSample.objects.get(pool=fleet["v100-lab"], node=None)
    assert idle.busy == 0 and idle.watts == pytest.approx(300 * 0.15 * 4)
    # one sample per pool and per live node
    assert FleetSample.objects.count() == 3 + Node.objects.filter(state="online").count()


@pytest.mark.django_db
def test_history_is_downsampled_in_time_buckets(fleet):
    pool, now = fleet["a100-west"], timezone.now()
    FleetSample.objects.bulk_create([
        FleetSample(pool=pool, time=now - timedelta(seconds=3600 - 3 * i), devices=8, busy=i % 9,
                    utilisation=(i % 9) / 8, tokens_per_s=100.0 * i, watts=400.0 + i) for i in range(1200)])
    FleetSample.objects.create(pool=pool, time=now - timedelta(days=2), utilisation=1.0)  # outside the range
    out = data.fleet_history(now - timedelta(hours=1), 60, pool_id=pool.pk)
    assert set(out) == {"utilisation", "tokens_per_s", "watts"}
    pts = out["tokens_per_s"]
    assert 55 <= len(pts) <= 61  # about one point per minute
    times = [t for t, _ in pts]
    assert times == sorted(times) and times[0] >= (now - timedelta(hours=1)).timestamp()
    # each bucket is the mean of its samples: the series rises like the samples do
    assert pts[0][1] < 2000 and pts[-1][1] > 100_000
    assert sum(v for _, v in pts) / len(pts) == pytest.approx(100.0 * 599.5, rel=0.05)
    assert max(v for _, v in out["utilisation"]) < 1.0  # the 2-day-old sample is not in it
    assert data.fleet_history(now - timedelta(hours=1), 60, node_id=12345)["watts"] == []


@pytest.mark.django_db
def test_pool_and_node_pages_draw_the_history(client, alice, fleet):
    pool = fleet["h100-east"]
    node = Node.objects.get(worker_name="h100-east@node1")
    history.sample_fleet()
    client.force_login(alice)
    body = client.get("/fleet/h100-east/").content.decode()
    assert 'id="chart-utilisation"' in body and 'id="history-data"' in body and "history.js" in body
    assert f'href="/fleet/h100-east/nodes/{node.pk}/"' in body
    body = client.get(f"/fleet/h100-east/nodes/{node.pk}/?range=24h").content.decode()
    assert 'id="chart-watts"' in body and "h100-east@node1" in body and 'aria-current="true">24h' in body
    got = client.get(f"/fleet/h100-east/nodes/{node.pk}/history.json?range=1h").json()
    assert len(got["utilisation"]) == 1 and got["watts"][0][1] == pytest.approx(700 * 0.15 * 8)
    got = client.get("/fleet/h100-east/history.json").json()
    assert len(got["tokens_per_s"]) == 1
    # bad input: 400 naming the field; a node of another pool: 404
    resp = client.get("/fleet/h100-east/?range=2y")
    assert resp.status_code == 400 and b"range" in resp.content
    assert client.get("/fleet/h100-east/history.json?range=x").status_code == 400
    assert client.get(f"/fleet/a100-west/nodes/{node.pk}/").status_code == 404
    assert pool.samples.count() == 2  # the pool's own sample and its node's


@pytest.mark.django_db
def test_old_samples_are_forgotten(fleet, settings):
    settings.FLEET_SAMPLE_RETENTION_DAYS = 7
    pool, now = fleet["v100-lab"], timezone.now()
    FleetSample.objects.create(pool=pool, time=now - timedelta(days=8))
    FleetSample.objects.create(pool=pool, time=now - timedelta(days=6))
    assert history.forget_old() == 1 and FleetSample.objects.count() == 1
