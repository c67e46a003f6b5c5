"""Browser tests: Debian's Chromium (Playwright) against daphne serving the test database.

The server is a real `daphne` subprocess (HTTP + websockets, Redis channel layer) reading
the pytest-django test database; tests use `transactional_db` so it sees their rows.
"""
from __future__ import annotations

import contextlib
import http.client
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")

@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (installs Debian's chromium)")
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "headless": True,
        "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage"],
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1440, "height": 900}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url() -> str:
    from django.db import connection

    sd = connection.settings_dict
    if "postgresql" not in sd["ENGINE"]:
        pytest.fail("browser tests need PostgreSQL: set DATABASE_URL")
    auth = quote(sd.get("USER") or "postgres")
    if sd.get("PASSWORD"):
        auth += ":" + quote(sd["PASSWORD"])
    return f"postgres://{auth}@{sd.get('HOST') or '127.0.0.1'}:{sd.get('PORT') or 5432}/{sd['NAME']}"


class LiveServer:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.log = tmp / "daphne.log"
        self.proc: subprocess.Popen | None = None
        redis_url = os.environ.get("REDIS_URL", "")
        if not redis_url:
            pytest.fail("browser tests need Redis for the channel layer: set REDIS_URL")
        self.coordinator_token = "ct_" + secrets.token_urlsafe(24)  # job-level metrics are the coordinator's
        self.env = {**os.environ, "DATABASE_URL": _database_url(), "REDIS_URL": redis_url,
                    "DJANGO_SETTINGS_MODULE": "diloco_platform.settings", "DILOCO_VAR_DIR": str(tmp / "var"),
                    "DILOCO_WEB_URL": self.url, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "COORDINATOR_TOKEN": self.coordinator_token}
        self.env.pop("PYTEST_CURRENT_TEST", None)

    def start(self) -> None:
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "daphne"), "-b", "127.0.0.1", "-p", str(self.port),
                 "diloco_platform.asgi:application"],
                cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daphne exited:\n{self.tail()}")
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/accounts/login/")
                if conn.getresponse().status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"daphne did not answer in 60 s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def kill(self) -> None:
        """Stop the server with SIGKILL, like a crash; `start()` brings it back on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def tail(self, lines: int = 40) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def live(django_db_setup, django_db_blocker, tmp_path_factory):
    """A daphne process serving the test database (HTTP + websockets)."""
    server = LiveServer(tmp_path_factory.mktemp("live"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def dash(page, live, request):
    """A Playwright page that fails the test on any console error or page error, and
    saves a screenshot under test-artifacts/ at the end."""
    errors: list[str] = []
    allowed: list[re.Pattern] = []  # a test that stops the server expects failed reconnects

    def on_console(m) -> None:
        if m.type == "error" and not any(p.search(m.text) for p in allowed):
            errors.append(f"console.{m.type}: {m.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.set_default_timeout(15_000)
    page.live = live
    page.console_errors = errors
    page.allowed_console_errors = allowed
    yield page
    ARTIFACTS.mkdir(exist_ok=True)
    with contextlib.suppress(Exception):
        page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
    assert not errors, "browser console errors:\n" + "\n".join(errors) + f"\n--- daphne ---\n{live.tail()}"


def login(page, live, username: str, password: str) -> None:
    page.goto(f"{live.url}/accounts/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{live.url}/")
