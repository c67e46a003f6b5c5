"""apps.api.fast_output: the compiled output equals DRF's own, field for field and type for type."""
from __future__ import annotations

import datetime as dt
import json

import pytest
from django.utils import timezone
from rest_framework import serializers

from apps.api import serializers as s
from apps.api.fast_output import FastOutputMixin, compile_fields
from apps.api.views.jobs import visible_jobs
from apps.jobs.models import Job, Learner

from .conftest import make_job

pytestmark = pytest.mark.django_db


def drf_output(serializer_class, instance, **kw):
    """What DRF's Serializer.to_representation gives, bypassing the mixin."""
    ser = serializer_class(instance, **kw)
    return serializers.ModelSerializer.to_representation(ser, instance)


def same(a, b) -> bool:
    """Equal values of equal types (1 != 1.0 here), and the same JSON text, key order included."""
    return json.dumps(a) == json.dumps(b) and _types(a) == _types(b)


def _types(x):
    if isinstance(x, dict):
        return {k: _types(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_types(v) for v in x]
    return type(x).__name__


@pytest.fixture
def varied_jobs(alice, pool_a):
    """Jobs with nulls and values in every optional column, and one whose spec no longer validates."""
    done = make_job(alice, pool=pool_a, status="completed", learners=3)
    Job.objects.filter(pk=done.pk).update(
        started_at=timezone.now() - dt.timedelta(hours=1), finished_at=timezone.now(),
        initial_val_loss=5.5, final_val_loss=3.25, energy_j=12.0, cost=0.5, tokens_computed=10**12,
        status_reason="done", team="")
    fresh = make_job(alice, pool=pool_a, status="queued")
    broken = make_job(alice, pool=pool_a)
    Job.objects.filter(pk=broken.pk).update(spec={"learners": "many"})
    Learner.objects.filter(job=done).update(tokens=123)
    return [done.pk, fresh.pk, broken.pk]


def test_job_serializers_compile():
    assert compile_fields(s.JobSerializer()) is not None
    assert compile_fields(s.JobDetailSerializer()) is not None


def test_list_output_is_drfs(alice, varied_jobs):
    for job in visible_jobs(alice).filter(pk__in=varied_jobs):
        assert same(s.JobSerializer(job).data, drf_output(s.JobSerializer, job))


def test_detail_output_is_drfs(alice, varied_jobs):
    for job in visible_jobs(alice).filter(pk__in=varied_jobs):
        assert same(s.JobDetailSerializer(job).data, drf_output(s.JobDetailSerializer, job))


def test_unannotated_job_is_drfs(varied_jobs):
    """A job straight from the model (create, cancel): the method fields query what they need."""
    for job in Job.objects.filter(pk__in=varied_jobs):
        assert same(s.JobSerializer(job).data, drf_output(s.JobSerializer, job))


def test_a_reloaded_spec_is_read_again(alice_job):
    ser = s.JobSerializer(alice_job)
    before = ser.data["total_tokens"]
    Job.objects.filter(pk=alice_job.pk).update(spec={**alice_job.spec, "steps": alice_job.spec["steps"] * 2})
    alice_job.refresh_from_db()
    assert s.JobSerializer(alice_job).data["total_tokens"] == 2 * before


def test_naive_datetimes_and_uncovered_fields_keep_drfs_path(alice_job, settings):
    class WithUrl(FastOutputMixin, serializers.ModelSerializer):
        link = serializers.URLField(source="name")

        class Meta:
            model = Job
            fields = ["id", "link", "created_at"]

    assert compile_fields(WithUrl()) is None  # a field kind it does not reproduce: DRF's path
    assert WithUrl(alice_job).data == drf_output(WithUrl, alice_job)

    class Stamp(FastOutputMixin, serializers.Serializer):
        at = serializers.DateTimeField()

    naive = {"at": dt.datetime(2026, 1, 2, 3, 4, 5)}  # noqa: DTZ001 - the case under test
    assert Stamp(naive).data == {"at": serializers.DateTimeField().to_representation(naive["at"])}
