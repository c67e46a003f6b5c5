"""Shared fixtures. The suite runs against PostgreSQL and Redis (see the Makefile)."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture(autouse=True)
def _flush_denormal_left_off():
    """A learner built in-process turns on flush-to-zero (TrainConfig.flush_denormal), a flag of the
    whole process: later tests would see subnormals as 0 (the form's float bounds did: the next
    double above 0 read as 0 in the full suite). Each test starts with it off."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_flush_denormal(False)


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


@pytest.fixture
def carol(django_user_model):
    return django_user_model.objects.create_user("carol", "carol@example.com", "pw-carol-123")


@pytest.fixture
def vision(alice, bob):
    """A team (a Django group) with alice and bob in it."""
    from django.contrib.auth.models import Group

    team = Group.objects.create(name="vision")
    alice.groups.add(team)
    bob.groups.add(team)
    return team


@pytest.fixture
def tripwire(tmp_path, monkeypatch):
    """A file that tests.support.tripwire writes if the platform ever imports or calls it."""
    import sys

    mark = tmp_path / "tripwire"
    monkeypatch.setenv("DILOCO_TRIPWIRE", str(mark))
    sys.modules.pop("tests.support.tripwire", None)
    return mark


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Run the browser tests last.

    Playwright's sync API keeps an event loop running in the main thread for the rest of
    the session; pytest-asyncio tests collected after it would fail to start their own.
    """
    browser = [i for i in items if "tests/browser/" in i.nodeid or i.nodeid.startswith("browser/")]
    if browser:
        rest = [i for i in items if i not in browser]
        items[:] = rest + browser
