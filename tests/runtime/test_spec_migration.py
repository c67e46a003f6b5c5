"""Jobs stored before `fragment_mode`, `outer_momentum_decay` or `final_average` existed keep the
strided fragments, the undecayed outer momentum and the last outer step they ran with."""
from __future__ import annotations

import importlib

import pytest
from django.apps import apps as django_apps

from apps.coordinator.common import job_spec
from apps.jobs.models import Job

from .conftest import TINY

pytestmark = pytest.mark.django_db

migration = importlib.import_module("apps.jobs.migrations.0003_spec_fragment_mode")
decay_migration = importlib.import_module("apps.jobs.migrations.0004_spec_outer_momentum_decay")
average_migration = importlib.import_module("apps.jobs.migrations.0005_spec_final_average")


def test_old_specs_keep_strided_and_new_ones_are_left_alone(owner):
    assert "fragment_mode" not in TINY
    old = Job.objects.create(owner=owner, name="old", spec={**TINY})
    new = Job.objects.create(owner=owner, name="new", spec={**TINY, "fragment_mode": "balanced"})
    migration.keep_strided(django_apps, None)
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.spec["fragment_mode"] == "strided" and job_spec(old).fragment_mode == "strided"
    assert new.spec["fragment_mode"] == "balanced"
    assert {k: v for k, v in old.spec.items() if k != "fragment_mode"} == TINY


def test_old_specs_keep_their_outer_momentum_to_the_end_and_new_ones_are_left_alone(owner):
    assert "outer_momentum_decay" not in TINY
    old = Job.objects.create(owner=owner, name="old", spec={**TINY})
    new = Job.objects.create(owner=owner, name="new", spec={**TINY, "outer_momentum_decay": 7})
    decay_migration.keep_momentum(django_apps, None)
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.spec["outer_momentum_decay"] == 0 and job_spec(old).outer_momentum_decay == 0
    assert new.spec["outer_momentum_decay"] == 7
    assert {k: v for k, v in old.spec.items() if k != "outer_momentum_decay"} == TINY


def test_old_specs_keep_their_last_outer_step_and_new_ones_are_left_alone(owner):
    assert "final_average" not in TINY
    old = Job.objects.create(owner=owner, name="old", spec={**TINY})
    new = Job.objects.create(owner=owner, name="new", spec={**TINY, "final_average": True})
    average_migration.keep_outer_step(django_apps, None)
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.spec["final_average"] is False and job_spec(old).final_average is False
    assert new.spec["final_average"] is True
    assert {k: v for k, v in old.spec.items() if k != "final_average"} == TINY
