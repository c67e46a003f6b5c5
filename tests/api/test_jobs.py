"""Jobs: submit (idempotent), list/filter, retrieve, actions, dry run; the permission matrix."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from apps.jobs.models import Event, Job

from .conftest import client_for, make_job

pytestmark = pytest.mark.django_db

SPEC = {"name": "ci run", "learners": 2, "steps": 20, "inner_steps": 5}


def test_submit_creates_a_queued_job(as_alice, alice):
    alice.groups.add(Group.objects.create(name="ml"))
    r = as_alice.post("/api/v1/jobs/", {"spec": SPEC, "team": "ml"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    job = Job.objects.get(pk=body["id"])
    assert job.owner == alice and job.status == "queued" and job.team == "ml"
    assert body["spec"]["quorum"] == 1  # defaults filled in by the one spec schema
    assert body["total_tokens"] == 2 * 20 * 16 * 64 and body["progress"] == 0.0
    assert r.headers["Location"].endswith(f"/api/v1/jobs/{job.pk}/")
    assert Event.objects.filter(job=job, message="submitted").exists()


def test_idempotency_key(as_alice, as_bob):
    h = {"HTTP_IDEMPOTENCY_KEY": "ci-build-4711"}
    r1 = as_alice.post("/api/v1/jobs/", {"spec": SPEC}, format="json", **h)
    r2 = as_alice.post("/api/v1/jobs/", {"spec": SPEC}, format="json", **h)
    assert (r1.status_code, r2.status_code) == (201, 200)
    assert r1.json()["id"] == r2.json()["id"] and r2.headers["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1
    # the key is per owner
    r3 = as_bob.post("/api/v1/jobs/", {"spec": SPEC}, format="json", **h)
    assert r3.status_code == 201 and r3.json()["id"] != r1.json()["id"]
    # the same key with another spec is a conflict, not a silent replay
    r4 = as_alice.post("/api/v1/jobs/", {"spec": {**SPEC, "steps": 21}}, format="json", **h)
    assert r4.status_code == 409 and "ci-build-4711" in r4.json()["detail"]
    bad = as_alice.post("/api/v1/jobs/", {"spec": SPEC}, format="json", HTTP_IDEMPOTENCY_KEY="has space")
    assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["errors"]


def test_invalid_spec_names_field_paths(as_alice):
    r = as_alice.post("/api/v1/jobs/", {"spec": {**SPEC, "learners": 0, "compression": "zip",
                                                 "dataset": "/etc/passwd", "bogus": 1}}, format="json")
    assert r.status_code == 400
    errors = r.json()["errors"]
    assert set(errors) == {"spec.learners", "spec.compression", "spec.bogus"}
    assert r.json()["detail"].startswith("Invalid job spec")
    r = as_alice.post("/api/v1/jobs/", {"spec": {**SPEC, "dataset": "/etc/passwd"}}, format="json")
    assert r.status_code == 400 and "data root" in r.json()["errors"]["spec.dataset"][0]
    r = as_alice.post("/api/v1/jobs/", {"spec": {**SPEC, "learners": 2, "quorum": 3}}, format="json")
    assert r.status_code == 400 and list(r.json()["errors"]) == ["spec.quorum"]
    # a proximal pull past the adopted global (inner_lr * inner_prox > 1) names the pull
    r = as_alice.post("/api/v1/jobs/", {"spec": {**SPEC, "inner_lr": 0.01, "inner_prox": 200}}, format="json")
    assert r.status_code == 400 and list(r.json()["errors"]) == ["spec.inner_prox"], r.content
    assert Job.objects.count() == 0


def test_submit_body_shape(as_alice):
    assert as_alice.post("/api/v1/jobs/", SPEC, format="json").json()["errors"]["spec"] == [
        "This field is required."]
    r = as_alice.post("/api/v1/jobs/", {"spec": [1, 2]}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"spec": ["The spec must be a JSON object."]}


def test_job_creation_is_rate_limited(as_alice, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                               "DEFAULT_THROTTLE_RATES": {"auth": "100/minute", "job_create": "2/minute"}}
    codes = [as_alice.post("/api/v1/jobs/", {"spec": SPEC}, format="json").status_code for _ in range(3)]
    assert codes == [201, 201, 429]
    assert as_alice.get("/api/v1/jobs/").status_code == 200  # reading is not limited


def test_permission_matrix(alice, bob, staff_user, alice_job, anon, token_a):
    cases = {"alice": client_for(alice), "bob": client_for(bob), "staff": client_for(staff_user),
             "anon": anon, "worker": client_for(token=token_a)}
    expect = {"alice": 200, "bob": 404, "staff": 200, "anon": 401, "worker": 401}
    base = f"/api/v1/jobs/{alice_job.pk}/"
    for who, c in cases.items():
        for sub in ("", "learners/", "metrics/", "events/", "incidents/", "checkpoints/"):
            assert c.get(base + sub).status_code == expect[who], (who, sub)
        listed = c.get("/api/v1/jobs/")
        if expect[who] == 401:
            assert listed.status_code == 401
        else:
            ids = [j["id"] for j in listed.json()["results"]]
            assert (alice_job.pk in ids) == (who != "bob"), who
    # acting: bob gets 404 and nothing changes; staff may act on anyone's job
    assert cases["bob"].post(base + "cancel/").status_code == 404
    assert cases["worker"].post(base + "cancel/").status_code == 401
    assert Job.objects.get(pk=alice_job.pk).status == "running"
    assert cases["staff"].post(base + "pause/").json()["status"] == "pausing"


def test_actions_follow_the_state_machine(as_alice, alice, pool_a):
    job = make_job(alice, pool=pool_a)
    assert as_alice.post(f"/api/v1/jobs/{job.pk}/resume/").status_code == 409
    r = as_alice.post(f"/api/v1/jobs/{job.pk}/pause/")
    assert r.status_code == 200 and r.json()["status"] == "pausing"
    Job.objects.filter(pk=job.pk).update(status="paused")
    assert as_alice.post(f"/api/v1/jobs/{job.pk}/resume/").json()["status"] == "placing"
    r = as_alice.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    r = as_alice.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 409 and "terminal" in r.json()["errors"]["status"][0]


def test_list_filters_and_pagination(as_alice, as_staff, alice, bob, pool_a):
    make_job(alice, status="running", name="alpha run")
    make_job(alice, status="completed", name="beta run")
    make_job(alice, status="failed", name="gamma")
    make_job(bob, status="running", name="bobs")
    names = lambda r: sorted(j["name"] for j in r.json()["results"])  # noqa: E731
    assert names(as_alice.get("/api/v1/jobs/")) == ["alpha run", "beta run", "gamma"]
    assert names(as_alice.get("/api/v1/jobs/?status=running")) == ["alpha run"]
    assert names(as_alice.get("/api/v1/jobs/?status=completed,failed")) == ["beta run", "gamma"]
    assert names(as_alice.get("/api/v1/jobs/?status=completed&status=failed")) == ["beta run", "gamma"]
    assert names(as_alice.get("/api/v1/jobs/?search=RUN")) == ["alpha run", "beta run"]
    assert names(as_staff.get("/api/v1/jobs/?owner=bob")) == ["bobs"]
    r = as_alice.get("/api/v1/jobs/?status=exploded")
    assert r.status_code == 400 and "status" in r.json()["errors"]
    page = as_alice.get("/api/v1/jobs/?limit=2&offset=1").json()
    assert page["count"] == 3 and len(page["results"]) == 2 and page["previous"]


def test_detail_has_latest_values_and_learner_counts(as_alice, alice_job):
    from apps.jobs.models import Learner, MetricPoint

    l0, l1 = Learner.objects.filter(job=alice_job).order_by("index")
    MetricPoint.objects.create(job=alice_job, name="val_loss", step=10, value=3.0)
    MetricPoint.objects.create(job=alice_job, name="val_loss", step=20, value=2.5)
    # per-learner series: the newest value of each learner, averaged
    MetricPoint.objects.create(job=alice_job, learner=l0, name="train_loss", step=5, value=9.0)
    MetricPoint.objects.create(job=alice_job, learner=l0, name="train_loss", step=15, value=2.0)
    MetricPoint.objects.create(job=alice_job, learner=l1, name="train_loss", step=15, value=3.0)
    Learner.objects.filter(pk=l0.pk).update(tokens=1000)
    Learner.objects.filter(pk=l1.pk).update(tokens=2000)
    body = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/").json()
    assert body["latest"] == {"train_loss": 2.5, "val_loss": 2.5}
    assert body["learner_counts"] == {"running": 2}
    assert body["syncer"] == []  # no syncer started yet
    assert body["tokens_done"] == 3000 and body["tokens_computed"] == 0  # live, from the learners
    assert body["progress"] == round(3000 / body["total_tokens"], 4)
    listed = as_alice.get("/api/v1/jobs/").json()["results"]
    assert [j["tokens_done"] for j in listed if j["id"] == alice_job.pk] == [3000]
    assert body["owner"] == "alice"


def test_dry_run_previews_placement(as_alice, pool_a, pool_b):
    r = as_alice.post("/api/v1/jobs/dry-run/", {"spec": {**SPEC, "learners": 3}}, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["valid"] is True and body["spec"]["learners"] == 3
    plan = body["placement"]
    assert plan["feasible"] is True, plan["problems"]
    assert len(plan["learners"]) == 3
    assert {p["slug"] for p in plan["pools"]} == {"pool-a", "pool-b"}
    assert set(plan["work_sizes"]) <= {"pool-a", "pool-b"}
    est = plan["estimate"]
    assert est["time_s"] > 0 and est["energy_j"] > 0 and est["cost"] > 0
    assert Job.objects.count() == 0  # nothing is created


def test_dry_run_reports_what_does_not_fit(as_alice, pool_a):
    r = as_alice.post("/api/v1/jobs/dry-run/", {"spec": {**SPEC, "learners": 9, "quorum": 1}}, format="json")
    assert r.status_code == 200
    plan = r.json()["placement"]
    assert plan["feasible"] is False and plan["problems"]
    r = as_alice.post("/api/v1/jobs/dry-run/", {"spec": {**SPEC, "pools": ["nowhere"]}}, format="json")
    assert r.json()["placement"]["problems"][0] == "pool 'nowhere' does not exist"
    r = as_alice.post("/api/v1/jobs/dry-run/", {"spec": {**SPEC, "steps": -5}}, format="json")
    assert r.status_code == 400 and "spec.steps" in r.json()["errors"]


def test_detail_lists_the_syncer_shards(as_alice, alice_job):
    from apps.coordinator.models import SyncerLease

    alice_job.spec = {**alice_job.spec, "fragments": 4, "syncer_shards": 2}
    alice_job.save(update_fields=["spec"])
    SyncerLease.objects.create(job=alice_job, shard=1, epoch=2, worker="coordinator-1@h", commits=5,
                               restarts=1)
    SyncerLease.objects.create(job=alice_job, shard=0, epoch=1, worker="", commits=6, finished=True)
    body = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/").json()
    rows = [(s["shard"], s["fragments"], s["commits"], s["running"], s["restarts"]) for s in body["syncer"]]
    assert rows == [(0, [0, 2], 6, False, 0), (1, [1, 3], 5, True, 1)]
