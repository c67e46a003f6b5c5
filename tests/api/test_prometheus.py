"""GET /metrics: scraped, parsed with the Prometheus client's own parser, checked against the database."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from apps.inventory.models import Node
from apps.jobs.models import Incident, Job, Learner

from .conftest import make_job

TOKEN = "scrape-me-0123456789"
AUTH = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}


def scrape(client: Client, **headers) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    resp = client.get("/metrics", **headers)
    assert resp.status_code == 200, resp.content
    assert resp["Content-Type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(resp.content.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def fleet(alice, bob, pool_a, pool_b):
    """Jobs, learners, nodes and incidents in several states."""
    now = timezone.now()
    running = make_job(alice, status="running", pool=pool_a, learners=3)
    running.outer_steps, running.tokens_computed, running.tokens_contributed = 7, 1000, 900
    running.tokens_lost = 40
    running.save()
    Learner.objects.filter(job=running).update(tokens_per_s=50.0, last_heartbeat=now - timedelta(seconds=2))
    Learner.objects.filter(job=running, index=2).update(state=Learner.State.LOST, pool=pool_b)
    paused = make_job(bob, status="paused", pool=pool_b, learners=1)
    Learner.objects.filter(job=paused).update(state=Learner.State.STOPPED)
    done = make_job(alice, status="completed", learners=2)
    Job.objects.filter(pk=done.pk).update(outer_steps=20, tokens_computed=5000, tokens_contributed=4800)
    Learner.objects.filter(job=done).update(state=Learner.State.DONE)
    for _ in range(2):
        queued = make_job(bob, status="queued", learners=1)
        Learner.objects.filter(job=queued).update(state=Learner.State.PENDING)
    for worker, state in (("a1@h", "online"), ("a2@h", "lost"), ("a3@h", "online")):
        Node.objects.create(pool=pool_a, hostname="h", worker_name=worker, state=state)
    Node.objects.create(pool=pool_b, hostname="g", worker_name="b1@g", state="offline",
                        last_seen=now - timedelta(days=3), purged_at=now - timedelta(days=1))
    t0 = now - timedelta(minutes=10)
    for heal_s in (3.0, 12.0, 45.0):
        Incident.objects.create(job=running, pool=pool_a, kind="learner_lost", failed_at=t0,
                                detected_at=t0 + timedelta(seconds=2),
                                healed_at=t0 + timedelta(seconds=2 + heal_s))
    Incident.objects.create(job=running, pool=pool_b, kind="learner_lost", failed_at=t0, detected_at=t0)
    Incident.objects.create(job=running, kind="syncer_lost", failed_at=t0, detected_at=t0,
                            healed_at=t0 + timedelta(seconds=1.5))
    return {"running": running, "paused": paused, "done": done}


@pytest.mark.django_db
def test_scrape_matches_the_database(settings, fleet, pool_a, pool_b):
    settings.METRICS_TOKEN = TOKEN
    m = scrape(Client(), **AUTH)
    job = fleet["running"]
    # jobs and learners by state: every state listed, the counts of the database
    for status in ("queued", "placing", "running", "paused", "completed", "failed", "cancelled"):
        assert m[("diloco_jobs", (("state", status),))] == Job.objects.filter(status=status).count()
    assert m[("diloco_jobs", (("state", "queued"),))] == 2
    for state in Learner.State.values:
        assert m[("diloco_learners", (("state", state),))] == Learner.objects.filter(state=state).count()
    assert m[("diloco_learners", (("state", "running"),))] == 2
    assert m[("diloco_learners", (("state", "lost"),))] == 1
    # totals over all jobs
    assert m[("diloco_outer_steps_total", ())] == 27
    assert m[("diloco_tokens_total", (("kind", "computed"),))] == 6000
    assert m[("diloco_tokens_total", (("kind", "contributed"),))] == 5700
    assert m[("diloco_tokens_total", (("kind", "lost"),))] == 40
    # per active job (the running one; not the paused, completed or queued ones)
    lv = (("job", str(job.pk)), ("name", job.name))
    assert m[("diloco_job_outer_steps", lv)] == 7
    assert m[("diloco_job_tokens_computed", lv)] == 1000
    assert m[("diloco_job_goodput_ratio", lv)] == pytest.approx(0.9)
    assert 1.5 < m[("diloco_telemetry_lag_seconds", lv)] < 60
    assert not [k for k in m if k[0] == "diloco_job_goodput_ratio" and k[1] != lv]
    # incidents: open, healed, time to heal
    ll, sl = (("kind", "learner_lost"),), (("kind", "syncer_lost"),)
    assert m[("diloco_incidents_total", ll)] == 4 and m[("diloco_incidents_total", sl)] == 1
    assert m[("diloco_incidents_open", ll)] == 1 and m[("diloco_incidents_open", sl)] == 0
    assert m[("diloco_incidents_healed_total", ll)] == 3
    assert m[("diloco_incident_time_to_heal_seconds_count", ll)] == 3
    assert m[("diloco_incident_time_to_heal_seconds_sum", ll)] == pytest.approx(60.0)
    assert m[("diloco_incident_time_to_heal_seconds_bucket", (("kind", "learner_lost"), ("le", "5.0")))] == 1
    assert m[("diloco_incident_time_to_heal_seconds_bucket", (("kind", "learner_lost"), ("le", "30.0")))] == 2
    assert m[("diloco_incident_time_to_heal_seconds_bucket", (("kind", "learner_lost"), ("le", "+Inf")))] == 3
    assert m[("diloco_incident_time_to_heal_seconds_sum", sl)] == pytest.approx(1.5)
    # pools: utilisation of the running learners, their tokens/s, the power estimate
    a, b = (("pool", "pool-a"),), (("pool", "pool-b"),)
    assert m[("diloco_pool_busy_devices", a)] == 2 and m[("diloco_pool_devices", a)] == 4
    assert m[("diloco_pool_utilisation_ratio", a)] == pytest.approx(0.5)
    assert m[("diloco_pool_utilisation_ratio", b)] == 0
    assert m[("diloco_pool_tokens_per_second", a)] == pytest.approx(100.0)
    assert m[("diloco_pool_power_watts", a)] == pytest.approx(200 * (2 + 0.15 * 2))
    # nodes by state; the purged one is left out
    assert m[("diloco_nodes", (("pool", "pool-a"), ("state", "online")))] == 2
    assert m[("diloco_nodes", (("pool", "pool-a"), ("state", "lost")))] == 1
    assert not [k for k in m if k[0] == "diloco_nodes" and ("pool", "pool-b") in k[1]]


@pytest.mark.django_db
def test_figures_follow_the_database_between_scrapes(settings, fleet):
    """Nothing is counted in the process: a change in the database shows on the next scrape."""
    settings.METRICS_TOKEN = TOKEN
    c = Client()
    before = scrape(c, **AUTH)
    Incident.objects.filter(healed_at__isnull=True).update(healed_at=timezone.now())
    fleet["running"].transition("completed", "test")
    after = scrape(c, **AUTH)
    ll = (("kind", "learner_lost"),)
    assert before[("diloco_incidents_open", ll)] == 1 and after[("diloco_incidents_open", ll)] == 0
    done = ("diloco_jobs", (("state", "completed"),))
    assert after[done] == before[done] + 1
    assert not [k for k in after if k[0] == "diloco_job_outer_steps"]


@pytest.mark.django_db
def test_off_by_default(settings):
    settings.METRICS_TOKEN, settings.METRICS_ALLOWED_NETWORKS = "", []
    resp = Client().get("/metrics")
    assert resp.status_code == 403 and b"metrics are off" in resp.content


@pytest.mark.django_db
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
def test_token_refused(settings, header):
    settings.METRICS_TOKEN, settings.METRICS_ALLOWED_NETWORKS = TOKEN, []
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    resp = Client().get("/metrics", **extra)
    assert resp.status_code == 401 and resp["WWW-Authenticate"].startswith("Bearer")
    assert b"diloco_" not in resp.content


@pytest.mark.django_db
def test_networks(settings):
    settings.METRICS_TOKEN, settings.METRICS_ALLOWED_NETWORKS = "", ["10.0.0.0/8"]
    assert Client(REMOTE_ADDR="192.168.1.5").get("/metrics").status_code == 403
    assert Client(REMOTE_ADDR="not-an-address").get("/metrics").status_code == 403
    assert Client(REMOTE_ADDR="10.1.2.3").get("/metrics").status_code == 200
    # both set: both must pass
    settings.METRICS_TOKEN = TOKEN
    assert Client(REMOTE_ADDR="10.1.2.3").get("/metrics").status_code == 401
    assert Client(REMOTE_ADDR="192.168.1.5").get("/metrics", **AUTH).status_code == 403
    assert Client(REMOTE_ADDR="10.1.2.3").get("/metrics", **AUTH).status_code == 200


@pytest.mark.django_db
def test_only_get(settings):
    settings.METRICS_TOKEN = TOKEN
    assert Client().post("/metrics", **AUTH).status_code == 405


@pytest.mark.django_db
def test_sample_grafana_dashboard_uses_only_exported_metrics(settings, fleet):
    """docker/grafana-dashboard.json queries series that a scrape really has."""
    import json
    import re
    from pathlib import Path

    settings.METRICS_TOKEN = TOKEN
    exported = {name for name, _ in scrape(Client(), **AUTH)}
    dash = json.loads((Path(__file__).resolve().parents[2] / "docker" / "grafana-dashboard.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"diloco_[a-z_]+", t["expr"])}
    assert len(used) >= 12
    assert used <= exported, used - exported
