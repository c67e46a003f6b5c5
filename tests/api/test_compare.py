"""Compare several jobs: the API (/api/v1/compare/), the dashboard page, its logic, and the
chart markers of the job page (incidents, moves, checkpoints) with the demo's chaos button."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.dashboard import compare
from apps.dashboard.demo_chaos import ENV, take_request
from apps.jobs.models import Checkpoint, Event, Incident, Job, MetricPoint

from .conftest import make_job

pytestmark = pytest.mark.django_db


def _curve(job: Job, start: float, last_tokens: int, name: str = "train_loss", every: int = 1000) -> None:
    """Job-level points: loss = start - tokens / 10k, one every `every` tokens, one per second."""
    t0 = timezone.now() - timedelta(hours=1)
    Job.objects.filter(pk=job.pk).update(started_at=t0, tokens_computed=last_tokens)
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, name=name, step=x, value=start - x / 10_000,
                    time=t0 + timedelta(seconds=x / every))
        for x in range(0, last_tokens + 1, every))


@pytest.fixture
def pair(alice, pool_a):
    base, other = make_job(alice, pool=pool_a, name="base"), make_job(alice, pool=pool_a, name="other")
    _curve(base, 3.0, 10_000)
    _curve(other, 3.3, 5_000)
    return base, other


def test_loss_at_interpolates_inside_the_curve_only():
    assert compare.loss_at([0, 100, 200], [3.0, 2.0, 1.0], 150) == pytest.approx(1.5)
    assert compare.loss_at([0, 100, 200], [3.0, 2.0, 1.0], 100) == 2.0
    assert compare.loss_at([0, 100], [3.0, 2.0], 250) is None
    assert compare.loss_at([], [], 0) is None


@pytest.mark.parametrize(("raw", "reason"), [
    ([""], "give one or more job ids"), (["1,x"], "'x' is not a job id"),
    ([",".join(str(i) for i in range(1, 10))], "at most 8 jobs"), (["-3"], "'-3' is not a job id"),
])
def test_parse_ids_names_the_field_and_reason(raw, reason):
    with pytest.raises(compare.CompareError) as exc:
        compare.parse_ids(raw)
    assert exc.value.field == "jobs" and reason in exc.value.reason


def test_parse_ids_keeps_order_and_drops_repeats():
    assert compare.parse_ids(["3,1", "#3", "2"]) == [3, 1, 2]


def test_api_gap_to_baseline_at_equal_tokens(as_alice, pair):
    base, other = pair
    r = as_alice.get(f"/api/v1/compare/?jobs={base.pk},{other.pk}")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["metric"] == "train_loss" and body["baseline"] == base.pk and body["missing"] == []
    rows = {j["id"]: j for j in body["jobs"]}
    assert [j["id"] for j in body["jobs"]] == [base.pk, other.pk]
    # the shorter job reached 5k tokens: base 3.0 - 0.5 = 2.5, other 3.3 - 0.5 = 2.8 there
    o = rows[other.pk]
    assert o["common_tokens"] == 5_000
    assert o["loss_at_common_tokens"] == pytest.approx(2.8)
    assert o["baseline_loss_at_common_tokens"] == pytest.approx(2.5)
    assert o["gap_pct"] == pytest.approx(12.0)
    assert o["final_loss"] == pytest.approx(2.8) and o["tokens"] == 5_000
    assert rows[base.pk]["baseline"] and rows[base.pk]["gap_pct"] == 0.0
    assert rows[base.pk]["final_loss"] == pytest.approx(2.0)
    assert rows[base.pk]["wall_time_s"] == pytest.approx(3600, abs=30)
    assert o["series"]["tokens"][:3] == [0, 1000, 2000] and o["series"]["elapsed_s"][:2] == [0.0, 1.0]
    assert len(o["series"]["loss"]) == 6

    # pin the other job: the gap turns negative, the same size relative to the new baseline
    r = as_alice.get(f"/api/v1/compare/?jobs={base.pk}&jobs={other.pk}&baseline={other.pk}")
    rows = {j["id"]: j for j in r.json()["jobs"]}
    assert rows[base.pk]["gap_pct"] == pytest.approx(100 * (2.5 - 2.8) / 2.8)
    assert rows[other.pk]["baseline"]


def test_api_prefers_val_loss_when_every_job_has_it(as_alice, pair):
    base, other = pair
    _curve(base, 4.0, 10_000, name="val_loss", every=2_000)
    r = as_alice.get(f"/api/v1/compare/?jobs={base.pk},{other.pk}")
    assert r.json()["metric"] == "train_loss"  # `other` has no validation loss yet
    _curve(other, 4.4, 4_000, name="val_loss", every=2_000)
    body = as_alice.get(f"/api/v1/compare/?jobs={base.pk},{other.pk}").json()
    assert body["metric"] == "val_loss"
    assert {j["id"]: j["gap_pct"] for j in body["jobs"]}[other.pk] == pytest.approx(100 * 0.4 / 3.6)
    forced = as_alice.get(f"/api/v1/compare/?jobs={base.pk},{other.pk}&metric=train_loss").json()
    assert forced["metric"] == "train_loss"


def test_api_hides_jobs_of_others_like_missing_ones(as_alice, as_bob, bob, pair):
    base, _ = pair
    bobs = make_job(bob, name="bobs")
    _curve(bobs, 2.0, 10_000)
    body = as_alice.get(f"/api/v1/compare/?jobs={base.pk},{bobs.pk},999999").json()
    assert [j["id"] for j in body["jobs"]] == [base.pk] and body["missing"] == [bobs.pk, 999999]
    r = as_bob.get(f"/api/v1/compare/?jobs={base.pk}")
    assert r.status_code == 400 and "may see" in r.json()["errors"]["jobs"][0]
    r = as_alice.get(f"/api/v1/compare/?jobs={base.pk},{bobs.pk}&baseline={bobs.pk}")
    assert r.status_code == 400 and list(r.json()["errors"]) == ["baseline"]


@pytest.mark.parametrize(("query", "field"), [
    ("", "jobs"), ("jobs=", "jobs"), ("jobs=a,b", "jobs"), ("jobs=1,2,3,4,5,6,7,8,9", "jobs"),
    ("jobs=1&baseline=2", "baseline"), ("jobs=1&baseline=x", "baseline"),
    ("jobs=1&metric=accuracy", "metric"),
    ("jobs=1%002", "jobs"),
])
def test_api_bad_input_is_400_with_field_and_reason(as_alice, query, field):
    r = as_alice.get(f"/api/v1/compare/?{query}")
    assert r.status_code == 400, r.content
    errors = r.json()["errors"]
    assert list(errors) == [field] and errors[field][0]


def test_api_needs_a_person(anon):
    assert anon.get("/api/v1/compare/?jobs=1").status_code in (401, 403)


def test_schema_documents_compare(as_alice):
    r = as_alice.get("/api/schema/?format=json")
    op = r.json()["paths"]["/api/v1/compare/"]["get"]
    assert op["operationId"] == "compare_jobs"
    assert {p["name"] for p in op["parameters"]} >= {"jobs", "baseline", "metric"}


# ------------------------------------------------------------------------------ dashboard page
def _signed_in(user) -> Client:
    c = Client()
    c.force_login(user)
    return c


def test_page_overlays_and_tabulates_the_gap(alice, bob, pair):
    base, other = pair
    bobs = make_job(bob, name="bobs")
    page = _signed_in(alice).get(f"/compare/?jobs={base.pk},{other.pk},{bobs.pk}")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="chart-compare-tokens"' in html and 'id="chart-compare-time"' in html
    assert "+12.00 %" in html and "baseline</span>" in html
    assert f"Not shown: job {bobs.pk}" in html and "bobs" not in html
    chart = page.context["chart"]
    assert [j["id"] for j in chart["jobs"]] == [base.pk, other.pk] and chart["jobs"][0]["baseline"]


@pytest.mark.parametrize("query", ["jobs=abc", "jobs=1,2&baseline=3", "jobs=424242"])
def test_page_bad_or_unknown_ids_explain_never_500(alice, query):
    page = _signed_in(alice).get(f"/compare/?{query}")
    assert page.status_code == 200
    assert 'id="compare-error"' in page.content.decode()


def test_jobs_list_selects_rows_into_compare(alice, pair):
    html = _signed_in(alice).get("/jobs/").content.decode()
    assert 'id="compare-form"' in html and 'action="/compare/"' in html
    for job in pair:
        assert f'name="jobs" value="{job.pk}" form="compare-form"' in html


# ------------------------------------------------------------------------------ chart markers
def test_job_page_and_markers_json_carry_incidents_moves_checkpoints(alice, pool_a, pair):
    job = pair[0]
    t = timezone.now()
    Incident.objects.create(job=job, pool=pool_a, kind="learner_lost",
                            description="learner 1.0 missed heartbeats", failed_at=t - timedelta(seconds=3),
                            detected_at=t, healed_at=t + timedelta(seconds=4))
    Incident.objects.create(job=job, pool=pool_a, kind="learner_lost", description="still out",
                            failed_at=t, detected_at=t + timedelta(seconds=10))
    Event.objects.create(job=job, kind=Event.Kind.REASSIGNED, message="learner 1 pool-a → pool-b",
                         time=t + timedelta(seconds=2))
    Event.objects.create(job=job, kind=Event.Kind.MERGED, message="not a marker")
    Event.objects.create(job=job, kind=Event.Kind.REBALANCED, message="learner 0 work size 10 → 4",
                         payload={"learner": 0, "work_size": 4})  # not a move either
    Checkpoint.objects.create(job=job, version=6, blob_uri="x", size_bytes=1, sha256="0" * 64,
                              created_at=t + timedelta(seconds=5))
    c = _signed_in(alice)
    markers = c.get(f"/jobs/{job.pk}/markers.json").json()["markers"]
    assert [m["kind"] for m in markers] == ["incident", "move", "checkpoint", "incident"]
    healed, move, ckpt, still = markers
    assert healed["end"] - healed["time"] == pytest.approx(4.0) and not healed["open"]
    assert "missed heartbeats" in healed["text"] and "healed after 4.0 s" in healed["text"]
    assert still["open"] and still["end"] is None and "not healed yet" in still["text"]
    assert move["text"] == "learner 1 pool-a → pool-b" and ckpt["text"] == "periodic checkpoint v6"
    page = c.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="marker-legend"' in page  # job.js fetches the markers after the first paint
    assert 'id="demo-kill-worker"' not in page


def test_markers_of_a_job_you_may_not_see_are_404(bob, pair):
    assert _signed_in(bob).get(f"/jobs/{pair[0].pk}/markers.json").status_code == 404


def test_demo_kill_button_only_for_staff_in_demo_mode(monkeypatch, settings, tmp_path, alice, staff_user,
                                                      pair):
    settings.VAR_DIR = tmp_path
    job = pair[0]
    staff = _signed_in(staff_user)
    monkeypatch.delenv(ENV, raising=False)
    assert staff.post(f"/jobs/{job.pk}/demo/kill-worker").status_code == 404  # off outside the demo
    assert 'id="demo-kill-worker"' not in staff.get(f"/jobs/{job.pk}/").content.decode()

    monkeypatch.setenv(ENV, "1")
    assert 'id="demo-kill-worker"' in staff.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="demo-kill-worker"' not in _signed_in(alice).get(f"/jobs/{job.pk}/").content.decode()
    r = _signed_in(alice).post(f"/jobs/{job.pk}/demo/kill-worker")
    assert r.status_code == 302 and "/login/" in r["Location"] and take_request() is None
    assert staff.get(f"/jobs/{job.pk}/demo/kill-worker").status_code == 405
    csrf = Client(enforce_csrf_checks=True)
    csrf.force_login(staff_user)
    assert csrf.post(f"/jobs/{job.pk}/demo/kill-worker").status_code == 403 and take_request() is None

    r = staff.post(f"/jobs/{job.pk}/demo/kill-worker")
    assert r.status_code == 302 and r["Location"] == f"/jobs/{job.pk}/"
    req = take_request()
    assert req["pools"] == ["pool-a"] and req["job"] == job.pk and req["user"] == staff_user.username
    job.learners.update(state="done")
    r = staff.post(f"/jobs/{job.pk}/demo/kill-worker")
    assert r.status_code == 302 and take_request() is None  # nothing running: nothing asked
    assert take_request() is None  # taken once
    json.dumps(req)
