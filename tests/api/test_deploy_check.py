"""`manage.py check --deploy` is clean under production settings, with the API's settings in place."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_check_deploy_is_clean_in_production():
    env = {**os.environ, "DILOCO_PRODUCTION": "1", "DEBUG": "0", "SECRET_KEY": secrets.token_urlsafe(50),
           "ALLOWED_HOSTS": "diloco.example.com", "API_THROTTLE_AUTH": "5/minute"}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)  # set for the test run only; check --deploy flags it
    proc = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no issues" in proc.stdout


def test_production_requires_a_secret_key():
    env = {**os.environ, "DILOCO_PRODUCTION": "1", "DEBUG": "0", "SECRET_KEY": ""}
    proc = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "SECRET_KEY must be set" in proc.stderr
