"""CLI tests run the real `diloco` command against a live server (pytest-django's live_server)."""
from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from apps.api.models import ApiToken
from diloco_cli.main import app

_ids = itertools.count()


@pytest.fixture(autouse=True)
def _cli_settings(settings, tmp_path, monkeypatch):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": f"cli-test-{next(_ids)}"}}
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # never read or write the developer's real login
    monkeypatch.setenv("DILOCO_CONFIG", str(tmp_path / "diloco-config.json"))
    monkeypatch.delenv("DILOCO_URL", raising=False)
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)


class Cli:
    def __init__(self, url: str, token: str | None):
        self.url, self.token = url, token
        self.runner = CliRunner()

    def __call__(self, *args: str, token: str | None = ..., env: dict | None = None):
        e = {"DILOCO_URL": self.url}
        tok = self.token if token is ... else token
        if tok:
            e["DILOCO_TOKEN"] = tok
        e.update(env or {})
        return self.runner.invoke(app, [str(a) for a in args], env=e, catch_exceptions=False)

    def json(self, *args: str, **kw):
        result = self(*args, "--json", **kw)
        try:
            data = json.loads(result.stdout)
        except ValueError:
            pytest.fail(f"--json output is not JSON (exit {result.exit_code}):\n"
                        f"{result.stdout}\n{result.stderr}")
        return result.exit_code, data


@pytest.fixture
def cli(live_server, alice):
    return Cli(live_server.url, ApiToken.issue(alice, "cli-test")[1])
