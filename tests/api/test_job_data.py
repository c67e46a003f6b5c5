"""What a job produced: learners, metrics (downsampled in SQL), events, incidents, checkpoints."""
from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs.models import Checkpoint, Event, Incident, Learner, MetricPoint

from .conftest import make_job

pytestmark = pytest.mark.django_db


def test_learners(as_alice, alice_job):
    rows = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/learners/").json()
    assert [(r["index"], r["pool"], r["state"]) for r in rows] == [(0, "pool-a", "running"),
                                                                    (1, "pool-a", "running")]


def _points(job, n, name="train_loss", learner=None):
    t0 = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, learner=learner, name=name, step=i * 100, value=float(i),
                    time=t0 + timedelta(seconds=i)) for i in range(n))


def test_metrics_are_downsampled_by_bucket_average(as_alice, alice_job):
    _points(alice_job, 1000)
    _points(alice_job, 10, name="val_loss")
    r = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/metrics/?points=100&learner=job")
    assert r.status_code == 200, r.content
    series = {s["name"]: s for s in r.json()["series"]}
    train = series["train_loss"]["points"]
    assert len(train) == 100  # 1000 points -> 100 buckets of 10
    assert train[0][:2] == [450.0, 4.5]  # mean step and mean value of points 0..9
    assert train[-1][:2] == [99450.0, 994.5]
    assert [p[1] for p in train] == sorted(p[1] for p in train)
    assert len(series["val_loss"]["points"]) == 10  # short series come back raw
    assert series["val_loss"]["learner"] is None


def test_metrics_filters(as_alice, alice_job):
    l0 = Learner.objects.get(job=alice_job, index=0)
    _points(alice_job, 50)
    _points(alice_job, 30, learner=l0)
    _points(alice_job, 20, name="tokens_per_s", learner=l0)
    url = f"/api/v1/jobs/{alice_job.pk}/metrics/"
    every = as_alice.get(url).json()["series"]
    assert {(s["name"], s["learner"]) for s in every} == {("train_loss", None), ("train_loss", 0),
                                                         ("tokens_per_s", 0)}
    only = as_alice.get(url + "?learner=0&name=train_loss").json()["series"]
    assert [(s["name"], s["learner"], len(s["points"])) for s in only] == [("train_loss", 0, 30)]
    two = as_alice.get(url + "?name=train_loss,tokens_per_s&learner=0&points=5").json()["series"]
    assert all(len(s["points"]) <= 5 for s in two) and len(two) == 2


@pytest.mark.parametrize("query", ["points=0", "points=5001", "points=abc", "learner=-1", "learner=x",
                                   "name=bad%20name", "points=" + "9" * 400])
def test_metrics_bad_parameters(as_alice, alice_job, query):
    r = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/metrics/?{query}")
    assert r.status_code == 400, (query, r.content)
    assert r.json()["errors"]


def test_events_follow_with_after(as_alice, alice_job, bob):
    evs = [Event.objects.create(job=alice_job, kind="merged", message=f"m{i}") for i in range(3)]
    Event.objects.create(job=make_job(bob), kind="merged", message="bob's")
    r = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/events/?after={evs[0].pk}")
    assert [e["message"] for e in r.json()["results"]] == ["m1", "m2"]
    assert as_alice.get(f"/api/v1/jobs/{alice_job.pk}/events/?kind=failed").json()["count"] == 0
    # global event list: own jobs and fleet events, never other people's jobs
    Event.objects.create(kind="drained", message="fleet")
    msgs = {e["message"] for e in as_alice.get("/api/v1/events/?limit=100").json()["results"]}
    assert {"m0", "m1", "m2", "fleet"} <= msgs and "bob's" not in msgs
    bob_ev = Event.objects.get(message="bob's")
    assert as_alice.get(f"/api/v1/events/{bob_ev.pk}/").status_code == 404


def test_incidents(as_alice, as_bob, alice_job, pool_a):
    now = timezone.now()
    l1 = Learner.objects.get(job=alice_job, index=1)
    Incident.objects.create(job=alice_job, learner=l1, pool=pool_a, failed_at=now - timedelta(seconds=2),
                            detected_at=now, healed_at=now + timedelta(seconds=3), tokens_lost=512)
    rows = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/incidents/").json()["results"]
    assert len(rows) == 1
    inc = rows[0]
    assert inc["learner"] == 1 and inc["pool"] == "pool-a" and inc["is_open"] is False
    assert inc["time_to_detect_s"] == pytest.approx(2.0) and inc["time_to_heal_s"] == pytest.approx(3.0)
    assert as_alice.get(f"/api/v1/incidents/?job={alice_job.pk}&open=false").json()["count"] == 1
    assert as_alice.get("/api/v1/incidents/?open=true").json()["count"] == 0
    assert as_bob.get("/api/v1/incidents/").json()["count"] == 0


def test_checkpoint_metadata_and_download(as_alice, as_bob, alice_job, settings, tmp_path):
    transport = pytest.importorskip("trainer.transport", reason="blob store transport not installed")
    settings.BLOB_STORE_URL = f"file://{tmp_path}"
    blob = bytes(range(256)) * 5000  # > 1 MiB: streamed in several chunks
    store = transport.open_store(settings.BLOB_STORE_URL)
    store.put(f"jobs/{alice_job.pk}/ckpt/00000003", blob)
    ck = Checkpoint.objects.create(job=alice_job, version=3, blob_uri=f"jobs/{alice_job.pk}/ckpt/00000003",
                                   size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    rows = as_alice.get(f"/api/v1/jobs/{alice_job.pk}/checkpoints/").json()
    assert [r["version"] for r in rows] == [3]
    assert rows[0]["download_url"].endswith(f"/api/v1/checkpoints/{ck.pk}/download/")
    r = as_alice.get(f"/api/v1/checkpoints/{ck.pk}/download/")
    assert r.status_code == 200
    data = b"".join(r.streaming_content)
    assert data == blob and r["X-Checksum-SHA256"] == ck.sha256 and int(r["Content-Length"]) == len(blob)
    assert as_bob.get(f"/api/v1/checkpoints/{ck.pk}/download/").status_code == 404
    ck.blob_uri = "jobs/missing"
    ck.save()
    assert as_alice.get(f"/api/v1/checkpoints/{ck.pk}/download/").status_code == 404


def test_checkpoint_listing_scope(as_alice, as_bob, as_staff, alice_job):
    Checkpoint.objects.create(job=alice_job, version=1, blob_uri="x", size_bytes=1, sha256="0" * 64)
    assert as_alice.get("/api/v1/checkpoints/").json()["count"] == 1
    assert as_bob.get("/api/v1/checkpoints/").json()["count"] == 0
    assert as_staff.get(f"/api/v1/checkpoints/?job={alice_job.pk}").json()["count"] == 1


def test_checkpoint_download_when_the_store_fails(as_alice, alice_job, settings, tmp_path):
    pytest.importorskip("trainer.transport")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the store's root is a file: reads fail with an OS error
    settings.BLOB_STORE_URL = f"file://{blocker}"
    ck = Checkpoint.objects.create(job=alice_job, version=1, blob_uri="ckpt/1", size_bytes=1, sha256="0" * 64)
    r = as_alice.get(f"/api/v1/checkpoints/{ck.pk}/download/")
    assert r.status_code in (404, 503), r.status_code
    assert r.json()["detail"]
