"""An Idempotency-Key replay must match the first request's team as well as its spec."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from apps.jobs.models import Job

pytestmark = pytest.mark.django_db

SPEC = {"name": "team replay", "learners": 2, "steps": 20, "inner_steps": 5}
URL = "/api/v1/jobs/"


def test_replay_with_another_team_is_a_conflict(as_alice, alice, vision):
    alice.groups.add(Group.objects.create(name="audio"))
    h = {"HTTP_IDEMPOTENCY_KEY": "ci-team-1"}
    first = as_alice.post(URL, {"spec": SPEC, "team": "vision"}, format="json", **h)
    assert first.status_code == 201, first.content
    for other in ("audio", ""):
        r = as_alice.post(URL, {"spec": SPEC, "team": other}, format="json", **h)
        assert r.status_code == 409, (other, r.content)
        assert "ci-team-1" in r.json()["detail"] and "team" in r.json()["detail"]
    no_team = as_alice.post(URL, {"spec": SPEC}, format="json", **h)  # team left out means ""
    assert no_team.status_code == 409
    assert list(Job.objects.values_list("team", flat=True)) == ["vision"]
    # the same team is still a plain replay
    again = as_alice.post(URL, {"spec": SPEC, "team": "vision"}, format="json", **h)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"


def test_replay_of_a_teamless_job_with_a_team_is_a_conflict(as_alice, vision):
    h = {"HTTP_IDEMPOTENCY_KEY": "ci-team-2"}
    assert as_alice.post(URL, {"spec": SPEC}, format="json", **h).status_code == 201
    r = as_alice.post(URL, {"spec": SPEC, "team": "vision"}, format="json", **h)
    assert r.status_code == 409
    assert Job.objects.get().team == ""
