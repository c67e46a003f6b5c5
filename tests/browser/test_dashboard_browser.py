"""The dashboard in a real browser: login, job form, live job page, cancel, fleet drain."""
from __future__ import annotations

import json
import re
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.dashboard.seeding import seed_fleet
from apps.inventory.models import Pool, PoolToken
from apps.jobs.models import Job, Learner, MetricPoint

from .conftest import login

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def fleet(transactional_db):
    return {p.slug: p for p in seed_fleet()}


def test_login_and_create_job_with_field_error(dash, alice, fleet):
    live = dash.live
    dash.goto(f"{live.url}/jobs/")
    expect(dash).to_have_url(re.compile(r"/accounts/login/\?next=/jobs/"))
    login(dash, live, "alice", "pw-alice-123")
    expect(dash.get_by_role("heading", name="Overview")).to_be_visible()

    dash.get_by_role("link", name="New job").first.click()
    expect(dash.get_by_role("heading", name="New job")).to_be_visible()
    dash.get_by_label("Name", exact=True).fill("browser-run")
    dash.get_by_label("Learners", exact=True).fill("0")
    dash.get_by_role("button", name="Submit job").click()
    error = dash.locator("#id_learners_error")
    expect(error).to_contain_text("greater than or equal to 1")
    expect(dash.get_by_label("Learners", exact=True)).to_have_attribute("aria-invalid", "true")
    assert Job.objects.count() == 0

    # fix it, look at the placement preview first, then submit
    dash.get_by_label("Learners", exact=True).fill("2")
    dash.get_by_role("checkbox", name=re.compile("a100-west")).check()
    dash.get_by_role("button", name="Dry run").click()
    preview = dash.locator("#preview")
    expect(preview).to_contain_text("fits the fleet")
    expect(preview.get_by_role("table", name="Planned placement").locator("tbody tr")).to_have_count(2)
    expect(preview.get_by_role("table", name="Planned placement")).to_contain_text("a100-west")
    assert Job.objects.count() == 0
    dash.screenshot(path="test-artifacts/job_new_dry_run.png", full_page=True)

    dash.get_by_role("button", name="Submit job").click()
    dash.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job = Job.objects.get(name="browser-run")
    assert job.owner.username == "alice" and job.spec["learners"] == 2 and job.spec["pools"] == ["a100-west"]
    expect(dash.get_by_role("heading", name=re.compile(f"#{job.pk} browser-run"))).to_be_visible()
    expect(dash.locator("#live")).to_have_text("live")


def _agent_send(live, token: str, messages: list[dict]) -> list[dict]:
    """Talk to /ws/agent/ as a learner's worker would; returns the server's replies."""
    from websockets.sync.client import connect

    replies = []
    with connect(f"{live.ws_url}/ws/agent/", additional_headers={"Authorization": f"Bearer {token}"},
                 open_timeout=10) as ws:
        for m in messages:
            ws.send(json.dumps(m))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                r = json.loads(ws.recv(timeout=0.5))
            except TimeoutError:
                continue
            replies.append(r)
            if r.get("type") in ("ack", "error"):
                break
    return replies


def test_job_page_updates_live_then_cancel(dash, alice, fleet):
    live = dash.live
    pool = fleet["h100-east"]
    _, token = PoolToken.issue(pool)
    job = Job.objects.create(owner=alice, name="live-run", status="running",
                             spec={"name": "live-run", "learners": 2, "strategy": "decoupled"})
    for i in range(2):
        Learner.objects.create(job=job, index=i, pool=pool, state="running", incarnation=1)
    login(dash, live, "alice", "pw-alice-123")
    dash.goto(f"{live.url}/jobs/{job.pk}/")
    expect(dash.locator("#live")).to_have_text("live")
    dash.evaluate("window.__sameDocument = true")
    expect(dash.locator("#live-points")).to_have_text("0")

    now = time.time()
    points = [{"learner": k % 2, "name": "train_loss", "step": 4096 * (k + 1), "value": 4.0 - 0.05 * k,
               "time": now - 20 + k} for k in range(20)]
    points += [{"learner": 0, "name": "tokens_per_s", "step": 4096 * 20, "value": 5000.0, "time": now},
               {"learner": 1, "name": "tokens_per_s", "step": 4096 * 20, "value": 3000.0, "time": now}]
    replies = _agent_send(live, token, [
        {"type": "hello", "worker": "h100-east-test@host", "pool": "h100-east"},
        {"type": "heartbeat", "job": job.pk, "learner": 0, "incarnation": 1, "step": 20, "tokens": 81920,
         "loss": 3.05, "tokens_per_s": 5000.0, "util": 0.9, "power_w": None, "staleness": 0, "time": now},
        {"type": "heartbeat", "job": job.pk, "learner": 1, "incarnation": 1, "step": 20, "tokens": 61440,
         "loss": 3.2, "tokens_per_s": 3000.0, "util": 0.9, "power_w": None, "staleness": 1, "time": now},
        {"type": "metrics", "job": job.pk, "points": points},
    ])
    # the job-level validation loss comes from the coordinator (a pool token may not write it)
    val = [{"learner": None, "name": "val_loss", "step": 4096 * 20, "value": 3.1, "time": now}]
    replies += _agent_send(live, live.coordinator_token, [{"type": "metrics", "job": job.pk, "points": val}])
    points += val
    assert not [r for r in replies if r.get("type") == "error"], replies

    # the points arrive over the job socket, without a reload
    expect(dash.locator("#live-points")).to_have_text(str(len(points)), timeout=15_000)
    assert dash.evaluate("window.__sameDocument") is True
    expect(dash.locator("#kpi-tokens-per-s")).to_have_text("8 k")  # 5000 + 3000 from two learners
    expect(dash.locator('#learners tr[data-learner="1"] [data-field="staleness"]')).to_have_text("1")
    expect(dash.locator("#kpi-val-loss")).to_have_text("3.100")
    row = dash.locator('#learners tr[data-learner="0"]')
    expect(row.locator('[data-field="loss"]')).to_have_text("3.050")
    expect(row.locator('[data-field="tokens"]')).to_have_text("81.9 k")
    # the chart draws the received series (uPlot legend shows the last value under the cursor)
    assert dash.locator("#chart-loss-tokens canvas").count() == 1
    # and the server stored them (the same path a learner uses)
    assert MetricPoint.objects.filter(job=job).count() == len(points)
    dash.screenshot(path="test-artifacts/job_live.png", full_page=True)

    # an event from the coordinator (the only sender of checkpoint events) lands on the timeline
    replies = _agent_send(live, live.coordinator_token, [
        {"type": "event", "job": job.pk, "kind": "checkpointed", "message": "checkpoint v1 written",
         "payload": {"reason": "every 10 outer steps"}}])
    assert not [r for r in replies if r.get("type") == "error"], replies
    first = dash.locator("#timeline li").first
    expect(first).to_contain_text("checkpoint v1 written")
    expect(first).to_contain_text("every 10 outer steps")

    # a reload shows the same data, now from the server's downsampled series
    dash.reload()
    data = json.loads(dash.locator("#chart-data").text_content())
    assert len(data["train_loss"]) == 20 and data["val_loss"][0][2] == pytest.approx(3.1)

    # wide screen: the four charts share one row; laptop: two rows of two
    dash.set_viewport_size({"width": 2560, "height": 1300})
    tops = {round(b["y"]) for b in (f.bounding_box() for f in dash.locator("figure.chart").all())}
    assert len(tops) == 1, tops
    dash.screenshot(path="test-artifacts/job_wide.png")
    dash.set_viewport_size({"width": 1366, "height": 768})
    tops = {round(b["y"]) for b in (f.bounding_box() for f in dash.locator("figure.chart").all())}
    assert len(tops) == 2, tops
    assert dash.evaluate("document.documentElement.scrollWidth <= window.innerWidth")

    dash.get_by_role("button", name="Cancel job").click()
    dialog = dash.get_by_role("dialog")
    expect(dialog).to_contain_text(f"Cancel job #{job.pk}?")
    dialog.get_by_role("button", name="Confirm").click()
    expect(dash.locator("#job-status")).to_have_text("Cancelled")
    expect(dash.get_by_role("status").filter(has_text="cancel requested")).to_be_visible()
    job.refresh_from_db()
    assert job.status == "cancelled"
    expect(dash.get_by_role("button", name="Cancel job")).to_have_count(0)


def test_fleet_page_reflects_drained_pool_live(dash, staff_user, alice, fleet, context):
    live = dash.live
    pool = fleet["a100-west"]
    job = Job.objects.create(owner=alice, name="on-a100", status="running",
                             spec={"name": "on-a100", "learners": 1})
    Learner.objects.create(job=job, index=0, pool=pool, state="running", incarnation=1, tokens_per_s=1234.0)
    login(dash, live, "olga", "pw-olga-123")
    dash.goto(f"{live.url}/fleet/")
    expect(dash.locator("#live")).to_have_text("live")
    row = dash.locator('tr[data-pool="a100-west"]')
    expect(row.locator('[data-field="state"]')).to_have_text("Active")
    expect(row.locator('[data-field="utilisation"]')).to_have_text("12 %")  # 1 of 8 devices busy
    dash.evaluate("window.__sameDocument = true")

    # a second tab drains the pool from the job page (staff button, with confirmation)
    other = context.new_page()
    other.goto(f"{live.url}/jobs/{job.pk}/")
    other.get_by_role("button", name="Drain pool a100-west").click()
    other.get_by_role("dialog").get_by_role("button", name="Confirm").click()
    expect(other.get_by_role("status").filter(has_text="Pool a100-west drained")).to_be_visible()
    other.close()

    # the first tab follows over /ws/fleet/, no reload
    expect(row.locator('[data-field="state"]')).to_have_text("Draining")
    assert dash.evaluate("window.__sameDocument") is True

    # a second learner starts on the pool; its worker's heartbeat touches the node, the
    # fleet socket says so, and the page refreshes the pool's live figures
    Learner.objects.create(job=job, index=1, pool=pool, state="running", incarnation=1)
    _, token = PoolToken.issue(pool)
    replies = _agent_send(live, token, [
        {"type": "hello", "worker": "a100-west@node1", "pool": "a100-west"},
        {"type": "heartbeat", "job": job.pk, "learner": 1, "incarnation": 1, "step": 5, "tokens": 1000,
         "loss": 3.5, "tokens_per_s": 2000.0, "util": 0.9, "power_w": None, "staleness": 0,
         "time": time.time()},
    ])
    assert not [r for r in replies if r.get("type") == "error"], replies
    expect(row.locator('[data-field="utilisation"]')).to_have_text("25 %")  # 2 of 8 devices busy
    expect(row.locator('[data-field="busy"]')).to_have_text("(2 busy)")
    assert dash.evaluate("window.__sameDocument") is True
    dash.screenshot(path="test-artifacts/fleet_live.png", full_page=True)
    assert Pool.objects.get(slug="a100-west").state == "draining"
    dash.goto(f"{live.url}/fleet/a100-west/")
    expect(dash.get_by_role("button", name="Re-activate pool")).to_be_visible()
    expect(dash.locator(".timeline")).to_contain_text("pool a100-west drained")


def test_overview_jobs_list_and_narrow_width(dash, alice, fleet):
    live = dash.live
    for i, status in enumerate(["running", "completed", "failed"]):
        Job.objects.create(owner=alice, name=f"listed-{i}", status=status, spec={"name": f"listed-{i}"})
    login(dash, live, "alice", "pw-alice-123")
    expect(dash.get_by_role("table", name="Running jobs")).to_contain_text("listed-0")
    expect(dash.get_by_role("table", name="Fleet utilisation by pool")).to_contain_text("h100-east")
    dash.get_by_role("link", name="Jobs", exact=True).click()
    dash.get_by_role("link", name=re.compile(r"^Failed")).click()
    table = dash.get_by_role("table", name="Jobs")
    expect(table).to_contain_text("listed-2")
    expect(table).not_to_contain_text("listed-0")
    dash.get_by_role("link", name=re.compile(r"^All")).click()
    dash.get_by_label("Search jobs").fill("listed-1")
    dash.get_by_role("button", name="Search").click()
    expect(table.locator("tbody tr")).to_have_count(1)
    # laptop width, dark scheme: still one column, nothing overflows the viewport
    dash.set_viewport_size({"width": 1280, "height": 800})
    dash.emulate_media(color_scheme="dark")
    dash.goto(f"{live.url}/")
    bg = dash.evaluate("getComputedStyle(document.body).backgroundColor")
    assert bg == "rgb(17, 19, 24)"
    assert dash.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_reconnects_after_server_restart(dash, alice, fleet):
    live = dash.live
    pool = fleet["v100-lab"]
    _, token = PoolToken.issue(pool)
    job = Job.objects.create(owner=alice, name="survivor", status="running",
                             spec={"name": "survivor", "learners": 1})
    learner = Learner.objects.create(job=job, index=0, pool=pool, state="running", incarnation=1)
    login(dash, live, "alice", "pw-alice-123")
    dash.goto(f"{live.url}/jobs/{job.pk}/")
    indicator = dash.locator("#live")
    expect(indicator).to_have_text("live")
    expect(dash.locator("#chart-loss-time")).to_have_attribute("data-points", "0")
    dash.evaluate("window.__sameDocument = true")

    # the server dies: the indicator must stop claiming "live" (failed reconnects are expected).
    # It stays down until the checks are made, so the page cannot reconnect before we look.
    dash.allowed_console_errors.append(re.compile(r"WebSocket connection to .* failed"))
    dash.wait_for_load_state("networkidle")  # the page's own first fetches (markers, ...) are done
    live.kill()
    expect(indicator).to_have_attribute("data-state", "reconnecting")
    # ... and points stored while the page was away (another web process) are fetched on reconnect
    now = timezone.now()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=job, learner=learner, name="train_loss", step=1000 * (i + 1), value=3.0 - 0.1 * i,
                    time=now - timedelta(seconds=10 - i)) for i in range(5)])
    expect(dash.locator("#chart-loss-time")).to_have_attribute("data-points", "0")
    live.start()
    expect(indicator).to_have_text("live", timeout=30_000)
    expect(dash.locator("#chart-loss-time")).to_have_attribute("data-points", "5")
    # live points flow again on the new connection
    replies = _agent_send(live, token, [{"type": "metrics", "job": job.pk, "points": [
        {"learner": 0, "name": "train_loss", "step": 6000, "value": 2.4, "time": time.time()}]}])
    assert not [r for r in replies if r.get("type") == "error"], replies
    expect(dash.locator("#chart-loss-time")).to_have_attribute("data-points", "6")
    assert dash.evaluate("window.__sameDocument") is True
