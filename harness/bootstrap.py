"""Run inside the control plane of a sites harness: create its pools, their worker tokens and
least-privilege credentials, and a user with an API token; print them as one JSON line.

    python -m harness.bootstrap '{"pools": {"s1": {"devices": 2, "mbit": 1000}}, "least_privilege": true}'
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> dict:
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from apps.api.models import ApiToken
    from apps.inventory.models import AcceleratorType, Pool, PoolToken

    args = json.loads(argv[0])
    acc, _ = AcceleratorType.objects.get_or_create(
        slug="site-cpu", defaults={"vendor": "Generic", "model": "CPU core", "kind": "cpu",
                                   "generation": "x86-64", "year": 2024, "memory_gib": 8,
                                   "peak_bf16_tflops": 0.5, "tdp_watts": 15})
    out: dict = {"pools": {}}
    for slug, p in args["pools"].items():
        mbit = p.get("mbit")
        pool, _ = Pool.objects.update_or_create(slug=slug, defaults={
            "name": f"Site {slug}", "region": slug, "accelerator": acc, "device_count": p["devices"],
            "link_gbps": (mbit or 10_000) / 1000.0})
        _, token = PoolToken.issue(pool)
        if args.get("least_privilege", True):
            from apps.inventory.credentials import provision_pool_credentials

            env = provision_pool_credentials(slug, redis_url=settings.REDIS_URL)
            env = {k: v for k, v in env.items() if k in ("DATABASE_URL", "REDIS_URL", "BLOB_STORE_URL")}
            env.setdefault("BLOB_STORE_URL", _blob_url(env["REDIS_URL"], settings.BLOB_STORE_URL))
        else:
            env = {"DATABASE_URL": _owner_url(), "REDIS_URL": settings.REDIS_URL,
                   "BLOB_STORE_URL": settings.BLOB_STORE_URL}
        out["pools"][slug] = {"token": token, "env": env}
    user, _ = get_user_model().objects.get_or_create(username="sites",
                                                     defaults={"email": "sites@example.com"})
    user.set_password("sites-harness-pw")
    user.save()
    out["user_token"] = ApiToken.issue(user, name="sites harness")[1]
    return out


def _owner_url() -> str:
    import os

    return os.environ["DATABASE_URL"]


def _blob_url(redis_url: str, blob_url: str) -> str:
    """The blob store's Redis database, reached with the pool's own Redis user."""
    from urllib.parse import urlparse

    pool, blob = urlparse(redis_url), urlparse(blob_url)
    return blob._replace(netloc=pool.netloc).geturl()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
