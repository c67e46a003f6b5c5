"""The dashboard follows the API's rules: sign-in lock-out, dry-run rate, token rules, job
actions and who sees which events (issue 18's pentest findings, one test per hole)."""
from __future__ import annotations

import itertools

import pytest
from rest_framework.test import APIClient

from apps.api.models import ApiToken
from apps.jobs import state as st
from apps.jobs.models import Event, Job

from .test_jobs import _form

LOGIN = "/accounts/login/"
TOKENS = "/account/tokens/"
_cache_ids = itertools.count()


@pytest.fixture(autouse=True)
def _isolated_cache(settings):
    """Own throttle counters per test (the default cache is Redis, shared between runs)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"dashboard-security-{next(_cache_ids)}"}}


def _rates(settings, **rates) -> None:
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {
        **settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], **rates}}


# --------------------------------------------------------------------------- 1. sign-in lock-out
@pytest.mark.django_db
def test_dashboard_login_locks_out_after_the_apis_number_of_failures(client, alice, settings):
    limit = int(settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["auth_user"].split("/")[0])
    codes = [client.post(LOGIN, {"username": "alice", "password": f"bad-{i}"}).status_code
             for i in range(limit + 1)]
    assert codes == [200] * limit + [429]
    # locked: even the right password is refused, with a message and no session
    resp = client.post(LOGIN, {"username": "alice", "password": "pw-alice-123"})
    assert resp.status_code == 429 and "Retry-After" in resp
    assert "Too many sign-in attempts" in resp.content.decode()
    assert "_auth_user_id" not in client.session
    assert client.get(LOGIN).status_code == 200  # the page itself still renders


@pytest.mark.django_db
def test_dashboard_and_api_logins_share_one_counter(client, alice, bob, settings):
    _rates(settings, auth="3/minute", auth_user="100/minute")
    api = APIClient()
    assert api.post("/api/v1/auth/token/", {"username": "alice", "password": "x"},
                    format="json").status_code == 401
    assert client.post(LOGIN, {"username": "bob", "password": "x"}).status_code == 200
    assert client.post(LOGIN, {"username": "carol", "password": "x"}).status_code == 200
    # the address used up its allowance across both doors, whatever the username
    assert client.post(LOGIN, {"username": "bob", "password": "pw-bob-123"}).status_code == 429
    assert api.post("/api/v1/auth/token/", {"username": "bob", "password": "pw-bob-123"},
                    format="json").status_code == 429


# --------------------------------------------------------------------------- 2. pool events
@pytest.mark.django_db
def test_pool_page_shows_only_events_of_jobs_the_user_sees(client, alice, bob, staff_user, job_factory,
                                                          fleet):
    pool = fleet["h100-east"]
    bobs = job_factory(bob, name="bobs-secret")
    alices = job_factory(alice, name="alices-run")
    lost = Event.Kind.FAILED
    Event.objects.create(job=bobs, pool=pool, kind=lost, message="learner 1.2 lost (bob's job)")
    Event.objects.create(job=alices, pool=pool, kind=lost, message="learner 3.0 lost (alice's job)")
    Event.objects.create(pool=pool, kind=Event.Kind.DRAINED, message="pool h100-east drained")
    client.force_login(alice)
    body = client.get(f"/fleet/{pool.slug}/").content.decode()
    assert "alice&#x27;s job" in body and "pool h100-east drained" in body
    assert "bob&#x27;s job" not in body
    client.force_login(staff_user)
    body = client.get(f"/fleet/{pool.slug}/").content.decode()
    assert "alice&#x27;s job" in body and "bob&#x27;s job" in body


# --------------------------------------------------------------------------- 3. malformed token forms
@pytest.mark.django_db
@pytest.mark.parametrize("data", [
    {"action": "revoke", "token": "abc"},
    {"action": "revoke"},
    {"action": "revoke", "token": "-3"},
    {"action": "revoke", "token": "99999999999999999999999999"},
    {"action": "create", "name": "ci", "days": "\u00b2"},  # a digit to str.isdigit, not to int()
    {"action": "create", "name": "ci", "days": "1e3"},
    {"action": "create", "name": "a\x00b"},
    {"action": "create", "name": "x" * 61},
    {"action": "nonsense", "name": "ci"},
])
def test_malformed_token_forms_get_a_message_not_a_500(client, alice, data):
    client.force_login(alice)
    resp = client.post(TOKENS, data)  # the test client raises on a server error
    assert resp.status_code == 200  # the page again, with the reason (as for an empty name)
    assert [m.level_tag for m in resp.context["messages"]] == ["error"]
    assert ApiToken.objects.count() == 0


# --------------------------------------------------------------------------- 4. token cap
@pytest.mark.django_db
def test_dashboard_enforces_the_active_token_cap(client, alice):
    from apps.api.authentication import MAX_ACTIVE_TOKENS

    for i in range(MAX_ACTIVE_TOKENS):
        ApiToken.issue(alice, f"t{i}")
    client.force_login(alice)
    resp = client.post(TOKENS, {"action": "create", "name": "one-too-many"})
    assert resp.status_code == 200 and resp.context["new_key"] is None
    assert f"{MAX_ACTIVE_TOKENS} active tokens" in resp.content.decode()
    assert ApiToken.objects.filter(user=alice).count() == MAX_ACTIVE_TOKENS
    ApiToken.objects.filter(user=alice).first().revoke()
    assert client.post(TOKENS, {"action": "create", "name": "room-again"}).status_code == 201


# --------------------------------------------------------------------------- 5. job actions
@pytest.mark.django_db
def test_dashboard_resume_of_a_running_job_is_refused_like_the_api(client, alice, job_factory):
    job = job_factory(alice, status=st.RUNNING)
    client.force_login(alice)
    resp = client.post(f"/jobs/{job.pk}/resume", follow=True)
    assert resp.status_code == 200
    job.refresh_from_db()
    assert job.status == st.RUNNING
    assert "Cannot resume a running job: only paused jobs can be resumed." in resp.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("status", st.STATUSES)
@pytest.mark.parametrize("action", ["cancel", "pause", "resume"])
def test_dashboard_and_api_actions_follow_the_same_rules(client, alice, job_factory, status, action):
    on_api = job_factory(alice, name="api", status=status)
    on_dash = job_factory(alice, name="dash", status=status)
    api_resp = APIClient()
    api_resp.force_authenticate(alice)
    code = api_resp.post(f"/api/v1/jobs/{on_api.pk}/{action}/").status_code
    assert code in (200, 409)
    client.force_login(alice)
    assert client.post(f"/jobs/{on_dash.pk}/{action}").status_code == 302
    on_api.refresh_from_db()
    on_dash.refresh_from_db()
    assert on_dash.status == on_api.status
    assert (on_dash.status != status) == (code == 200)


# --------------------------------------------------------------------------- 6. dry-run rate
@pytest.mark.django_db
def test_dashboard_dry_run_is_throttled_like_the_apis(client, alice, fleet, settings):
    _rates(settings, job_create="2/minute")
    client.force_login(alice)
    codes = [client.post("/jobs/new", _form(learners="2", action="dry_run")).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    resp = client.post("/jobs/new", _form(learners="2", action="dry_run"))
    assert resp.status_code == 429 and "Retry-After" in resp
    assert resp.context["preview"] is None
    assert "Too many dry runs and submissions" in resp.content.decode()
    assert client.get("/jobs/new").status_code == 200  # reading the form is not limited


@pytest.mark.django_db
def test_dashboard_and_api_dry_runs_share_one_counter(client, alice, fleet, settings):
    _rates(settings, job_create="2/minute")
    api = APIClient()
    api.force_authenticate(alice)
    spec = {"name": "t", "learners": 2, "steps": 10}
    assert api.post("/api/v1/jobs/dry-run/", {"spec": spec}, format="json").status_code == 200
    client.force_login(alice)
    assert client.post("/jobs/new", _form(learners="2", action="dry_run")).status_code == 200
    assert client.post("/jobs/new", _form(learners="2", action="dry_run")).status_code == 429
    assert api.post("/api/v1/jobs/dry-run/", {"spec": spec}, format="json").status_code == 429
    assert Job.objects.count() == 0


def test_admin_login_shares_the_lock_out(client, staff_user, settings):
    """The admin's own sign-in page was a third door without a limit."""
    codes = [client.post("/admin/login/", {"username": "olga", "password": f"wrong-{i}"}).status_code
             for i in range(15)]
    assert 429 in codes, codes
    r = client.post("/admin/login/", {"username": "olga", "password": "pw-olga-123"})
    assert r.status_code == 429 and "Too many sign-in attempts" in r.content.decode()
