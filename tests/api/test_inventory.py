"""Accelerator types, pools, nodes: signed-in users read, staff write; pool actions."""
from __future__ import annotations

import pytest

from apps.inventory.models import Node, Pool
from apps.jobs.models import Event

from .conftest import client_for

pytestmark = pytest.mark.django_db

NEW_POOL = {"slug": "pool-new", "name": "New", "region": "eu", "provider": "aws", "accelerator": "test-cpu",
            "device_count": 8, "cost_per_device_hour": 2.5, "link_gbps": 5}


def test_read_for_everyone_signed_in(as_alice, anon, pool_a, pool_b, token_a):
    Node.objects.create(pool=pool_a, hostname="h1", worker_name="w1@h1")
    r = as_alice.get("/api/v1/pools/")
    assert r.status_code == 200
    rows = r.json()["results"]
    assert [p["slug"] for p in rows] == ["pool-a", "pool-b"]
    a = rows[0]
    assert a["accelerator"] == "test-cpu" and a["nodes_online"] == 1 and a["total_peak_tflops"] == 8.0
    assert a["cost_per_hour"] == 6.0 and a["total_watts"] == 800
    assert as_alice.get("/api/v1/pools/pool-b/").json()["speed_factor"] == 0.5
    assert as_alice.get("/api/v1/accelerator-types/test-cpu/").json()["tdp_watts"] == 200
    assert as_alice.get("/api/v1/nodes/?pool=pool-a").json()["count"] == 1
    assert as_alice.get("/api/v1/nodes/?pool=pool-b").json()["count"] == 0
    for url in ("/api/v1/pools/", "/api/v1/nodes/", "/api/v1/accelerator-types/"):
        assert anon.get(url).status_code == 401
        assert client_for(token=token_a).get(url).status_code == 401  # worker tokens are not people


def test_filters(as_alice, pool_a, pool_b):
    Pool.objects.filter(pk=pool_b.pk).update(state="draining")
    assert [p["slug"] for p in as_alice.get("/api/v1/pools/?state=draining").json()["results"]] == ["pool-b"]
    assert [p["slug"] for p in as_alice.get("/api/v1/pools/?search=us-east").json()["results"]] == ["pool-b"]


def test_write_is_staff_only(as_alice, as_staff, accel):
    r = as_alice.post("/api/v1/pools/", NEW_POOL, format="json")
    assert r.status_code == 403 and r.json()["detail"] == "Only staff may change the fleet."
    r = as_staff.post("/api/v1/pools/", NEW_POOL, format="json")
    assert r.status_code == 201, r.content
    created = r.json()
    assert created["nodes_online"] == 0 and created["learners_running"] == 0 and created["state"] == "active"
    assert Pool.objects.get(slug="pool-new").device_count == 8
    assert as_alice.patch("/api/v1/pools/pool-new/", {"device_count": 1}, format="json").status_code == 403
    r = as_staff.patch("/api/v1/pools/pool-new/", {"device_count": 1}, format="json")
    assert r.status_code == 200 and r.json()["device_count"] == 1
    assert as_alice.delete("/api/v1/pools/pool-new/").status_code == 403
    assert as_staff.delete("/api/v1/pools/pool-new/").status_code == 204


def test_write_validation(as_staff, accel):
    bad = {**NEW_POOL, "slug": "has space", "device_count": -1, "accelerator": "nope", "link_gbps": "fast"}
    r = as_staff.post("/api/v1/pools/", bad, format="json")
    assert r.status_code == 400
    assert set(r.json()["errors"]) == {"slug", "device_count", "accelerator", "link_gbps"}
    r = as_staff.post("/api/v1/pools/", {**NEW_POOL, "state": "active"}, format="json")
    assert r.status_code == 400 and r.json()["errors"] == {"state": ["Unknown field."]}


def test_protected_delete_is_409(as_staff, pool_a):
    r = as_staff.delete("/api/v1/accelerator-types/test-cpu/")
    assert r.status_code == 409 and "pool-a" in r.json()["detail"]


@pytest.mark.parametrize(("action", "state"), [("drain", "draining"), ("disable", "disabled"),
                                               ("activate", "active")])
def test_pool_actions(as_staff, as_alice, pool_a, action, state):
    if action == "activate":
        Pool.objects.filter(pk=pool_a.pk).update(state="disabled")
    assert as_alice.post(f"/api/v1/pools/pool-a/{action}/").status_code == 403
    r = as_staff.post(f"/api/v1/pools/pool-a/{action}/")
    assert r.status_code == 200 and r.json()["state"] == state
    assert Pool.objects.get(pk=pool_a.pk).state == state
    ev = Event.objects.filter(pool=pool_a).latest("time")
    assert ev.payload["to"] == state and ev.payload["by"] == "olga"


def test_nodes_staff_edit(as_staff, as_alice, pool_a, pool_b):
    n = Node.objects.create(pool=pool_a, hostname="h1", worker_name="w1@h1")
    assert as_alice.patch(f"/api/v1/nodes/{n.pk}/", {"state": "draining"}, format="json").status_code == 403
    r = as_staff.patch(f"/api/v1/nodes/{n.pk}/", {"state": "draining", "pool": "pool-b"}, format="json")
    assert r.status_code == 200 and r.json()["pool"] == "pool-b"
    assert as_staff.delete(f"/api/v1/nodes/{n.pk}/").status_code == 204


def test_duplicate_slugs_are_400_not_500(as_staff, pool_a, accel):
    r = as_staff.post("/api/v1/pools/", {**NEW_POOL, "slug": "pool-a"}, format="json")
    assert r.status_code == 400 and r.json()["errors"]["slug"] == ["A pool with this slug exists."]
    body = {"slug": "test-cpu", "vendor": "V", "model": "M", "kind": "cpu", "generation": "g", "year": 2024,
            "memory_gib": 1, "peak_bf16_tflops": 1, "tdp_watts": 1}
    r = as_staff.post("/api/v1/accelerator-types/", body, format="json")
    assert r.status_code == 400 and "slug" in r.json()["errors"]
    r = as_staff.patch("/api/v1/pools/pool-a/", {"slug": "pool-a"}, format="json")  # its own slug is fine
    assert r.status_code == 200
