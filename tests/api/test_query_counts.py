"""Query budgets of the job list, job detail and metrics endpoints (issue 19): a fixed number of
SQL queries however many jobs, learners, shards and metric rows there are (no N+1)."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from apps.coordinator.models import SyncerLease
from apps.inventory.models import Node
from apps.jobs.models import Job, Learner, MetricPoint

from .conftest import client_for, make_job

pytestmark = pytest.mark.django_db

# token + user + the user's teams (one statement: apps.api.models), then the endpoint's own queries
LIST_QUERIES = 3  # + COUNT(*), the page (owner's username joined, learners' tokens as a subquery)
DETAIL_QUERIES = 5  # + the job, its learners per state, latest values, syncer shards
METRICS_QUERIES = 3  # + the job, the downsampled series (learner index joined)


@pytest.fixture
def fleet_of_jobs(alice, bob, pool_a):
    """Alice's jobs, half of them shared with her team; learners on a node; metrics per learner."""
    team = Group.objects.create(name="ml")
    alice.groups.add(team)
    bob.groups.add(team)
    node = Node.objects.create(pool=pool_a, hostname="h1", worker_name="w1@h1")
    jobs = []
    for i in range(12):
        job = make_job(alice, pool=pool_a, learners=4, syncer_shards=2, fragments=4)
        if i % 2:
            Job.objects.filter(pk=job.pk).update(team="ml")
        Learner.objects.filter(job=job).update(node=node, tokens=100)
        for shard in range(2):
            SyncerLease.objects.create(job=job, shard=shard, worker="c@h", commits=3)
        learners = list(Learner.objects.filter(job=job))
        MetricPoint.objects.bulk_create(
            [MetricPoint(job=job, learner=lr, name=name, step=s, value=1.0 / (1 + s))
             for lr in learners for name in ("train_loss", "tokens_per_s") for s in range(0, 400, 10)]
            + [MetricPoint(job=job, name="val_loss", step=s, value=2.0) for s in range(0, 400, 40)])
        jobs.append(job)
    return jobs


def _warm(client, path: str) -> dict:
    r = client.get(path)  # the first request of a token also stamps its last use (one UPDATE)
    assert r.status_code == 200, r.content
    return r.json()


def test_job_list_queries_do_not_grow_with_the_jobs(alice, bob, fleet_of_jobs, django_assert_max_num_queries):
    for user, expect in ((alice, 12), (bob, 6)):  # bob sees his team's jobs through the same queries
        c = client_for(user)
        _warm(c, "/api/v1/jobs/?limit=50")
        with django_assert_max_num_queries(LIST_QUERIES):
            body = c.get("/api/v1/jobs/?limit=50").json()
        assert body["count"] == expect and len(body["results"]) == expect
        assert {j["tokens_done"] for j in body["results"]} == {400}
        assert {j["owner"] for j in body["results"]} == {"alice"}


def test_job_detail_queries_do_not_grow_with_learners_or_shards(alice, fleet_of_jobs,
                                                                django_assert_max_num_queries):
    c = client_for(alice)
    job = fleet_of_jobs[0]
    _warm(c, f"/api/v1/jobs/{job.pk}/")
    with django_assert_max_num_queries(DETAIL_QUERIES):
        body = c.get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["learner_counts"] == {"running": 4}
    assert [s["shard"] for s in body["syncer"]] == [0, 1] and body["syncer"][1]["fragments"] == [1, 3]
    assert set(body["latest"]) == {"train_loss", "tokens_per_s", "val_loss"}
    assert body["tokens_done"] == 400


def test_learner_counts_by_state(alice, alice_job):
    Learner.objects.filter(job=alice_job, index=1).update(state=Learner.State.LOST)
    body = client_for(alice).get(f"/api/v1/jobs/{alice_job.pk}/").json()
    assert body["learner_counts"] == {"running": 1, "lost": 1}


def test_metrics_queries_do_not_grow_with_the_series(alice, fleet_of_jobs, django_assert_max_num_queries):
    c = client_for(alice)
    job = fleet_of_jobs[3]
    _warm(c, f"/api/v1/jobs/{job.pk}/metrics/?points=20")
    with django_assert_max_num_queries(METRICS_QUERIES):
        body = c.get(f"/api/v1/jobs/{job.pk}/metrics/?points=20").json()
    keys = {(s["name"], s["learner"]) for s in body["series"]}
    assert keys == {("val_loss", None)} | {(n, i) for n in ("train_loss", "tokens_per_s") for i in range(4)}
    assert all(len(s["points"]) <= 20 for s in body["series"])
    with django_assert_max_num_queries(METRICS_QUERIES):
        one = c.get(f"/api/v1/jobs/{job.pk}/metrics/?learner=2&name=train_loss").json()
    assert [(s["name"], s["learner"]) for s in one["series"]] == [("train_loss", 2)]
    step, value, t = one["series"][0]["points"][-1]
    assert step == 390 and value == pytest.approx(1 / 391) and t > 1.7e9  # Unix seconds
