"""The Content-Security-Policy in Chromium (issue 35): the dashboard works under it, an injected
inline script does not run, and the pages of third-party code (admin, browsable API, Swagger)
still load without a violation (the `dash` fixture fails on any console error)."""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from apps.dashboard.seeding import seed_fleet

from .conftest import login

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_new_token_key_is_selected_on_focus_without_an_inline_handler(dash, alice):
    live = dash.live
    login(dash, live, "alice", "pw-alice-123")
    resp = dash.goto(f"{live.url}/account/tokens/")
    assert "script-src 'self'" in resp.headers["content-security-policy"]
    dash.get_by_label("Name").first.fill("ci")
    dash.get_by_role("button", name=re.compile("Create")).click()
    key = dash.locator("#new-key")
    expect(key).to_be_visible()
    key.focus()
    selected = dash.evaluate("() => { const el = document.getElementById('new-key');"
                             " return [el.selectionStart, el.selectionEnd, el.value.length]; }")
    assert selected[0] == 0 and selected[1] == selected[2] > 20


def test_an_injected_inline_script_does_not_run(dash, alice):
    live = dash.live
    dash.allowed_console_errors.append(re.compile("Content Security Policy"))
    login(dash, live, "alice", "pw-alice-123")
    dash.goto(f"{live.url}/jobs/")
    ran = dash.evaluate("""() => new Promise((done) => {
        window.__pwned = false;
        document.addEventListener('securitypolicyviolation', () => done(window.__pwned), {once: true});
        const s = document.createElement('script');
        s.textContent = 'window.__pwned = true';
        document.body.appendChild(s);
        setTimeout(() => done(window.__pwned), 2000);
    })""")
    assert ran is False


def test_admin_and_api_pages_load_under_their_policy(dash, staff_user):
    seed_fleet()
    live = dash.live
    login(dash, live, "olga", "pw-olga-123")
    for path in ("/admin/inventory/pool/", "/admin/inventory/pooltoken/", "/api/v1/pools/", "/api/docs/"):
        resp = dash.goto(f"{live.url}{path}")
        assert resp is not None and resp.status == 200, path
        dash.wait_for_load_state("networkidle", timeout=45_000)
        assert not dash.console_errors, f"{path}: {dash.console_errors}"
    expect(dash.locator("#swagger-ui")).to_contain_text("DiLoCo platform API", timeout=30_000)
