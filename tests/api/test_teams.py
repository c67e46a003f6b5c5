"""Teams: a job submitted for a team is seen and acted on by its members, and nobody else."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from apps.jobs.models import Checkpoint, Event, Incident, Job

from .conftest import client_for

pytestmark = pytest.mark.django_db

SPEC = {"name": "team run", "learners": 2, "steps": 20, "inner_steps": 5}


def test_team_must_exist_and_be_yours(as_alice, alice, staff_user, vision):
    Group.objects.create(name="audio")
    missing = as_alice.post("/api/v1/jobs/", {"spec": SPEC, "team": "nope"}, format="json")
    assert missing.status_code == 400
    assert "no team 'nope'" in missing.json()["errors"]["team"][0]
    other = as_alice.post("/api/v1/jobs/", {"spec": SPEC, "team": "audio"}, format="json")
    assert other.status_code == 400
    assert other.json()["errors"]["team"] == ["You are not a member of team 'audio'."]
    dry = as_alice.post("/api/v1/jobs/dry-run/", {"spec": SPEC, "team": "audio"}, format="json")
    assert dry.status_code == 400 and "team" in dry.json()["errors"]
    assert not Job.objects.exists()
    ok = as_alice.post("/api/v1/jobs/", {"spec": SPEC, "team": "vision"}, format="json")
    assert ok.status_code == 201 and ok.json()["team"] == "vision"
    # staff may file a job under any existing team
    staff = client_for(staff_user).post("/api/v1/jobs/", {"spec": SPEC, "team": "audio"}, format="json")
    assert staff.status_code == 201


def test_teammates_see_and_act_others_do_not(alice, bob, carol, vision, pool_a):
    r = client_for(alice).post("/api/v1/jobs/", {"spec": SPEC, "team": "vision"}, format="json")
    job = Job.objects.get(pk=r.json()["id"])
    private = client_for(alice).post("/api/v1/jobs/", {"spec": {**SPEC, "name": "mine"}}, format="json")
    now = timezone.now()
    Incident.objects.create(job=job, failed_at=now, description="lost one")
    Checkpoint.objects.create(job=job, version=1, blob_uri="file:///nowhere", size_bytes=1, sha256="0" * 64)
    as_bob, as_carol = client_for(bob), client_for(carol)

    listed = [j["id"] for j in as_bob.get("/api/v1/jobs/").json()["results"]]
    assert listed == [job.pk]  # the team's job, not alice's private one
    assert as_bob.get(f"/api/v1/jobs/{job.pk}/").status_code == 200
    assert as_bob.get(f"/api/v1/jobs/{private.json()['id']}/").status_code == 404
    assert [e["job"] for e in as_bob.get(f"/api/v1/events/?job={job.pk}").json()["results"]] != []
    assert as_bob.get("/api/v1/incidents/").json()["count"] == 1
    assert as_bob.get(f"/api/v1/checkpoints/?job={job.pk}").json()["count"] == 1

    assert as_carol.get("/api/v1/jobs/").json()["count"] == 0
    assert as_carol.get(f"/api/v1/jobs/{job.pk}/").status_code == 404
    assert as_carol.get("/api/v1/incidents/").json()["count"] == 0
    assert as_carol.get(f"/api/v1/checkpoints/?job={job.pk}").json()["count"] == 0
    assert as_carol.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 404

    r = as_bob.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    # the status reason and the timeline say which teammate did it
    assert r.json()["status_reason"] == "cancelled by bob through the API"
    assert Event.objects.filter(job=job, payload__reason="cancelled by bob through the API").exists()

    # leaving the team ends the access
    bob.groups.remove(vision)
    assert as_bob.get(f"/api/v1/jobs/{job.pk}/").status_code == 404


def test_me_lists_your_teams(alice, carol, vision):
    assert client_for(alice).get("/api/v1/auth/me/").json()["teams"] == ["vision"]
    assert client_for(carol).get("/api/v1/auth/me/").json()["teams"] == []
