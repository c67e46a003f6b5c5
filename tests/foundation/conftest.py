"""Fixtures for the foundation tests: a small fleet on the seeded catalogue."""

from __future__ import annotations

import importlib

import pytest

from apps.inventory.models import AcceleratorType, Node, Pool


@pytest.fixture
def catalogue(db):
    """The seeded catalogue. A transactional test elsewhere in the suite (without
    serialized_rollback) truncates tables, migration data included: seed again then."""
    from django.apps import apps

    mig = importlib.import_module("apps.inventory.migrations.0003_catalogue")
    if AcceleratorType.objects.count() < len(mig.CATALOGUE):
        mig.seed(apps, None)
    return {a.slug: a for a in AcceleratorType.objects.all()}


@pytest.fixture
def fleet(catalogue):
    h100 = AcceleratorType.objects.get(slug="h100-sxm")
    v5e = AcceleratorType.objects.get(slug="tpu-v5e")
    a = Pool.objects.create(
        slug="iad-h100",
        name="IAD H100",
        region="us-east",
        provider="aws",
        accelerator=h100,
        device_count=8,
        cost_per_device_hour="4.50",
        link_gbps=5,
    )
    b = Pool.objects.create(
        slug="ams-v5e",
        name="AMS v5e",
        region="eu-west",
        provider="gcp",
        accelerator=v5e,
        device_count=16,
        cost_per_device_hour="1.20",
        link_gbps=2,
        state=Pool.State.DRAINING,
    )
    Node.objects.create(pool=a, hostname="h1", worker_name="iad-h100@h1", devices=[{"kind": "cuda"}])
    Node.objects.create(pool=a, hostname="h2", worker_name="iad-h100@h2", state=Node.State.LOST)
    return {"h100": a, "v5e": b}
