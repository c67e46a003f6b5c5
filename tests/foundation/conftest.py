"""Fixtures for the foundation tests: a small fleet on the seeded catalogue."""
from __future__ import annotations

import pytest

from apps.inventory.models import AcceleratorType, Node, Pool


@pytest.fixture
def fleet(db):
    h100 = AcceleratorType.objects.get(slug="h100-sxm")
    v5e = AcceleratorType.objects.get(slug="tpu-v5e")
    a = Pool.objects.create(slug="iad-h100", name="IAD H100", region="us-east", provider="aws",
                            accelerator=h100, device_count=8, cost_per_device_hour="4.50", link_gbps=5)
    b = Pool.objects.create(slug="ams-v5e", name="AMS v5e", region="eu-west", provider="gcp",
                            accelerator=v5e, device_count=16, cost_per_device_hour="1.20", link_gbps=2,
                            state=Pool.State.DRAINING)
    Node.objects.create(pool=a, hostname="h1", worker_name="iad-h100@h1", devices=[{"kind": "cuda"}])
    Node.objects.create(pool=a, hostname="h2", worker_name="iad-h100@h2", state=Node.State.LOST)
    return {"h100": a, "v5e": b}
