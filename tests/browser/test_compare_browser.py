"""Issue 21 in Chromium: the live job page of a real stack (chart growing over the websocket,
an incident marker after a worker is killed, the learner moving, the heal), and the compare
view overlaying two jobs with the gap to the baseline."""
from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.jobs import state as st
from apps.jobs.models import Incident, Job, Learner, MetricPoint
from apps.jobs.services import submit_job

from .conftest import ARTIFACTS, login

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# tiny and short, but long enough for a kill mid-run on a busy CI machine
SPEC = {"name": "markers", "model": "tiny", "learners": 2, "quorum": 1, "inner_steps": 5, "fragments": 1,
        "steps": 3000, "batch_size": 4, "seq_len": 32, "warmup_steps": 2, "eval_interval": 4,
        "checkpoint_interval": 6, "grace_cap_s": 0.5, "seed": 1}


def _wait_until(page, expression: str, timeout_s: float) -> None:
    """Poll a JavaScript expression from here. Playwright's wait_for_function evals its predicate
    inside the page, which the dashboard's Content-Security-Policy (no 'unsafe-eval') refuses;
    page.evaluate runs through the DevTools protocol, outside the page's policy."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s} s: {expression}"
        page.wait_for_timeout(100)


def _watch_console(page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console.error: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.set_default_timeout(20_000)
    return errors


def _sign_in(page, url: str, username: str, password: str) -> None:
    page.goto(f"{url}/accounts/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{url}/")


@pytest.fixture
def stack(transactional_db, tmp_path):
    from tests.support.stack import Stack

    with Stack(tmp_path, pools={"alpha": 1, "beta": 1, "gamma": 1}) as s:  # one learner per pool, one spare
        yield s


def _points(page, chart: str) -> int:
    return int(page.locator(f"#{chart}").get_attribute("data-points") or 0)


def test_live_chart_grows_and_an_incident_marker_appears_after_a_kill(page, stack, alice):
    errors = _watch_console(page)
    job, _ = submit_job(alice, SPEC)
    stack.wait_for(lambda: Learner.objects.filter(job=job, state=Learner.State.RUNNING).count() == 2,
                   timeout=90, what="both learners running")
    _sign_in(page, stack.web_url, "alice", "pw-alice-123")
    page.goto(f"{stack.web_url}/jobs/{job.pk}/")
    expect(page.locator("#live")).to_have_text("live")
    page.evaluate("window.__sameDocument = true")

    # the loss chart grows from points pushed over the websocket, without a reload
    expect(page.locator("#live-points")).not_to_have_text("0", timeout=60_000)
    first = _points(page, "chart-loss-tokens")
    _wait_until(page, f"Number(document.getElementById('chart-loss-tokens').dataset.points) > {first}", 60)

    # every text the legend's incident key shows, recorded as it is shown: on a fast machine the
    # learner moves and heals within seconds, so "(1 open)" may be gone before it could be read
    page.evaluate("""() => {
      window.__incidentLegend = [];
      const legend = document.getElementById("marker-legend");
      new MutationObserver(() => {
        const key = legend.querySelector(".kind-incident");
        if (key) window.__incidentLegend.push(key.textContent);
      }).observe(legend, { childList: true, subtree: true, characterData: true });
    }""")

    # SIGKILL the worker of a learner's pool (like a host dying): an incident opens on the charts
    victim = Learner.objects.filter(job=job, state=Learner.State.RUNNING).select_related("pool").first()
    worker = f"{victim.pool.slug}-0"
    stack.kill_worker(worker)
    killed = time.monotonic()
    marker = page.locator("#chart-loss-time .marker.kind-incident").first
    expect(marker).to_be_attached(timeout=30_000)
    print(f"\nincident marker {time.monotonic() - killed:.1f} s after the kill")
    assert page.evaluate("window.__sameDocument") is True
    tip = marker.get_attribute("data-tip")
    assert re.search(rf"incident: .*learner {victim.index}\.", tip), tip
    expect(page.locator("#chart-loss-tokens .marker.kind-incident")).not_to_have_count(0)
    _wait_until(page, "window.__incidentLegend.some((t) => t.includes('1 incident (1 open)'))", 10)
    expect(page.locator("#marker-legend .kind-incident")).to_contain_text("1 incident")
    # keyboard focus (or the pointer) shows the tooltip: the CSS reads data-tip
    marker.focus()
    assert "learner" in page.evaluate(
        "el => getComputedStyle(el, '::after').content", marker.element_handle())
    marker.hover()
    assert Incident.objects.filter(job=job, learner=victim).exists()

    # the learner moves to the spare pool (a dashed marker) and the incident heals there
    expect(page.locator("#chart-loss-time .marker.kind-move").first).to_be_attached(timeout=60_000)
    assert victim.pool.slug not in page.locator("#chart-loss-time .marker.kind-move").first.get_attribute(
        "data-tip").split("→")[-1]
    stack.wait_for(lambda: not Incident.objects.filter(job=job, healed_at__isnull=True).exists(), timeout=90,
                   what="the incident to heal")
    expect(page.locator("#marker-legend .kind-incident")).not_to_contain_text("open", timeout=20_000)
    expect(page.locator("#chart-loss-time .marker.kind-incident.open")).to_have_count(0)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "job_markers.png"), full_page=True)
    Job.objects.filter(pk=job.pk).update(status=st.CANCELLED)
    assert not errors, errors


def _curve(job: Job, start: float, last_tokens: int) -> None:
    t0 = timezone.now() - timedelta(minutes=30)
    Job.objects.filter(pk=job.pk).update(started_at=t0, tokens_computed=last_tokens)
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, name="train_loss", step=x, value=start - x / 10_000,
                    time=t0 + timedelta(seconds=x / 500))
        for x in range(0, last_tokens + 1, 500))


def test_compare_view_overlays_two_jobs_and_shows_the_gap(dash, alice):
    live = dash.live
    spec = {"name": "x", "strategy": "decoupled", "learners": 1}
    base = Job.objects.create(owner=alice, name="baseline-run", spec=spec, status="completed")
    other = Job.objects.create(owner=alice, name="other-run", spec=spec, status="completed")
    _curve(base, 3.0, 10_000)
    _curve(other, 3.3, 5_000)
    login(dash, live, "alice", "pw-alice-123")

    # select both rows on the jobs list, then Compare
    dash.goto(f"{live.url}/jobs/")
    dash.get_by_label(f"Compare job #{base.pk}").check()
    dash.get_by_label(f"Compare job #{other.pk}").check()
    dash.get_by_role("button", name="Compare selected").click()
    dash.wait_for_url(re.compile(r"/compare/\?jobs="))
    expect(dash.get_by_role("heading", name="Compare jobs")).to_be_visible()

    for chart in ("chart-compare-tokens", "chart-compare-time"):
        expect(dash.locator(f"#{chart}")).to_have_attribute("data-series", "2")
        expect(dash.locator(f"#{chart} canvas")).to_have_count(1)
    legend = dash.locator("#chart-compare-tokens .u-legend")
    expect(legend).to_contain_text("baseline-run")
    expect(legend).to_contain_text("other-run")
    # the jobs list shows newest first, so the newer job is the baseline unless pinned
    table = dash.get_by_role("table", name="Gap to the baseline")
    dash.goto(f"{live.url}/compare/?jobs={base.pk},{other.pk}")
    expect(table.locator(f'tr[data-job="{base.pk}"] [data-field="gap"]')).to_have_text("baseline")
    expect(table.locator(f'tr[data-job="{other.pk}"] [data-field="gap"]')).to_have_text("+12.00 %")

    # pin the other run instead: the gap is now measured from it
    dash.get_by_role("link", name="pin as baseline").click()
    expect(table.locator(f'tr[data-job="{other.pk}"] [data-field="gap"]')).to_have_text("baseline")
    expect(table.locator(f'tr[data-job="{base.pk}"] [data-field="gap"]')).to_have_text("-10.71 %")
    dash.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)

    # an id nobody may see: a clear message, no error page
    dash.goto(f"{live.url}/compare/?jobs=999999")
    expect(dash.get_by_role("alert")).to_contain_text("no job 999999 exists that you may see")
