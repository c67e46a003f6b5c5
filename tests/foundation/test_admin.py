"""The admin is usable by an operator and closed to everybody else."""
from __future__ import annotations

import pytest
from django.contrib import admin
from django.urls import reverse
from django.utils import timezone

from apps.coordinator.models import LearnerRuntime, SyncerLease
from apps.inventory.models import Node, Pool, PoolToken
from apps.jobs import state as st
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner, MetricPoint, OuterStep

pytestmark = pytest.mark.django_db

OUR_MODELS = [
    "inventory.acceleratortype", "inventory.pool", "inventory.node", "inventory.pooltoken",
    "jobs.job", "jobs.learner", "jobs.outerstep", "jobs.event", "jobs.incident", "jobs.checkpoint",
    "jobs.metricpoint", "coordinator.syncerlease", "coordinator.learnerruntime",
]


@pytest.fixture
def records(fleet, alice):
    job = Job.objects.create(owner=alice, name="demo run", spec={"name": "demo run", "learners": 2},
                             tokens_computed=1000, tokens_contributed=880)
    pool = fleet["h100"]
    node = pool.nodes.first()
    lr = Learner.objects.create(job=job, index=0, pool=pool, node=node, state="running", tokens=500)
    OuterStep.objects.create(job=job, fragment=0, version=1, merged_norm=0.5,
                             contributors=[{"learner": 0, "weight": 1.0}])
    MetricPoint.objects.create(job=job, learner=lr, step=10, name="loss", value=3.2)
    Event.objects.create(job=job, pool=pool, kind="placed", message="learner 0 on iad-h100")
    Incident.objects.create(job=job, learner=lr, pool=pool, failed_at=timezone.now())
    Checkpoint.objects.create(job=job, version=1, blob_uri="file:///x", size_bytes=10, sha256="ab" * 32)
    PoolToken.issue(pool)
    SyncerLease.objects.create(job=job, shard=0, epoch=2, worker="coordinator@h", commits=7)
    SyncerLease.objects.create(job=job, shard=1, epoch=1, worker="coordinator-1@h", commits=6)
    LearnerRuntime.objects.create(learner=lr, worker="iad-h100@h1", resume_point={"tokens": 0})
    return {"job": job, "learner": lr}


def test_every_model_is_registered():
    registered = {f"{m._meta.app_label}.{m._meta.model_name}" for m in admin.site._registry}
    assert set(OUR_MODELS) <= registered


@pytest.mark.parametrize("model", OUR_MODELS)
def test_changelist_and_change_pages_render_for_staff(client, staff_user, records, model):
    client.force_login(staff_user)
    app, name = model.split(".")
    resp = client.get(reverse(f"admin:{app}_{name}_changelist"))
    assert resp.status_code == 200, resp.content[:500]
    from django.apps import apps

    obj = apps.get_model(app, name).objects.first()
    assert obj is not None
    resp = client.get(reverse(f"admin:{app}_{name}_change", args=[obj.pk]))
    assert resp.status_code == 200


@pytest.mark.parametrize("model", OUR_MODELS)
def test_admin_refuses_non_staff(client, alice, model):
    client.force_login(alice)
    app, name = model.split(".")
    resp = client.get(reverse(f"admin:{app}_{name}_changelist"))
    assert resp.status_code == 302 and "/admin/login/" in resp["Location"]


def test_admin_refuses_anonymous(client):
    resp = client.get(reverse("admin:inventory_pool_changelist"))
    assert resp.status_code == 302


def test_pool_list_shows_derived_figures_and_filters(client, staff_user, fleet):
    client.force_login(staff_user)
    url = reverse("admin:inventory_pool_changelist")
    body = client.get(url).content.decode()
    assert "7,912.0" in body  # 8 x 989 TFLOP/s
    assert "5,600" in body  # 8 x 700 W
    assert "36.00" in body  # 8 x 4.50 per hour
    for q in ("state__exact=draining", "provider__exact=gcp", "region=eu-west",
              "accelerator__generation=v5e"):
        body = client.get(f"{url}?{q}").content.decode()
        assert "ams-v5e" in body and "iad-h100" not in body, q
    body = client.get(f"{url}?q=IAD").content.decode()
    assert "iad-h100" in body and "ams-v5e" not in body


def test_pool_page_has_node_inline(client, staff_user, fleet):
    client.force_login(staff_user)
    body = client.get(reverse("admin:inventory_pool_change", args=[fleet["h100"].pk])).content.decode()
    assert "iad-h100@h1" in body and "iad-h100@h2" in body
    assert "7,912.0" in body


@pytest.mark.parametrize(("action", "state"), [("drain", "draining"), ("disable", "disabled"),
                                               ("activate", "active")])
def test_pool_actions(client, staff_user, fleet, action, state):
    client.force_login(staff_user)
    pks = [p.pk for p in fleet.values()]
    resp = client.post(reverse("admin:inventory_pool_changelist"),
                       {"action": action, "_selected_action": pks}, follow=True)
    assert resp.status_code == 200
    assert set(Pool.objects.values_list("state", flat=True)) == {state}


@pytest.mark.parametrize(("action", "state"), [("drain", "draining"), ("disable", "offline"),
                                               ("activate", "online")])
def test_node_actions(client, staff_user, fleet, action, state):
    client.force_login(staff_user)
    pks = list(Node.objects.values_list("pk", flat=True))
    client.post(reverse("admin:inventory_node_changelist"), {"action": action, "_selected_action": pks})
    assert set(Node.objects.values_list("state", flat=True)) == {state}


def test_node_filters(client, staff_user, fleet):
    client.force_login(staff_user)
    url = reverse("admin:inventory_node_changelist")
    body = client.get(f"{url}?state__exact=lost").content.decode()
    assert "iad-h100@h2" in body and "iad-h100@h1" not in body
    an_hour_ago = timezone.now() - timezone.timedelta(hours=1)
    Node.objects.filter(worker_name="iad-h100@h1").update(last_seen=an_hour_ago)
    body = client.get(f"{url}?heartbeat=stale").content.decode()
    assert "iad-h100@h1" in body


def test_issue_token_action_shows_secret_once(client, staff_user, fleet):
    client.force_login(staff_user)
    pool = fleet["h100"]
    resp = client.post(reverse("admin:inventory_pool_changelist"),
                       {"action": "issue_token", "_selected_action": [pool.pk]}, follow=True)
    msgs = [str(m) for m in resp.context["messages"]]
    raw = next(m for m in msgs if "DILOCO_POOL_TOKEN=" in m).split("DILOCO_POOL_TOKEN=")[1].split()[0]
    assert PoolToken.authenticate(raw) == pool
    tok = PoolToken.objects.get(pool=pool)
    client.post(reverse("admin:inventory_pooltoken_changelist"),
                {"action": "revoke", "_selected_action": [tok.pk]})
    assert PoolToken.authenticate(raw) is None


def test_runtime_records_are_read_only(client, staff_user, records):
    client.force_login(staff_user)
    lr = records["learner"]
    resp = client.post(reverse("admin:jobs_learner_change", args=[lr.pk]), {"state": "done"})
    assert resp.status_code == 403
    assert client.get(reverse("admin:jobs_event_add")).status_code == 403
    assert client.get(reverse("admin:jobs_job_add")).status_code == 403


def test_job_actions_go_through_the_state_machine(client, staff_user, records):
    client.force_login(staff_user)
    job = records["job"]
    url = reverse("admin:jobs_job_changelist")
    resp = client.post(url, {"action": "pause", "_selected_action": [job.pk]}, follow=True)
    job.refresh_from_db()
    assert job.status == st.QUEUED  # queued -> pausing is illegal
    assert any("Cannot pause a queued job" in str(m) for m in resp.context["messages"])  # the API's rule
    client.post(url, {"action": "cancel", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.status == st.CANCELLED and "olga" in job.status_reason


def test_job_page_shows_goodput_learners_and_syncer_shards(client, staff_user, records):
    client.force_login(staff_user)
    body = client.get(reverse("admin:jobs_job_change", args=[records["job"].pk])).content.decode()
    assert "88.0%" in body and "iad-h100" in body
    assert "coordinator@h" in body and "coordinator-1@h" in body  # one row per syncer shard
