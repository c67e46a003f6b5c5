"""Login required; owners see their jobs, staff see all, others get 404."""
from __future__ import annotations

import pytest

PAGES = ["/", "/fleet/", "/fleet/h100-east/", "/jobs/", "/jobs/new", "/account/tokens/"]


@pytest.mark.django_db
@pytest.mark.parametrize("url", PAGES + ["/jobs/1/", "/jobs/1/series.json"])
def test_login_required(client, fleet, url):
    resp = client.get(url)
    assert resp.status_code == 302
    assert resp["Location"].startswith("/accounts/login/")


@pytest.mark.django_db
def test_login_page_renders_and_logs_in(client, alice):
    resp = client.get("/accounts/login/")
    assert resp.status_code == 200
    assert b'name="username"' in resp.content and b"csrfmiddlewaretoken" in resp.content
    bad = client.post("/accounts/login/", {"username": "alice", "password": "nope"})
    assert b"didn&#x27;t match" in bad.content or b"didn't match" in bad.content
    ok = client.post("/accounts/login/", {"username": "alice", "password": "pw-alice-123"})
    assert ok.status_code == 302 and ok["Location"] == "/"


@pytest.mark.django_db
@pytest.mark.parametrize("url", PAGES)
def test_pages_render(client, alice, fleet, url):
    client.force_login(alice)
    resp = client.get(url)
    assert resp.status_code == 200
    assert b"<main" in resp.content


@pytest.mark.django_db
def test_owner_and_staff_see_job_others_get_404(client, alice, bob, staff_user, job_factory):
    job = job_factory(alice, name="alices-run")
    client.force_login(alice)
    assert client.get(f"/jobs/{job.pk}/").status_code == 200
    assert client.get(f"/jobs/{job.pk}/series.json").status_code == 200
    client.force_login(bob)
    assert client.get(f"/jobs/{job.pk}/").status_code == 404
    assert client.get(f"/jobs/{job.pk}/series.json").status_code == 404
    assert client.post(f"/jobs/{job.pk}/cancel").status_code == 404
    assert b"alices-run" not in client.get("/jobs/").content
    assert b"alices-run" not in client.get("/").content
    client.force_login(staff_user)
    assert client.get(f"/jobs/{job.pk}/").status_code == 200
    assert b"alices-run" in client.get("/jobs/").content


@pytest.mark.django_db
def test_drain_is_staff_only_and_post_only(client, alice, staff_user, fleet):
    client.force_login(alice)
    resp = client.post("/fleet/h100-east/drain", {"state": "draining"})
    assert resp.status_code == 302 and "/admin/login/" in resp["Location"]
    fleet["h100-east"].refresh_from_db()
    assert fleet["h100-east"].state == "active"
    client.force_login(staff_user)
    assert client.get("/fleet/h100-east/drain").status_code == 405


@pytest.mark.django_db
def test_actions_need_csrf(alice, job_factory):
    from django.test import Client

    job = job_factory(alice)
    c = Client(enforce_csrf_checks=True)
    c.force_login(alice)
    assert c.post(f"/jobs/{job.pk}/cancel").status_code == 403
    job.refresh_from_db()
    assert job.status == "running"
