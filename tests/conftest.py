"""Shared fixtures. The suite runs against PostgreSQL and Redis (see the Makefile)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture
def staff_user(django_user_model):
    return django_user_model.objects.create_user(
        "olga", "olga@example.com", "pw-olga-123", is_staff=True, is_superuser=True
    )


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", "alice@example.com", "pw-alice-123")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", "bob@example.com", "pw-bob-123")
