"""Fixtures of the sites tests."""
from __future__ import annotations

import os
import secrets

import pytest

needs_services = pytest.mark.skipif(
    not os.environ.get("REDIS_URL") or "postgres" not in os.environ.get("DATABASE_URL", ""),
    reason="pool credentials need PostgreSQL (DATABASE_URL) and Redis (REDIS_URL)",
)


@pytest.fixture
def make_pool(transactional_db):
    """A pool with a fresh slug (database roles and Redis users are shared by every test run on
    the machine: names never collide)."""
    from apps.inventory.models import AcceleratorType, Pool

    def make(prefix: str = "site", slots: int = 2) -> Pool:
        acc = AcceleratorType.objects.filter(kind="cpu").first() or AcceleratorType.objects.create(
            slug="test-cpu", vendor="Generic", model="CPU core", kind="cpu", generation="x86-64",
            year=2024, memory_gib=8, peak_bf16_tflops=0.5, tdp_watts=15)
        return Pool.objects.create(slug=f"{prefix}-{secrets.token_hex(3)}", name=prefix, region="local",
                                   accelerator=acc, device_count=slots, link_gbps=10.0)

    return make


@pytest.fixture
def pool_credentials(transactional_db):
    """provision_pool_credentials(slug) -> env; every role and Redis user made is revoked after
    (PostgreSQL roles are cluster-wide, the Redis server is shared)."""
    from apps.inventory.credentials import provision_pool_credentials, revoke_pool_credentials, role_name

    made: list[str] = []

    def provision(slug: str, **kwargs) -> dict[str, str]:
        role_name(slug)  # a slug that cannot name credentials raises here
        made.append(slug)
        return provision_pool_credentials(slug, **kwargs)

    try:
        yield provision
    finally:
        for slug in made:
            revoke_pool_credentials(slug)
