"""Fixtures of the API tests: personas with tokens, a two-pool fleet, jobs with learners."""
from __future__ import annotations

import itertools

import pytest
from rest_framework.test import APIClient

from apps.api.models import ApiToken
from apps.inventory.models import AcceleratorType, Pool, PoolToken
from apps.jobs.models import Job, Learner
from trainer.spec import JobSpec

_cache_ids = itertools.count()


@pytest.fixture(autouse=True)
def _isolated_cache(settings):
    """Each test gets its own throttle counters; fast password hashing for the personas."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"api-test-{next(_cache_ids)}"}}


def client_for(user=None, token: str | None = None) -> APIClient:
    c = APIClient()
    if user is not None and token is None:
        _, token = ApiToken.issue(user, "test")
    if token:
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return c


@pytest.fixture
def anon():
    return APIClient()


@pytest.fixture
def as_alice(alice):
    return client_for(alice)


@pytest.fixture
def as_bob(bob):
    return client_for(bob)


@pytest.fixture
def as_staff(staff_user):
    return client_for(staff_user)


@pytest.fixture
def accel(db):
    return AcceleratorType.objects.create(slug="test-cpu", vendor="Test", model="CPU X", kind="cpu",
                                          generation="x86", year=2024, memory_gib=16, peak_bf16_tflops=2.0,
                                          tdp_watts=200)


@pytest.fixture
def pool_a(accel):
    return Pool.objects.create(slug="pool-a", name="Pool A", region="eu-west", accelerator=accel,
                               device_count=4, cost_per_device_hour="1.5", link_gbps=10)


@pytest.fixture
def pool_b(accel):
    return Pool.objects.create(slug="pool-b", name="Pool B", region="us-east", accelerator=accel,
                               device_count=2, cost_per_device_hour="0.5", link_gbps=1, speed_factor=0.5)


@pytest.fixture
def token_a(pool_a):
    return PoolToken.issue(pool_a)[1]


@pytest.fixture
def token_b(pool_b):
    return PoolToken.issue(pool_b)[1]


def spec_dict(**over) -> dict:
    return JobSpec.model_validate({"name": "t", "learners": 2, "steps": 10, **over}).model_dump(mode="json")


def make_job(owner, status="running", pool=None, learners=2, **over) -> Job:
    spec = spec_dict(learners=learners, **over)
    job = Job.objects.create(owner=owner, name=spec["name"], spec=spec, status=status)
    for i in range(learners):
        Learner.objects.create(job=job, index=i, pool=pool, state=Learner.State.RUNNING, work_size=20)
    return job


@pytest.fixture
def alice_job(alice, pool_a):
    return make_job(alice, pool=pool_a)
