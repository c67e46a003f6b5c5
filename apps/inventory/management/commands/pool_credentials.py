"""manage.py pool_credentials <slug>: the least-privilege credentials of a pool on another host.

Run on the control plane (it uses the platform's own database and Redis connections): it makes or
updates the pool's PostgreSQL role and Redis ACL user (apps.inventory.credentials) and prints the
variables its workers need, as an env file (`--format env`, default) or JSON:

    python manage.py pool_credentials iad-h100 --db-host db.internal --redis-host redis.internal > iad.env
    python manage.py pool_credentials iad-h100 --revoke
"""
from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from apps.inventory.credentials import CredentialError, provision_pool_credentials, revoke_pool_credentials


class Command(BaseCommand):
    help = "Create or update (or --revoke) a pool's least-privilege database role and Redis user."

    def add_arguments(self, parser) -> None:
        parser.add_argument("slug", help="the pool's slug")
        parser.add_argument("--password", help="password of both (default: a new random one each run)")
        parser.add_argument("--redis-url", help="the Redis to make the ACL user on, as an admin "
                                                "(default: REDIS_URL)")
        parser.add_argument("--db-host", help="the database host the pool reaches (default: this one's)")
        parser.add_argument("--redis-host", help="the Redis host the pool reaches (default: this one's)")
        parser.add_argument("--database", default="default", help="Django database alias")
        parser.add_argument("--revoke", action="store_true", help="drop the role and the Redis user")
        parser.add_argument("--format", choices=("env", "json"), default="env")

    def handle(self, *args, **opts) -> None:
        try:
            if opts["revoke"]:
                revoke_pool_credentials(opts["slug"], redis_url=opts["redis_url"], db_alias=opts["database"])
                self.stderr.write(f"revoked the credentials of pool {opts['slug']}")
                return
            env = provision_pool_credentials(
                opts["slug"], password=opts["password"], redis_url=opts["redis_url"],
                db_alias=opts["database"], db_host=opts["db_host"], redis_host=opts["redis_host"])
        except CredentialError as exc:
            raise CommandError(str(exc)) from exc
        if opts["format"] == "json":
            self.stdout.write(json.dumps(env, indent=2))
        else:
            self.stdout.write("".join(f"{k}={v}\n" for k, v in env.items()), ending="")
        more = "DILOCO_POOL_TOKEN (admin: Issue a worker token), DILOCO_WEB_URL" + (
            "" if "BLOB_STORE_URL" in env else ", BLOB_STORE_URL")
        self.stderr.write(f"Add {more}. Redis keeps ACL users in memory: ACL SAVE (with an aclfile), "
                          "or run this again after a Redis restart.")
