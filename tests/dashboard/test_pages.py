"""Page contents, bounded query counts, server-side downsampling, tokens, bench."""
from __future__ import annotations

import json
import math
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from apps.coordinator.models import SyncerLease
from apps.dashboard.data import downsample
from apps.dashboard.seeding import seed_jobs
from apps.jobs.models import Checkpoint, Incident, MetricPoint, OuterStep


def _points(job, n, name="train_loss", learners=None, start=0, stride=100):
    now = timezone.now()
    rows = []
    for i in range(n):
        lr = learners[i % len(learners)] if learners else None
        rows.append(MetricPoint(job=job, learner=lr, name=name, step=(start + i) * stride,
                                value=float(i), time=now - timedelta(seconds=n - i)))
    MetricPoint.objects.bulk_create(rows)


@pytest.mark.django_db
def test_downsample_bounds_points_and_keeps_shape(alice, job_factory):
    job = job_factory(alice)
    _points(job, 5000)
    _points(job, 50, name="val_loss", stride=10_000)  # sparse, across the same token range
    out = downsample([job.pk], ["train_loss", "val_loss", "goodput"], buckets=100)[job.pk]
    train = out["train_loss"]
    assert 90 <= len(train) <= 100
    xs = [x for x, _, _ in train]
    assert xs == sorted(xs)
    assert train[0][2] < 60 and train[-1][2] > 4900  # means of the first/last buckets
    # every value is the mean of its bucket: the overall mean is preserved (equal buckets)
    assert math.isclose(sum(v for _, _, v in train) / len(train), 2499.5, rel_tol=0.02)
    assert len(out["val_loss"]) == 50
    assert "goodput" not in out


@pytest.mark.django_db
def test_downsample_recent_window_and_out_of_order_steps(alice, job_factory):
    job = job_factory(alice)
    _points(job, 3000)  # steps 0..299900, values 0..2999, newest last
    out = downsample([job.pk], ["train_loss"], buckets=20, recent=100)[job.pk]["train_loss"]
    assert len(out) <= 20
    assert min(v for _, _, v in out) >= 2899.0 - 5  # only the newest 100 points
    assert out[-1][0] == 299900
    # a point whose step lies past the newest one's (another learner ahead) is kept, at the end
    now = timezone.now()
    MetricPoint.objects.create(job=job, name="train_loss", step=10**9, value=-1.0,
                               time=now - timedelta(hours=1))
    full = downsample([job.pk], ["train_loss"], buckets=10)[job.pk]["train_loss"]
    assert len(full) <= 10 and full[-1][0] == 10**9


@pytest.mark.django_db
def test_downsample_sums_per_learner_rates(alice, job_factory):
    job = job_factory(alice, learners=2)
    lrs = list(job.learners.all())
    now = timezone.now()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=job, learner=lr, name="tokens_per_s", step=i * 10, value=1000.0 * (lr.index + 1),
                    time=now) for i in range(100) for lr in lrs])
    pts = downsample([job.pk], ["tokens_per_s"], buckets=10)[job.pk]["tokens_per_s"]
    assert all(math.isclose(v, 3000.0) for _, _, v in pts)  # 1000 + 2000, not their mean


@pytest.mark.django_db
def test_job_page_contents(client, alice, job_factory):
    job = job_factory(alice, name="shown")
    lrs = list(job.learners.all())
    _points(job, 500, learners=lrs)
    OuterStep.objects.create(job=job, fragment=0, version=1, merged_norm=0.5, contributors=[
        {"learner": 0, "norm": 0.4, "cosine": 0.8}, {"learner": 1, "norm": 0.9, "cosine": -0.2}])
    Incident.objects.create(job=job, learner=lrs[0], kind="learner_lost", description="worker killed",
                            failed_at=timezone.now() - timedelta(seconds=3), detected_at=timezone.now())
    Checkpoint.objects.create(job=job, version=7, blob_uri="memory://x/7", size_bytes=2048, sha256="ab" * 32)
    client.force_login(alice)
    assert "No syncer started yet." in client.get(f"/jobs/{job.pk}/").content.decode()
    job.spec = {**job.spec, "fragments": 2, "syncer_shards": 2}
    job.save(update_fields=["spec"])
    SyncerLease.objects.create(job=job, shard=0, epoch=1, worker="coordinator@h", commits=4)
    SyncerLease.objects.create(job=job, shard=1, epoch=3, worker="", commits=3, restarts=2)
    resp = client.get(f"/jobs/{job.pk}/")
    body = resp.content.decode()
    assert resp.status_code == 200
    assert 'id="chart-loss-tokens"' in body and 'id="chart-data"' in body
    data = json.loads(body.split('<script id="chart-data" type="application/json">')[1].split("</script>")[0])
    assert 0 < len(data["train_loss"]) <= 300
    assert "worker killed" in body and "detected 3.0 s after" in body
    assert "fragment 0 → v1: merged 2 contributions" in body  # outer steps on the timeline
    assert f"/jobs/{job.pk}/checkpoints/7/download" in body
    health = {h["learner"].index: h for h in resp.context["health"]}
    assert health[0]["healthy"] and not health[1]["healthy"]
    assert 'data-confirm="Cancel job' in body and 'data-confirm="Pause job' in body
    shards = body.split('id="syncer-shards"')[1].split("</table>")[0]
    assert [row.count("running") + 2 * row.count("stopped") for row in shards.split("<tr>")[2:]] == [1, 2]


@pytest.mark.django_db
def test_an_island_jobs_page_charts_its_ranks(client, alice, job_factory):
    job = job_factory(alice, name="islands")
    lrs = list(job.learners.all())
    _points(job, 40, name="rank1_cpu", learners=lrs)
    client.force_login(alice)
    assert 'id="chart-ranks"' not in client.get(f"/jobs/{job.pk}/").content.decode()  # one device each
    job.spec = {**job.spec, "devices_per_learner": 2}
    job.save(update_fields=["spec"])
    body = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-names="rank0_cpu,rank1_cpu,rank0_util,rank1_util"' in body
    data = json.loads(body.split('<script id="chart-data" type="application/json">')[1].split("</script>")[0])
    assert len(data["rank1_cpu"]) == 40
    assert len(client.get(f"/jobs/{job.pk}/series.json").json()["rank1_cpu"]) == 40


@pytest.mark.django_db
def test_checkpoint_download(client, alice, bob, job_factory, tmp_path):
    job = job_factory(alice)
    blob = tmp_path / "ckpt.safetensors"
    blob.write_bytes(b"weights!" * 10)
    Checkpoint.objects.create(job=job, version=3, blob_uri=f"file://{blob}", size_bytes=80, sha256="cd" * 32)
    Checkpoint.objects.create(job=job, version=4, blob_uri=f"file://{tmp_path}/gone", size_bytes=1,
                              sha256="00" * 32)
    client.force_login(alice)
    resp = client.get(f"/jobs/{job.pk}/checkpoints/3/download")
    assert resp.status_code == 200
    assert b"".join(resp.streaming_content) == b"weights!" * 10
    assert "attachment" in resp["Content-Disposition"]
    assert client.get(f"/jobs/{job.pk}/checkpoints/4/download").status_code == 404
    client.force_login(bob)
    assert client.get(f"/jobs/{job.pk}/checkpoints/3/download").status_code == 404


@pytest.mark.django_db
def test_checkpoint_download_from_configured_store(client, alice, job_factory, tmp_path, settings):
    from trainer.transport import open_store

    settings.BLOB_STORE_URL = f"file://{tmp_path}/store"
    open_store(settings.BLOB_STORE_URL).put("jobs/1/ckpt-00010.safetensors", b"abc" * 100)
    job = job_factory(alice)
    Checkpoint.objects.create(job=job, version=10, blob_uri="jobs/1/ckpt-00010.safetensors",
                              size_bytes=300, sha256="ef" * 32)
    client.force_login(alice)
    resp = client.get(f"/jobs/{job.pk}/checkpoints/10/download")
    assert resp.status_code == 200 and b"".join(resp.streaming_content) == b"abc" * 100
    assert resp["X-Checksum-SHA256"] == "ef" * 32


@pytest.mark.django_db
def test_query_counts_stay_bounded(client, staff_user, django_assert_max_num_queries):
    jobs = seed_jobs(staff_user, jobs=12, points=6000, learners=3)
    running = next(j for j in jobs if j.status == "running")
    client.force_login(staff_user)
    for url, limit in [("/", 16), ("/fleet/", 6), ("/fleet/h100-east/", 9), ("/jobs/", 6),
                       ("/jobs/?status=running&q=bench", 6), ("/jobs/new", 4),
                       (f"/jobs/{running.pk}/", 15), (f"/jobs/{running.pk}/series.json", 9)]:
        with django_assert_max_num_queries(limit):
            assert client.get(url).status_code == 200, url


@pytest.mark.django_db
def test_overview_shows_sparklines_incidents_and_energy(client, alice, job_factory):
    job = job_factory(alice, name="sparky", energy_j=7.2e6, cost=12.5, tokens_computed=1000,
                      tokens_contributed=930)
    _points(job, 200)
    _points(job, 200, name="goodput")
    Incident.objects.create(job=job, kind="learner_lost", description="open one",
                            failed_at=timezone.now(), detected_at=timezone.now())
    client.force_login(alice)
    body = client.get("/").content.decode()
    assert 'aria-label="loss of job sparky' in body and "<polyline" in body
    assert "open one" in body
    assert 'data-pool="h100-east"' in body and "h100-east" in body  # fleet utilisation by pool
    assert "2.00 kWh" in body and "12.50" in body
    assert "93 % now" in body  # goodput from the job's counters, beside its sparkline


@pytest.mark.django_db
def test_api_tokens_create_and_revoke(client, alice, bob):
    from apps.api.models import ApiToken

    client.force_login(alice)
    resp = client.post("/account/tokens/", {"action": "create", "name": "ci", "days": "30"})
    assert resp.status_code == 201
    raw = resp.context["new_key"]
    tok = ApiToken.lookup(raw)
    assert tok is not None and tok.user == alice and raw in resp.content.decode()
    assert raw not in client.get("/account/tokens/").content.decode()  # shown once
    assert client.post("/account/tokens/", {"action": "create", "name": ""}).status_code == 200
    assert ApiToken.objects.count() == 1
    client.force_login(bob)
    assert client.post("/account/tokens/", {"action": "revoke", "token": tok.pk}).status_code == 404
    client.force_login(alice)
    client.post("/account/tokens/", {"action": "revoke", "token": tok.pk})
    assert ApiToken.lookup(raw) is None


@pytest.mark.django_db
def test_bench_command_runs_and_rolls_back(tmp_path, capsys):
    out = tmp_path / "bench.json"
    call_command("dashboard_bench", jobs=4, points=800, repeat=1, json_path=str(out))
    report = json.loads(out.read_text())
    assert report["jobs"] == 4 and report["metric_points"] == 800
    assert {p["page"] for p in report["pages"]} >= {"overview", "fleet", "jobs", "job detail"}
    assert all(p["status"] == 200 and p["median_ms"] > 0 and p["queries"] > 0 for p in report["pages"])
    assert "median ms" in capsys.readouterr().out
    assert MetricPoint.objects.count() == 0  # rolled back


@pytest.mark.django_db
def test_fleet_live_json(client, alice, job_factory, fleet):
    job_factory(alice, learners=2, pools=[fleet["v100-lab"]])
    client.force_login(alice)
    body = client.get("/fleet/live.json").json()
    v100 = next(p for p in body["pools"] if p["slug"] == "v100-lab")
    assert v100["busy"] == 2 and v100["utilisation"] == 0.5 and v100["tokens_per_s"] == 3000.0
    assert v100["state"] == "active" and v100["nodes_total"] == 1


@pytest.mark.django_db
def test_learner_steps_become_job_tokens_and_throughput_is_derived(alice, job_factory):
    job = job_factory(alice, learners=2)
    lrs = list(job.learners.all())
    t0 = timezone.now() - timedelta(seconds=200)
    MetricPoint.objects.bulk_create([
        MetricPoint(job=job, learner=lr, name="train_loss", step=1000 * i, value=3.0,
                    time=t0 + timedelta(seconds=i)) for i in range(100) for lr in lrs])
    MetricPoint.objects.create(job=job, name="val_loss", step=198_000, value=2.9,
                               time=t0 + timedelta(seconds=99))
    out = downsample([job.pk], ["train_loss", "val_loss", "tokens_per_s"], buckets=20)[job.pk]
    # each learner at 99k tokens: the job at 198k, like the job-level val_loss point
    assert out["train_loss"][-1][0] == 198_000 and out["val_loss"][-1][0] == 198_000
    rates = [v for _, _, v in out["tokens_per_s"]]
    assert rates and all(math.isclose(r, 2000.0, rel_tol=0.01) for r in rates)  # 2 learners x 1000 tok/s
