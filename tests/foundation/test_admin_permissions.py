"""Admin actions are guarded by the model permissions (issue 35, Medium 6).

Staff with only `view_pool` could issue a live worker token and drain a pool; with only
`view_job` they reached "Cancel selected jobs". Each action now needs `change` on its model,
and issuing a worker token also needs `inventory.add_pooltoken`.
"""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse

from apps.inventory.models import Node, Pool, PoolToken
from apps.jobs import state as st
from apps.jobs.models import Job

pytestmark = pytest.mark.django_db


def _staff(django_user_model, *codenames: str):
    user = django_user_model.objects.create_user("viewer", "v@example.com", "pw-viewer-123", is_staff=True)
    for code in codenames:
        app, name = code.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=name))
    return django_user_model.objects.get(pk=user.pk)  # a fresh instance: no permission cache


def _actions(client, url: str) -> set[str]:
    resp = client.get(url)
    assert resp.status_code == 200
    form = resp.context.get("action_form")
    if form is None:
        return set()
    return {value for value, _label in form.fields["action"].choices if value}


def test_view_only_staff_cannot_issue_a_worker_token_or_drain(client, django_user_model, fleet):
    client.force_login(_staff(django_user_model, "inventory.view_pool"))
    pool = Pool.objects.filter(state=Pool.State.ACTIVE).first()
    url = reverse("admin:inventory_pool_changelist")
    assert _actions(client, url) == set()
    before = PoolToken.objects.count()
    resp = client.post(url, {"action": "issue_token", "_selected_action": [pool.pk]}, follow=True)
    assert "DILOCO_POOL_TOKEN" not in resp.content.decode()
    assert PoolToken.objects.count() == before
    client.post(url, {"action": "drain", "_selected_action": [pool.pk]})
    pool.refresh_from_db()
    assert pool.state == Pool.State.ACTIVE


def test_change_pool_without_add_token_can_drain_but_not_issue(client, django_user_model, fleet):
    client.force_login(_staff(django_user_model, "inventory.view_pool", "inventory.change_pool"))
    pool = Pool.objects.filter(state=Pool.State.ACTIVE).first()
    url = reverse("admin:inventory_pool_changelist")
    assert _actions(client, url) == {"drain", "activate", "disable"}
    before = PoolToken.objects.count()
    client.post(url, {"action": "issue_token", "_selected_action": [pool.pk]})
    assert PoolToken.objects.count() == before
    client.post(url, {"action": "drain", "_selected_action": [pool.pk]})
    pool.refresh_from_db()
    assert pool.state == Pool.State.DRAINING


def test_change_pool_and_add_token_issues_a_token(client, django_user_model, fleet):
    client.force_login(_staff(django_user_model, "inventory.change_pool", "inventory.add_pooltoken"))
    pool = Pool.objects.filter(state=Pool.State.ACTIVE).first()
    url = reverse("admin:inventory_pool_changelist")
    assert "issue_token" in _actions(client, url)
    resp = client.post(url, {"action": "issue_token", "_selected_action": [pool.pk]}, follow=True)
    assert "DILOCO_POOL_TOKEN=" in resp.content.decode()
    assert PoolToken.objects.filter(pool=pool).exists()


def test_view_only_staff_cannot_act_on_nodes_or_revoke_tokens(client, django_user_model, fleet):
    client.force_login(_staff(django_user_model, "inventory.view_node", "inventory.view_pooltoken"))
    node = Node.objects.filter(state=Node.State.ONLINE).first()
    url = reverse("admin:inventory_node_changelist")
    assert _actions(client, url) == set()
    client.post(url, {"action": "disable", "_selected_action": [node.pk]})
    node.refresh_from_db()
    assert node.state != Node.State.OFFLINE
    tok, _ = PoolToken.issue(node.pool)
    url = reverse("admin:inventory_pooltoken_changelist")
    assert _actions(client, url) == set()
    client.post(url, {"action": "revoke", "_selected_action": [tok.pk]})
    tok.refresh_from_db()
    assert tok.revoked_at is None


def test_view_only_staff_cannot_cancel_jobs(client, django_user_model, fleet, alice):
    job = Job.objects.create(owner=alice, name="run", spec={"name": "run", "learners": 1})
    client.force_login(_staff(django_user_model, "jobs.view_job"))
    url = reverse("admin:jobs_job_changelist")
    assert _actions(client, url) == set()
    resp = client.post(url, {"action": "cancel", "_selected_action": [job.pk]}, follow=True)
    assert resp.status_code == 200
    job.refresh_from_db()
    assert job.status == st.QUEUED


def test_change_job_may_cancel(client, django_user_model, fleet, alice):
    job = Job.objects.create(owner=alice, name="run", spec={"name": "run", "learners": 1})
    client.force_login(_staff(django_user_model, "jobs.view_job", "jobs.change_job"))
    url = reverse("admin:jobs_job_changelist")
    assert {"cancel", "pause", "resume"} <= _actions(client, url)
    client.post(url, {"action": "cancel", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert job.status == "cancelled"


# The other doors to the same actions: the API's pool actions and the dashboard's drain button.
def _api(user):
    from rest_framework.test import APIClient

    from apps.api.models import ApiToken

    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {ApiToken.issue(user, 'test')[1]}")
    return c


def test_api_pool_writes_need_the_model_permission(django_user_model, fleet):
    pool = Pool.objects.filter(state=Pool.State.ACTIVE).first()
    viewer = _staff(django_user_model, "inventory.view_pool")
    api = _api(viewer)
    assert api.get(f"/api/v1/pools/{pool.slug}/").status_code == 200
    r = api.post(f"/api/v1/pools/{pool.slug}/drain/")
    assert r.status_code == 403 and "inventory.change_pool" in r.json()["detail"]
    assert api.patch(f"/api/v1/pools/{pool.slug}/", {"notes": "x"}, format="json").status_code == 403
    assert api.delete(f"/api/v1/pools/{pool.slug}/").status_code == 403
    pool.refresh_from_db()
    assert pool.state == Pool.State.ACTIVE
    viewer.user_permissions.add(Permission.objects.get(content_type__app_label="inventory",
                                                       codename="change_pool"))
    r = _api(django_user_model.objects.get(pk=viewer.pk)).post(f"/api/v1/pools/{pool.slug}/drain/")
    assert r.status_code == 200 and r.json()["state"] == "draining"


def test_dashboard_drain_needs_change_pool(client, django_user_model, fleet):
    pool = Pool.objects.filter(state=Pool.State.ACTIVE).first()
    client.force_login(_staff(django_user_model, "inventory.view_pool"))
    r = client.post(reverse("dashboard:pool-drain", args=[pool.slug]), {"state": "draining"})
    assert r.status_code == 403
    pool.refresh_from_db()
    assert pool.state == Pool.State.ACTIVE
    client.force_login(_staff_named(django_user_model, "operator", "inventory.change_pool"))
    client.post(reverse("dashboard:pool-drain", args=[pool.slug]), {"state": "draining"})
    pool.refresh_from_db()
    assert pool.state == Pool.State.DRAINING


def _staff_named(django_user_model, name, *codenames):
    user = django_user_model.objects.create_user(name, f"{name}@example.com", "pw-x-12345678", is_staff=True)
    for code in codenames:
        app, perm = code.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=perm))
    return django_user_model.objects.get(pk=user.pk)
