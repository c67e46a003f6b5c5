"""The operator's side in Chromium: job list filters survive a reload, pool and node history
charts draw, the favicon loads, and no page logs a console error (the `dash` fixture collects
`console` errors and `pageerror`s and fails the test on any)."""
from __future__ import annotations

import re
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.dashboard.seeding import seed_fleet
from apps.inventory.history import sample_fleet
from apps.inventory.models import FleetSample, Node
from apps.jobs.models import Event, Incident, Job, Learner, MetricPoint

from .conftest import login

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def world(transactional_db, staff_user, alice, bob):
    """A fleet with history, jobs of two owners on two pools, metrics, an incident."""
    pools = {p.slug: p for p in seed_fleet()}
    h100, a100 = pools["h100-east"], pools["a100-west"]
    node = Node.objects.get(worker_name="h100-east@node1")
    now = timezone.now()
    jobs = {}
    for name, owner, pool, status, team in (("alpha", alice, h100, "running", "vision"),
                                            ("beta", alice, a100, "completed", ""),
                                            ("gamma", bob, a100, "running", "vision"),
                                            ("delta", bob, h100, "queued", "")):
        job = Job.objects.create(owner=owner, name=name, status=status, team=team,
                                 spec={"name": name, "learners": 2, "strategy": "decoupled",
                                       **({"devices_per_learner": 2} if name == "gamma" else {})},
                                 started_at=now - timedelta(minutes=30) if status != "queued" else None,
                                 tokens_computed=40_000, tokens_contributed=36_000, outer_steps=8)
        for i in range(2):
            Learner.objects.create(job=job, index=i, pool=pool, node=node if pool == h100 else None,
                                   state="running" if status == "running" else "done", incarnation=1,
                                   tokens_per_s=1500.0, tokens=20_000, last_heartbeat=now)
        MetricPoint.objects.bulk_create([
            MetricPoint(job=job, name="train_loss", step=2000 * k, value=5.0 - 0.1 * k,
                        time=now - timedelta(seconds=60 - 2 * k)) for k in range(30)])
        jobs[name] = job
    MetricPoint.objects.bulk_create([  # gamma's learners are islands of 2 ranks: per-rank CPU figures
        MetricPoint(job=jobs["gamma"], learner=lr, name=f"rank{r}_cpu", step=2000 * k, value=0.9 - 0.1 * r,
                    time=now - timedelta(seconds=60 - 2 * k))
        for lr in jobs["gamma"].learners.all() for r in range(2) for k in range(30)])
    Incident.objects.create(job=jobs["alpha"], pool=h100, kind="learner_lost", description="worker killed",
                            failed_at=now - timedelta(minutes=5), detected_at=now - timedelta(minutes=5),
                            healed_at=now - timedelta(minutes=4))
    Event.objects.create(pool=h100, kind="info", message="node h100-east@node1 registered")
    FleetSample.objects.bulk_create([  # an hour of history, then one sample of now
        FleetSample(pool=h100, node=n, time=now - timedelta(seconds=3600 - 30 * i), devices=8,
                    busy=i % 8, utilisation=(i % 8) / 8, tokens_per_s=250.0 * (i % 8),
                    watts=2000 + 100 * (i % 8))
        for i in range(120) for n in (None, node)])
    sample_fleet()
    return {"pools": pools, "node": node, "jobs": jobs}


def _query(url: str) -> dict[str, list[str]]:
    return parse_qs(urlparse(url).query)


def test_job_filters_survive_a_reload_and_a_shared_link(dash, world, context):
    live = dash.live
    login(dash, live, "olga", "pw-olga-123")
    dash.goto(f"{live.url}/jobs/")
    rows = dash.locator("table[aria-label='Jobs'] tbody tr")
    expect(rows).to_have_count(4)

    dash.locator("#f-owner").select_option("alice")
    dash.locator("#f-team").select_option("vision")
    dash.get_by_label("Search jobs").fill("alp")
    dash.get_by_role("button", name="Search").click()
    dash.wait_for_url(re.compile(r"owner=alice"))
    assert _query(dash.url) == {"owner": ["alice"], "team": ["vision"], "q": ["alp"]}
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("alpha")

    dash.reload()
    expect(rows).to_have_count(1)
    expect(dash.locator("#f-owner")).to_have_value("alice")
    expect(dash.locator("#f-team")).to_have_value("vision")
    expect(dash.get_by_label("Search jobs")).to_have_value("alp")

    # a status chip keeps the other filters
    dash.locator("#f-owner").select_option("")
    dash.get_by_label("Search jobs").fill("")
    dash.locator("#f-pool").select_option("a100-west")
    dash.get_by_role("button", name="Search").click()
    dash.wait_for_url(re.compile(r"pool=a100-west"))
    expect(rows).to_have_count(1)  # gamma: vision, on a100-west
    dash.locator("a.chip", has_text="Completed").click()
    dash.wait_for_url(re.compile(r"status=completed"))
    assert _query(dash.url) == {"status": ["completed"], "team": ["vision"], "pool": ["a100-west"]}
    expect(dash.locator("table[aria-label='Jobs']")).to_contain_text("No jobs match.")

    # the URL, opened in another tab of the same session, shows the same view
    shared = dash.url.replace("status=completed", "status=running")
    other = context.new_page()
    other.goto(shared)
    expect(other.locator("table[aria-label='Jobs'] tbody tr")).to_have_count(1)
    expect(other.locator("table[aria-label='Jobs'] tbody tr").first).to_contain_text("gamma")
    expect(other.locator("#f-pool")).to_have_value("a100-west")
    other.close()


def test_pool_and_node_pages_chart_history(dash, world):
    live = dash.live
    login(dash, live, "olga", "pw-olga-123")
    dash.goto(f"{live.url}/fleet/h100-east/?range=6h")
    for name in ("utilisation", "tokens_per_s", "watts"):
        chart = dash.locator(f"#chart-{name}")
        expect(chart.locator("canvas")).to_have_count(1)
        # an hour of samples every 30 s in 90-s buckets (6 h / 240), and the sample of now
        assert 40 <= int(chart.get_attribute("data-points")) <= 42
    dash.get_by_role("link", name="h100-east-node1").click()
    dash.wait_for_url(re.compile(r"/fleet/h100-east/nodes/\d+/$"))
    expect(dash.get_by_role("heading", name=re.compile("Node h100-east-node1"))).to_be_visible()
    expect(dash.locator("#chart-watts canvas")).to_have_count(1)
    assert 40 <= int(dash.locator("#chart-watts").get_attribute("data-points")) <= 42
    expect(dash.get_by_role("table", name=re.compile("Learners on"))).to_contain_text("alpha")
    dash.get_by_role("link", name="1h").click()
    dash.wait_for_url(re.compile(r"range=1h"))
    expect(dash.locator("#chart-utilisation canvas")).to_have_count(1)
    assert 100 < int(dash.locator("#chart-utilisation").get_attribute("data-points")) <= 241  # 15-s buckets


def test_favicon_and_no_console_errors_on_any_page(dash, world):
    live = dash.live
    node, jobs = world["node"], world["jobs"]
    # signed out
    dash.goto(f"{live.url}/accounts/login/")
    dash.wait_for_load_state("networkidle")
    icon = dash.locator("link[rel=icon]").get_attribute("href")
    resp = dash.request.get(f"{live.url}{icon}")
    assert resp.status == 200 and "svg" in resp.headers["content-type"]
    resp = dash.request.get(f"{live.url}/favicon.ico")  # pages outside base.html (the admin's)
    assert resp.status == 200 and "svg" in resp.headers["content-type"]

    login(dash, live, "olga", "pw-olga-123")
    pages = ["/", "/fleet/", "/fleet/h100-east/", "/fleet/a100-west/?range=30d",
             f"/fleet/h100-east/nodes/{node.pk}/", "/jobs/",
             "/jobs/?status=running&owner=alice&pool=h100-east",
             "/jobs/new", "/account/tokens/",
             f"/compare/?jobs={jobs['alpha'].pk},{jobs['gamma'].pk}"]
    pages += [f"/jobs/{j.pk}/" for j in jobs.values()]
    pages += ["/admin/", "/admin/inventory/node/", "/admin/jobs/job/", "/api/docs/"]
    visited = []
    for path in pages:
        resp = dash.goto(f"{live.url}{path}")
        assert resp is not None and resp.status == 200, path
        dash.wait_for_load_state("networkidle", timeout=45_000)  # the page's own fetches too (2 shared CPUs)
        visited.append(path)
        assert not dash.console_errors, f"{path}: {dash.console_errors}"
    assert len(visited) == len(pages)
    dash.goto(f"{live.url}/jobs/{jobs['gamma'].pk}/")  # an island job charts its ranks
    expect(dash.locator("#chart-ranks")).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
