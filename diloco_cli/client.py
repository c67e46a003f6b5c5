"""A small HTTP client of the platform's REST API (httpx), with errors mapped to exceptions."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import httpx

from . import __version__

RETRY_STATUSES = {502, 503, 504}


class ApiError(Exception):
    """The server answered with an error; `errors` maps field paths to messages."""

    def __init__(self, status: int, detail: str, errors: dict[str, list[str]] | None = None,
                 body: Any = None):
        super().__init__(detail)
        self.status, self.detail, self.errors = status, detail, errors or {}
        self.body = body if body is not None else {"detail": detail, "errors": self.errors}


class AuthError(ApiError):
    """401/403: missing, bad or insufficient credentials."""


class ConnectError(Exception):
    """The server could not be reached."""


class Client:
    def __init__(self, url: str, token: str | None, timeout: float = 30.0, retries: int = 3):
        headers = {"User-Agent": f"diloco-cli/{__version__}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.url = url.rstrip("/")
        self.retries = retries
        self.http = httpx.Client(base_url=self.url + "/api/v1/", headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing -----------------------------------------------------------------------------
    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """One request; transient failures (connection, 502/503/504) are retried for GETs and
        for POSTs that carry an Idempotency-Key."""
        idempotent = method == "GET" or "Idempotency-Key" in (kw.get("headers") or {})
        attempts = self.retries if idempotent else 1
        for attempt in range(attempts):
            try:
                resp = self.http.request(method, path.lstrip("/"), **kw)
            except httpx.TransportError as exc:
                if attempt + 1 >= attempts:
                    raise ConnectError(f"cannot reach {self.url}: {exc.__class__.__name__}: {exc}") from None
            else:
                if resp.status_code not in RETRY_STATUSES or attempt + 1 >= attempts:
                    return resp
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def check(resp: httpx.Response) -> Any:
        if resp.is_success:
            return resp.json() if resp.content else None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            detail = str(body.get("detail") or resp.reason_phrase)
            errors = body.get("errors") if isinstance(body.get("errors"), dict) else {}
        else:
            detail, errors = f"HTTP {resp.status_code} {resp.reason_phrase}", {}
            body = {"detail": detail, "errors": {}}
        cls = AuthError if resp.status_code in (401, 403) else ApiError
        raise cls(resp.status_code, detail, errors, body)

    def get(self, path: str, **params) -> Any:
        query = {k: v for k, v in params.items() if v is not None}
        return self.check(self.request("GET", path, params=query))

    def post(self, path: str, json: Any = None, headers: dict | None = None) -> Any:
        return self.check(self.request("POST", path, json=json, headers=headers or {}))

    # --- API ----------------------------------------------------------------------------------
    def me(self) -> dict:
        return self.get("auth/me/")

    def obtain_token(self, username: str, password: str, name: str) -> dict:
        return self.post("auth/token/", {"username": username, "password": password, "name": name})

    def submit(self, spec: dict, team: str = "", idempotency_key: str | None = None) -> dict:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body: dict[str, Any] = {"spec": spec}
        if team:
            body["team"] = team
        return self.post("jobs/", body, headers=headers)

    def dry_run(self, spec: dict, team: str = "") -> dict:
        body: dict[str, Any] = {"spec": spec}
        if team:
            body["team"] = team
        return self.post("jobs/dry-run/", body)

    def job(self, job_id: int) -> dict:
        return self.get(f"jobs/{job_id}/")

    def jobs(self, status: str | None = None, search: str | None = None, limit: int = 20) -> dict:
        return self.get("jobs/", status=status, search=search, limit=limit)

    def action(self, job_id: int, name: str) -> dict:
        return self.post(f"jobs/{job_id}/{name}/")

    def events(self, job_id: int, after: int | None = None, limit: int = 200) -> dict:
        return self.get(f"jobs/{job_id}/events/", after=after, limit=limit)

    def metrics(self, job_id: int, names: list[str] | None = None, points: int = 200,
                learner: str | None = None) -> dict:
        return self.get(f"jobs/{job_id}/metrics/", name=",".join(names) if names else None, points=points,
                        learner=learner)

    def compare(self, job_ids: list[int], baseline: int | None = None, metric: str | None = None) -> dict:
        return self.get("compare/", jobs=",".join(str(i) for i in job_ids), baseline=baseline, metric=metric)

    def pools(self) -> list[dict]:
        return self.get("pools/", limit=500)["results"]

    def nodes(self) -> list[dict]:
        return self.get("nodes/", limit=500)["results"]

    def checkpoints(self, job_id: int) -> list[dict]:
        return self.get(f"jobs/{job_id}/checkpoints/")

    def checkpoint(self, ckpt_id: int) -> dict:
        return self.get(f"checkpoints/{ckpt_id}/")

    def download_checkpoint(self, ckpt_id: int, dest: Path, on_bytes=None) -> tuple[Path, str, int]:
        """Stream a checkpoint to `dest` (atomically), verifying its SHA-256; (path, sha256, size)."""
        tmp = dest.with_name(dest.name + ".part")
        digest, size = hashlib.sha256(), 0
        try:
            with self.http.stream("GET", f"checkpoints/{ckpt_id}/download/") as resp:
                if not resp.is_success:
                    resp.read()
                    self.check(resp)
                expected = resp.headers.get("X-Checksum-SHA256", "")
                with open(tmp, "wb") as fh:
                    for chunk in resp.iter_bytes(1 << 20):
                        fh.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        if on_bytes:
                            on_bytes(len(chunk), int(resp.headers.get("Content-Length") or 0))
        except httpx.TransportError as exc:
            tmp.unlink(missing_ok=True)
            raise ConnectError(f"download failed: {exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if expected and digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise ApiError(0, f"checksum mismatch: got {digest.hexdigest()}, server said {expected}")
        tmp.replace(dest)
        return dest, digest.hexdigest(), size
