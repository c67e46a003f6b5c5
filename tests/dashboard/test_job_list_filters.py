"""The jobs list's filters live in the URL: status, owner, team, pool and text, combined."""
from __future__ import annotations

import html
import re

import pytest

from apps.jobs.models import Job


def names(body: str) -> set[str]:
    return set(re.findall(r"#\d+ (job-[a-z0-9-]+)</a>", body))


@pytest.fixture
def jobs(alice, bob, vision, job_factory, fleet):
    h100, a100 = fleet["h100-east"], fleet["a100-west"]
    job_factory(alice, name="job-a-run-h100", status="running", pools=[h100])
    job_factory(alice, name="job-a-done-a100", status="completed", pools=[a100], team="vision")
    job_factory(bob, name="job-b-run-a100", status="running", pools=[a100], team="vision")
    job_factory(bob, name="job-b-queued", status="queued", pools=[h100])


@pytest.mark.django_db
@pytest.mark.parametrize(("query", "expected"), [
    ("", {"job-a-run-h100", "job-a-done-a100", "job-b-run-a100", "job-b-queued"}),
    ("?owner=alice", {"job-a-run-h100", "job-a-done-a100"}),
    ("?team=vision", {"job-a-done-a100", "job-b-run-a100"}),
    ("?pool=a100-west", {"job-a-done-a100", "job-b-run-a100"}),
    ("?status=running&pool=a100-west", {"job-b-run-a100"}),
    ("?owner=bob&team=vision&q=run", {"job-b-run-a100"}),
    ("?status=active&owner=alice", {"job-a-run-h100"}),
    ("?owner=nobody", set()),
    ("?pool=no-such-pool", set()),
    ("?status=nonsense&owner=bob", {"job-b-run-a100", "job-b-queued"}),  # unknown status: ignored
])
def test_filters_combine(client, staff_user, jobs, query, expected):
    client.force_login(staff_user)
    resp = client.get("/jobs/" + query)
    assert resp.status_code == 200
    assert names(resp.content.decode()) == expected


@pytest.mark.django_db
def test_filters_are_only_over_visible_jobs(client, carol, jobs):
    client.force_login(carol)  # in no team, owns nothing
    body = client.get("/jobs/?owner=alice").content.decode()
    assert names(body) == set()
    assert '<option value="bob"' not in body and '<option value="vision"' not in body  # choices: own jobs


@pytest.mark.django_db
def test_the_form_and_links_keep_the_filters(client, staff_user, jobs, job_factory, alice):
    for i in range(26):  # a second page
        job_factory(alice, name=f"job-extra-{i}", status="running")
    client.force_login(staff_user)
    body = client.get("/jobs/?owner=alice&team=&pool=h100-east&q=job").content.decode()
    assert '<option value="alice" selected>' in body and '<option value="h100-east" selected>' in body
    # the status chips keep the other filters
    running = re.search(r'<a class="chip[^"]*"\s+href="([^"]*status=running[^"]*)"', body).group(1)
    assert html.unescape(running) == "?status=running&owner=alice&pool=h100-east&q=job"
    # so do the pages
    older = re.search(r'href="([^"]*)">Older', body).group(1)
    assert html.unescape(older) == "?owner=alice&pool=h100-east&q=job&page=2"
    page2 = client.get(html.unescape(older)).content.decode()
    assert names(page2) and all(n.startswith("job-") for n in names(page2))
    assert Job.objects.filter(owner=alice).count() == 28
