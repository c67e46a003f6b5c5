"""Teams on the dashboard: teammates see the job, its page and its learners; the form offers your teams."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from apps.jobs.models import Job

from .test_jobs import _form


@pytest.mark.django_db
def test_teammate_sees_and_acts_outsider_gets_404(client, alice, bob, carol, vision, job_factory):
    shared = job_factory(alice, name="shared-run", team="vision")
    private = job_factory(alice, name="private-run")
    client.force_login(bob)
    page = client.get(f"/jobs/{shared.pk}/")
    assert page.status_code == 200
    body = page.content.decode()
    assert '<span id="job-owner">alice</span> · team <span id="job-team">vision</span>' in body
    assert client.get(f"/jobs/{shared.pk}/series.json").status_code == 200
    assert client.get(f"/jobs/{private.pk}/").status_code == 404
    listing = client.get("/jobs/").content
    assert b"shared-run" in listing and b"private-run" not in listing
    assert b"shared-run" in client.get("/fleet/h100-east/").content  # its learners on the pool page
    assert client.post(f"/jobs/{shared.pk}/cancel").status_code == 302
    shared.refresh_from_db()
    assert shared.status == "cancelled"

    client.force_login(carol)
    assert client.get(f"/jobs/{shared.pk}/").status_code == 404
    assert b"shared-run" not in client.get("/jobs/").content
    assert b"shared-run" not in client.get("/fleet/h100-east/").content


@pytest.mark.django_db(transaction=True)
def test_new_job_form_offers_your_teams(client, alice, bob, fleet):
    client.force_login(alice)
    assert 'name="team"' not in client.get("/jobs/new").content.decode()  # no teams, no field
    Group.objects.create(name="audio")
    alice.groups.add(Group.objects.create(name="vision"))
    body = client.get("/jobs/new").content.decode()
    assert 'name="team"' in body and ">vision<" in body and ">audio<" not in body
    bad = client.post("/jobs/new", _form(name="x", team="audio", action="submit"))
    assert bad.status_code == 200 and "team" in bad.context["form"].errors
    resp = client.post("/jobs/new", _form(name="for-vision", team="vision", learners="2", action="submit"))
    assert resp.status_code == 302, resp.context["form"].errors if resp.context else resp
    job = Job.objects.get(name="for-vision")
    assert job.team == "vision" and job.owner == alice
    client.force_login(bob)
    assert client.get(f"/jobs/{job.pk}/").status_code == 404
    bob.groups.add(Group.objects.get(name="vision"))
    assert client.get(f"/jobs/{job.pk}/").status_code == 200
