"""Least-privilege credentials of a pool worker on another host (docs/security.md).

`provision_pool_credentials(slug)` runs as the platform's own (owner) connections and makes:

- a PostgreSQL LOGIN role `diloco_pool_<slug>` (`-` as `_`), member of the group role
  `diloco_pools`, which holds the grants: SELECT on what a worker reads, INSERT/UPDATE on what
  it writes, nothing on users, tokens, sessions or anything else. Row-level security (enabled,
  not forced: the owner keeps seeing everything) confines the members of `diloco_pools` to their
  own pool's rows; roles outside the group meet a permissive policy and see what they saw before.
- a Redis ACL user `diloco-pool-<slug>` that reaches its own queues (`pool.<slug>`,
  `pool.<slug>.*`), sends to the coordinator queue, and uses kombu's bookkeeping keys and
  channels; every other key, channel-layer and cache entries included, and admin commands are refused.

Both are idempotent: run again, they are brought back to this definition (and their passwords
set anew, unless given). `revoke_pool_credentials(slug)` drops both. Why SQL here and not a
migration: roles are cluster-wide and made on demand per pool; the policies and functions come
with the first role.
"""
from __future__ import annotations

import re
import secrets
from urllib.parse import parse_qs, quote, urlsplit

from django.conf import settings
from django.db import connections, transaction

GROUP = "diloco_pools"
ROLE_PREFIX = "diloco_pool_"
REDIS_USER_PREFIX = "diloco-pool-"
ROLE_TABLE = "diloco_pool_role"  # login role -> pool slug; read only by the functions below
SLUG = re.compile(r"[A-Za-z0-9_-]{1,40}")
KOMBU_SEP = "\x06\x16"  # kombu's separator of a queue's priority lists (`pool.a\x06\x163`)


class CredentialError(ValueError):
    """A slug that cannot name credentials, or a pool that does not exist."""


def _check_slug(slug: str) -> str:
    if not isinstance(slug, str) or not SLUG.fullmatch(slug):
        raise CredentialError(f"not a pool slug: {slug!r} (letters, digits, '-' and '_', at most 40)")
    return slug


def role_name(slug: str) -> str:
    """The PostgreSQL login role of pool `slug` (only [A-Za-z0-9_]: always quoted anyway)."""
    return ROLE_PREFIX + _check_slug(slug).replace("-", "_")


def redis_user(slug: str) -> str:
    return REDIS_USER_PREFIX + _check_slug(slug)


# -- PostgreSQL ---------------------------------------------------------------------------------

def _tables() -> dict[str, str]:
    """The tables a worker touches, by model name (looked up in the app registry: the jobs' and the
    coordinator's apps sit above this one)."""
    from django.apps import apps

    names = [("inventory", "Pool"), ("inventory", "Node"), ("jobs", "Job"), ("jobs", "Learner"),
             ("coordinator", "LearnerRuntime"), ("jobs", "Incident"), ("jobs", "Event")]
    return {model: apps.get_model(app, model)._meta.db_table for app, model in names}


def _grants(t: dict[str, str]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(table, privilege, columns it must not write) of a worker (apps/inventory/worker.py,
    apps/coordinator/learner.py). Column-level writes skip identities and fencing: a pool cannot
    move a learner to another job or bump its incarnation. Everything else has no grant at all."""
    return [
        (t["Pool"], "SELECT", ()),
        (t["Job"], "SELECT", ()),
        (t["Node"], "SELECT", ()), (t["Node"], "INSERT", ()), (t["Node"], "UPDATE", ("id",)),
        (t["Learner"], "SELECT", ()),
        (t["Learner"], "UPDATE", ("id", "job_id", "pool_id", "index", "incarnation")),
        (t["LearnerRuntime"], "SELECT", ()), (t["LearnerRuntime"], "INSERT", ()),
        (t["LearnerRuntime"], "UPDATE", ("id", "learner_id")),
        (t["Incident"], "SELECT", ()), (t["Incident"], "INSERT", ()),
        (t["Incident"], "UPDATE", ("id", "job_id", "learner_id", "pool_id")),
        (t["Event"], "INSERT", ()),
    ]


def _row_rules(t: dict[str, str], schema: str) -> dict[str, str]:
    """The rows of each table a pool may see and write; `me` is its pool's id."""
    me = f"(SELECT {schema}.diloco_pool_id(current_user))"
    learners = f"{schema}.{t['Learner']} l WHERE l.pool_id = {me}"
    mine, my_jobs = f"(SELECT l.id FROM {learners})", f"(SELECT l.job_id FROM {learners})"  # noqa: S608 - names only
    return {
        t["Pool"]: f"id = {me}",
        t["Node"]: f"pool_id = {me}",
        t["Learner"]: f"pool_id = {me}",
        t["LearnerRuntime"]: f"learner_id IN {mine}",
        t["Incident"]: f"learner_id IN {mine}",
        t["Job"]: f"id IN {my_jobs}",
        # its jobs' events, and its own pool's (a node of an island it leads declared lost)
        t["Event"]: f"job_id IN {my_jobs} OR (job_id IS NULL AND pool_id = {me})",
    }


def _setup_sql(cur, schema: str, database: str) -> None:
    """The group role, its grants, the lookup functions and the policies (idempotent)."""
    # roles are cluster-wide: another database's provisioning may be making the group right now
    cur.execute(f"""DO $$ BEGIN CREATE ROLE "{GROUP}" NOLOGIN;
                    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$""")
    cur.execute(f'GRANT CONNECT ON DATABASE "{database}" TO "{GROUP}"')
    cur.execute(f'GRANT USAGE ON SCHEMA {schema} TO "{GROUP}"')
    cur.execute(f"CREATE TABLE IF NOT EXISTS {schema}.{ROLE_TABLE} "
                "(rolname name PRIMARY KEY, pool_slug varchar(50) NOT NULL UNIQUE)")
    cur.execute(f"REVOKE ALL ON {schema}.{ROLE_TABLE} FROM PUBLIC")
    t = _tables()
    # SECURITY DEFINER: the pool reads neither the role table nor the pool tokens; search_path
    # pinned so that a pool cannot shadow the tables these functions read.
    cur.execute(f"""
        CREATE OR REPLACE FUNCTION {schema}.diloco_pool_id(role name) RETURNS bigint
        LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
          SELECT p.id FROM {schema}.{t['Pool']} p JOIN {schema}.{ROLE_TABLE} r ON r.pool_slug = p.slug
          WHERE r.rolname = $1 $$""")  # noqa: S608 - names, never input
    cur.execute(f"""
        CREATE OR REPLACE FUNCTION {schema}.diloco_pool_token_valid(slug text, token text) RETURNS boolean
        LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
          SELECT EXISTS (SELECT 1 FROM {schema}.inventory_pooltoken k JOIN {schema}.{t['Pool']} p
                         ON p.id = k.pool_id
                         WHERE p.slug = $1 AND k.revoked_at IS NULL
                           AND k.key_hash = encode(sha256(convert_to($2, 'UTF8')), 'hex')) $$""")  # noqa: S608 - names, never input
    for fn in ("diloco_pool_id(name)", "diloco_pool_token_valid(text, text)"):
        cur.execute(f"REVOKE ALL ON FUNCTION {schema}.{fn} FROM PUBLIC")
        cur.execute(f'GRANT EXECUTE ON FUNCTION {schema}.{fn} TO "{GROUP}"')
    _grant(cur, schema, t)
    for table, rule in _row_rules(t, schema).items():
        cur.execute(f"ALTER TABLE {schema}.{table} ENABLE ROW LEVEL SECURITY")
        cur.execute(f"DROP POLICY IF EXISTS diloco_everyone ON {schema}.{table}")
        cur.execute(f"CREATE POLICY diloco_everyone ON {schema}.{table} AS PERMISSIVE FOR ALL TO PUBLIC "
                    "USING (true) WITH CHECK (true)")
        cur.execute(f"DROP POLICY IF EXISTS diloco_pool_rows ON {schema}.{table}")
        cur.execute(f'CREATE POLICY diloco_pool_rows ON {schema}.{table} AS RESTRICTIVE FOR ALL TO "{GROUP}" '
                    f"USING ({rule}) WITH CHECK ({rule})")


def _grant(cur, schema: str, t: dict[str, str]) -> None:
    """Exactly the grants of `_grants` (anything granted before is taken back first)."""
    name = schema.strip('"')  # quoted by quote_name; information_schema holds the bare name
    cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = %s", [name])
    for (table,) in cur.fetchall():
        cur.execute(f'REVOKE ALL ON {schema}."{table}" FROM "{GROUP}"')
    for table, privilege, skip in _grants(t):
        if not skip:
            cur.execute(f'GRANT {privilege} ON {schema}.{table} TO "{GROUP}"')
            continue
        cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
                    "AND table_name = %s ORDER BY ordinal_position", [name, table])
        cols = ", ".join(f'"{c}"' for (c,) in cur.fetchall() if c not in skip)
        cur.execute(f'GRANT {privilege} ({cols}) ON {schema}.{table} TO "{GROUP}"')
    # INSERT ... RETURNING id reads the new row's id
    cur.execute(f'GRANT SELECT (id) ON {schema}.{t["Event"]} TO "{GROUP}"')
    for table in {t["Node"], t["LearnerRuntime"], t["Incident"], t["Event"]}:
        cur.execute("SELECT pg_get_serial_sequence(%s, 'id')", [f"{schema}.{table}"])
        seq = cur.fetchone()[0]
        if seq:
            cur.execute(f'GRANT USAGE ON SEQUENCE {seq} TO "{GROUP}"')


def _literal(cur, value: str) -> str:
    """`value` as a SQL literal, quoted by the server (utility statements take no parameters)."""
    cur.execute("SELECT quote_literal(%s)", [value])
    return cur.fetchone()[0]


def _provision_role(slug: str, password: str, db_alias: str) -> str:
    conn = connections[db_alias]
    if conn.vendor != "postgresql":
        raise CredentialError("pool credentials need PostgreSQL (the embedded SQLite default has no roles)")
    from .models import Pool

    if not Pool.objects.using(db_alias).filter(slug=slug).exists():
        raise CredentialError(f"no pool {slug!r} in the inventory")
    role = role_name(slug)
    with transaction.atomic(using=db_alias), conn.cursor() as cur:
        cur.execute("SELECT current_schema(), current_database()")
        schema, database = cur.fetchone()
        schema = conn.ops.quote_name(schema)
        _setup_sql(cur, schema, database)
        cur.execute(f"SELECT pool_slug FROM {schema}.{ROLE_TABLE} WHERE rolname = %s", [role])  # noqa: S608 - names, never input
        row = cur.fetchone()
        if row is not None and row[0] != slug:
            raise CredentialError(f"role {role} already belongs to pool {row[0]!r}")
        if row is None:
            cur.execute(f"INSERT INTO {schema}.{ROLE_TABLE} (rolname, pool_slug) VALUES (%s, %s)",  # noqa: S608 - names, never input
                        [role, slug])
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        verb = "ALTER" if cur.fetchone() else "CREATE"
        cur.execute(f'{verb} ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS '
                    f"INHERIT PASSWORD {_literal(cur, password)}")
        cur.execute(f'GRANT "{GROUP}" TO "{role}"')
    return role


def _database_url(role: str, password: str, db_alias: str, host: str | None) -> str:
    sd = connections[db_alias].settings_dict
    host = host or sd.get("HOST") or "localhost"
    port = sd.get("PORT") or 5432
    auth = f"{quote(role, safe='')}:{quote(password, safe='')}"
    url = f"postgres://{auth}@{host}:{port}/{quote(sd['NAME'], safe='')}"
    sslmode = (sd.get("OPTIONS") or {}).get("sslmode")
    return url + (f"?sslmode={quote(sslmode)}" if sslmode else "")


def _revoke_role(slug: str, db_alias: str) -> None:
    conn = connections[db_alias]
    if conn.vendor != "postgresql":
        return
    role = role_name(slug)
    with transaction.atomic(using=db_alias), conn.cursor() as cur:
        cur.execute("SELECT current_schema()")
        schema = conn.ops.quote_name(cur.fetchone()[0])
        cur.execute("SELECT to_regclass(%s)", [f"{schema}.{ROLE_TABLE}"])
        if cur.fetchone()[0] is not None:
            cur.execute(f"DELETE FROM {schema}.{ROLE_TABLE} WHERE rolname = %s", [role])  # noqa: S608 - names, never input
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        if cur.fetchone() is None:
            return
        # its open sessions end with it (a member of the role, or a superuser, may end them)
        cur.execute("SELECT pid FROM pg_stat_activity WHERE usename = %s", [role])
        for (pid,) in cur.fetchall():
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])
        cur.execute(f'DROP ROLE "{role}"')


# -- Redis --------------------------------------------------------------------------------------

def _redis_db(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def acl_rules(slug: str, password: str, *, db: int = 0, blob_prefix: str | None = None) -> list[str]:
    """The ACL SETUSER rules of pool `slug`'s Redis user. Key and channel names are kombu's
    (celery over Redis: queue lists, `_kombu.binding.<exchange>` sets, the `unacked` hash of
    deliveries in flight, fanout over pub/sub channels `/<db>.<exchange>`)."""
    queue = f"pool.{_check_slug(slug)}"  # a slug has no '.', '*', '?' or '[': these globs are exact
    own = [queue, f"{queue}{KOMBU_SEP}*", f"{queue}.*",  # its queue, its priority lists, per-node queues
           f"_kombu.binding.{queue}", f"_kombu.binding.{queue}.*",
           f"_kombu.binding_permanent.{queue}", f"_kombu.binding_permanent.{queue}.*",
           "unacked", "unacked_index", "unacked_mutex",
           # its remote-control queue's binding (celery.pidbox is a fanout: delivery is over pub/sub)
           "_kombu.binding.celery.pidbox", "_kombu.binding_permanent.celery.pidbox",
           "_kombu.binding_deadlines",
           # the lists of remote-control queues (its own `<node>.celery.pidbox`, the replies to `celery
           # inspect`): only declared, since control messages go over pub/sub; node names are free text
           "*.celery.pidbox*"]
    if blob_prefix:
        own.append(f"{blob_prefix}*")
    rules = ["reset", "on", f">{password}", "resetchannels",
             "+@all", "-@admin", "-@dangerous", "-randomkey", "-pubsub|channels",
             "-pubsub|shardchannels", "-script|flush", "-function",
             "-publish", "-spublish"]  # publishing only in the selector below
    if not blob_prefix:  # a Redis blob store lists blobs with SCAN (names, never values)
        rules.append("-scan")
    rules += [f"~{k}" for k in own]
    rules += ["%R~_kombu.binding.*",  # routing: which queues an exchange delivers to
              "%W~coordinator", f"%W~coordinator{KOMBU_SEP}*"]  # reconcile_job; it never reads the queue
    # It listens to remote control (`celery inspect ping`) but cannot broadcast a command (a
    # `shutdown` would reach every worker, coordinator included); it publishes its heartbeats.
    rules += [f"&/{db}.celery.pidbox", f"(+publish &/{db}.celeryev/*)"]
    return rules


def _blob_prefix(redis_url: str) -> str | None:
    """The blob store's key prefix when it is this same Redis (trainer.transport.RedisStore)."""
    blob = urlsplit(getattr(settings, "BLOB_STORE_URL", "") or "")
    broker = urlsplit(redis_url)
    if blob.scheme not in ("redis", "rediss") or (blob.hostname, blob.port) != (broker.hostname, broker.port):
        return None
    return parse_qs(blob.query).get("prefix", ["blob:"])[0]


def _redis_client(redis_url: str):
    import redis

    return redis.Redis.from_url(redis_url)


def _user_url(url: str, user: str, password: str, host: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host or parts.hostname or 'localhost'}"
    if parts.port:
        netloc += f":{parts.port}"
    return parts._replace(netloc=netloc, query="").geturl()


# -- public -------------------------------------------------------------------------------------

def provision_pool_credentials(
    pool_slug: str,
    *,
    password: str | None = None,
    redis_url: str | None = None,
    db_alias: str = "default",
    db_host: str | None = None,
    redis_host: str | None = None,
) -> dict[str, str]:
    """Create or update pool `pool_slug`'s database role and Redis user; return a worker's env.

    `password` (default: a fresh random one) is the password of both. `redis_url`: the Redis to
    make the user on, with rights to run ACL SETUSER (default: settings.REDIS_URL). `db_host` /
    `redis_host`: the addresses the pool host reaches (default: those of the owner's settings).
    """
    _check_slug(pool_slug)
    password = password or secrets.token_urlsafe(32)
    if "\x00" in password or any(c.isspace() for c in password):
        raise CredentialError("a password may not hold whitespace or NUL")
    redis_url = redis_url if redis_url is not None else getattr(settings, "REDIS_URL", "")
    role = _provision_role(pool_slug, password, db_alias)
    env = {"DILOCO_POOL": pool_slug, "DATABASE_URL": _database_url(role, password, db_alias, db_host)}
    if redis_url:
        blob = _blob_prefix(redis_url)
        user = redis_user(pool_slug)
        client = _redis_client(redis_url)
        try:
            client.execute_command("ACL", "SETUSER", user,
                                   *acl_rules(pool_slug, password, db=_redis_db(redis_url), blob_prefix=blob))
        finally:
            client.close()
        env["REDIS_URL"] = _user_url(redis_url, user, password, redis_host)
        if blob:
            blob_url = urlsplit(settings.BLOB_STORE_URL)
            env["BLOB_STORE_URL"] = _user_url(settings.BLOB_STORE_URL, user, password, redis_host) + (
                f"?{blob_url.query}" if blob_url.query else "")
    env["SECRET_KEY"] = secrets.token_urlsafe(50)  # its own: a worker signs nothing
    return env


def revoke_pool_credentials(pool_slug: str, *, redis_url: str | None = None,
                            db_alias: str = "default") -> None:
    """Drop pool `pool_slug`'s database role and Redis user (their open connections end too)."""
    _check_slug(pool_slug)
    _revoke_role(pool_slug, db_alias)
    redis_url = redis_url if redis_url is not None else getattr(settings, "REDIS_URL", "")
    if redis_url:
        client = _redis_client(redis_url)
        try:
            client.execute_command("ACL", "DELUSER", redis_user(pool_slug))
        finally:
            client.close()


def pool_token_valid(raw: str, slug: str) -> bool:
    """Whether `raw` is a live token of pool `slug`. A pool's own role cannot read the pool
    tokens: it asks diloco_pool_token_valid(), which can (SECURITY DEFINER), and learns a yes or no."""
    from django.db import connection

    from .models import PoolToken

    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute("SELECT has_table_privilege(%s, 'SELECT')", [PoolToken._meta.db_table])
            if not cur.fetchone()[0]:
                cur.execute("SELECT diloco_pool_token_valid(%s, %s)", [slug, raw or ""])
                return bool(cur.fetchone()[0])
    pool = PoolToken.authenticate(raw)
    return pool is not None and pool.slug == slug
