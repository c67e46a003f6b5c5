"""Where the CLI finds its server and token: DILOCO_URL / DILOCO_TOKEN, else what `diloco login` saved."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"


def config_path() -> Path:
    if os.environ.get("DILOCO_CONFIG"):
        return Path(os.environ["DILOCO_CONFIG"]).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "diloco" / "config.json"


@dataclass
class Settings:
    url: str
    token: str | None
    source: str  # "env", "config" or "default": where the token came from


def load_saved() -> dict:
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(url: str, token: str) -> Path:
    """Write the config file, readable by its owner only."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "token": token}, fh, indent=2)
    os.replace(tmp, path)
    return path


def resolve(url: str | None = None, token: str | None = None) -> Settings:
    """Explicit options win, then the environment, then the saved login."""
    saved = load_saved()
    env_url, env_token = os.environ.get("DILOCO_URL"), os.environ.get("DILOCO_TOKEN")
    final_url = url or env_url or saved.get("url") or DEFAULT_URL
    if token:
        return Settings(final_url.rstrip("/"), token, "option")
    if env_token:
        return Settings(final_url.rstrip("/"), env_token, "env")
    if saved.get("token"):
        return Settings(final_url.rstrip("/"), saved["token"], "config")
    return Settings(final_url.rstrip("/"), None, "default")
