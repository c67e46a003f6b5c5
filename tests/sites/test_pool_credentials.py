"""A remote pool's credentials (apps.inventory.credentials): what its database role and Redis user
can and cannot do, checked by connecting as them (the claims of docs/security.md)."""
from __future__ import annotations

import os

import psycopg
import pytest
import redis
from django.utils import timezone

from apps.coordinator.models import LearnerRuntime
from apps.inventory.models import Node, PoolToken
from apps.jobs import state as st
from apps.jobs.models import Incident, Job, Learner

from .conftest import needs_services

pytestmark = [needs_services, pytest.mark.django_db(transaction=True)]

SECRETS = ("auth_user", "api_apitoken", "authtoken_token", "django_session", "inventory_pooltoken",
           "auth_user_groups", "auth_user_user_permissions", "django_admin_log",
           "django_celery_beat_periodictask")
# every table a pool worker may read rows of (jobs_event: only the id of a row it inserts)
READABLE = {"inventory_pool", "inventory_node", "jobs_job", "jobs_learner", "coordinator_learnerruntime",
            "jobs_incident", "jobs_event"}


def _seed(pool, owner, tag: str):
    """A running job with one learner on `pool`, its node, runtime and an open incident."""
    node = Node.objects.create(pool=pool, hostname="h", worker_name=f"{pool.slug}-0@h")
    job = Job.objects.create(owner=owner, name=f"job {tag}", spec={"model": "tiny"}, status=st.RUNNING)
    learner = Learner.objects.create(job=job, index=0, pool=pool, node=node, state=Learner.State.RUNNING)
    LearnerRuntime.objects.create(learner=learner, worker=node.worker_name)
    Incident.objects.create(job=job, learner=learner, pool=pool, kind="learner_lost", description=tag,
                            failed_at=timezone.now())
    return job, learner, node


@pytest.fixture
def two_pools(make_pool, pool_credentials, django_user_model):
    """Pools A and B with a job each; A's credentials."""
    a, b = make_pool("site-a"), make_pool("site-b")
    owner = django_user_model.objects.create_user("owner", "o@example.com", "pw-owner-123")
    seeded = {"a": _seed(a, owner, "a"), "b": _seed(b, owner, "b")}
    env = pool_credentials(a.slug)
    pool_credentials(b.slug)  # B has a role too: A's must not see B's rows all the same
    return a, b, env, seeded


def _connect(env) -> psycopg.Connection:
    return psycopg.connect(env["DATABASE_URL"], autocommit=True)


def _rows(conn, sql: str, *params) -> list:
    return conn.execute(sql, params).fetchall()


def test_env_names_the_role_and_user(two_pools):
    a, _, env, _ = two_pools
    assert env["DILOCO_POOL"] == a.slug
    assert env["DATABASE_URL"].startswith(f"postgres://diloco_pool_{a.slug.replace('-', '_')}:")
    assert env["REDIS_URL"].startswith(f"redis://diloco-pool-{a.slug}:")
    assert env["SECRET_KEY"] and env["SECRET_KEY"] != "x"
    with _connect(env) as conn:
        assert _rows(conn, "SELECT current_user")[0][0] == f"diloco_pool_{a.slug.replace('-', '_')}"


def test_role_cannot_read_users_tokens_or_sessions(two_pools):
    _, _, env, _ = two_pools
    with _connect(env) as conn:
        for table in SECRETS:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT * FROM {table} LIMIT 1")  # noqa: S608 - constant names
        readable = {t for (t,) in _rows(
            conn, "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                  "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'v', 'm', 'p') "
                  "AND has_any_column_privilege(c.oid, 'SELECT')")}
    assert readable == READABLE


def test_role_sees_only_its_own_pools_rows(two_pools):
    a, _, env, seeded = two_pools
    job_a, learner_a, node_a = seeded["a"]
    with _connect(env) as conn:
        assert _rows(conn, "SELECT id FROM inventory_pool") == [(a.pk,)]
        assert _rows(conn, "SELECT id FROM inventory_node") == [(node_a.pk,)]
        assert _rows(conn, "SELECT id FROM jobs_learner") == [(learner_a.pk,)]
        assert _rows(conn, "SELECT learner_id FROM coordinator_learnerruntime") == [(learner_a.pk,)]
        assert _rows(conn, "SELECT description FROM jobs_incident") == [("a",)]
        assert _rows(conn, "SELECT id FROM jobs_job") == [(job_a.pk,)]
    # the platform's own connection (the tables' owner) still sees everything
    assert Node.objects.count() == 2 and Learner.objects.count() == 2 and Job.objects.count() == 2


def test_role_cannot_write_another_pools_rows(two_pools):
    _, b, env, seeded = two_pools
    _, learner_a, node_a = seeded["a"]
    _, learner_b, node_b = seeded["b"]
    with _connect(env) as conn:
        # its own learner: liveness and progress
        assert conn.execute("UPDATE jobs_learner SET tokens = 7 WHERE id = %s", [learner_a.pk]).rowcount == 1
        # another pool's: no row to update
        assert conn.execute("UPDATE jobs_learner SET tokens = 7 WHERE id = %s", [learner_b.pk]).rowcount == 0
        assert conn.execute("UPDATE inventory_node SET state = 'lost' WHERE id = %s",
                            [node_b.pk]).rowcount == 0
        assert conn.execute("UPDATE coordinator_learnerruntime SET pid = 1 WHERE learner_id = %s",
                            [learner_b.pk]).rowcount == 0
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # RLS: a row must stay its pool's
            conn.execute("UPDATE inventory_node SET pool_id = %s WHERE id = %s", [b.pk, node_a.pk])
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO inventory_node (pool_id, hostname, worker_name, devices, device_count, "
                         "agent_version, state, registered_at, last_seen) "
                         "VALUES (%s, 'x', 'x@x', '[]', 1, '', 'online', now(), now())", [b.pk])
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # fencing and identity columns
            conn.execute("UPDATE jobs_learner SET incarnation = 9 WHERE id = %s", [learner_a.pk])
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # a worker never writes a job
            conn.execute("UPDATE jobs_job SET status = 'failed'")
    learner_b.refresh_from_db()
    node_b.refresh_from_db()
    assert learner_b.tokens == 0 and node_b.state == Node.State.ONLINE
    assert Learner.objects.get(pk=learner_a.pk).tokens == 7


def test_role_writes_events_of_its_jobs_and_its_own_pool_only(two_pools):
    """A learner's events, and its own pool's (the leader of an island declaring one of its nodes
    lost: found on the sites harness, where the refused row crashed the learner before its incident)."""
    a, b, env, seeded = two_pools
    job_a, job_b = seeded["a"][0], seeded["b"][0]
    insert = ("INSERT INTO jobs_event (job_id, pool_id, kind, message, payload, time) "
              "VALUES (%s, %s, 'failed', 'x', '{}', now())")
    with _connect(env) as conn:
        conn.execute(insert, [job_a.pk, a.pk])
        conn.execute(insert, [None, a.pk])  # dispatch.mark_node_lost
        for job, pool in ((job_b.pk, b.pk), (None, b.pk), (job_b.pk, a.pk), (None, None)):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(insert, [job, pool])


def test_pool_token_is_checked_without_reading_the_tokens(two_pools):
    a, b, env, _ = two_pools
    _, raw_a = PoolToken.issue(a)
    _, raw_b = PoolToken.issue(b)
    with _connect(env) as conn:
        check = "SELECT diloco_pool_token_valid(%s, %s)"
        assert _rows(conn, check, a.slug, raw_a) == [(True,)]
        assert _rows(conn, check, a.slug, raw_b) == [(False,)]
        assert _rows(conn, check, a.slug, "pt_forged") == [(False,)]


def test_provisioning_is_idempotent_and_revocable(make_pool, pool_credentials):
    from apps.inventory.credentials import CredentialError, revoke_pool_credentials

    pool = make_pool()
    first = pool_credentials(pool.slug, password="first-pw")
    second = pool_credentials(pool.slug, password="second-pw")
    with _connect(second) as conn:
        assert _rows(conn, "SELECT count(*) FROM inventory_pool") == [(1,)]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(first["REDIS_URL"]).ping()
    assert redis.Redis.from_url(second["REDIS_URL"]).ping()
    with pytest.raises(CredentialError):
        pool_credentials("no-such-pool")
    with pytest.raises(CredentialError):
        pool_credentials("bad'; DROP ROLE postgres; --")
    revoke_pool_credentials(pool.slug)
    with pytest.raises(psycopg.OperationalError):
        _connect(second)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(second["REDIS_URL"]).ping()


def test_redis_user_reaches_its_queues_only(two_pools):
    from apps.inventory.credentials import KOMBU_SEP

    a, b, env, _ = two_pools
    admin = redis.Redis.from_url(os.environ["REDIS_URL"])
    admin.set("asgi:secret", "x")
    admin.set(":1:diloco:throttle", "x")
    pool = redis.Redis.from_url(env["REDIS_URL"])
    db = pool.connection_pool.connection_kwargs.get("db", 0)
    try:
        queue = f"pool.{a.slug}"
        for key in (queue, f"{queue}{KOMBU_SEP}3", f"{queue}.node.{a.slug}-0@host"):
            pool.lpush(key, "m")
            assert pool.rpop(key) == b"m"
        refused = [
            lambda: pool.get("asgi:secret"),  # the channel layer
            lambda: pool.get(":1:diloco:throttle"),  # the cache
            lambda: pool.lpush(f"pool.{b.slug}", "m"),  # another pool's queue
            lambda: pool.rpop(f"pool.{b.slug}"),
            lambda: pool.lrange("coordinator", 0, -1),  # it sends there, never reads
            lambda: pool.sadd("_kombu.binding.coordinator", "x"),  # nor reroutes it
            lambda: pool.keys("*"),
            lambda: pool.config_get("*"),
            lambda: pool.flushdb(),
            lambda: pool.execute_command("ACL", "SETUSER", "intruder", "on"),
            lambda: pool.publish(f"/{db}.celery.pidbox", "x"),  # broadcast a remote-control command
        ]
        for call in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        assert pool.smembers("_kombu.binding.coordinator") is not None  # routing lookups are reads
    finally:
        admin.delete("asgi:secret", ":1:diloco:throttle", f"pool.{a.slug}")
        pool.close()
        admin.close()


def test_command_prints_the_env_and_revokes(make_pool):
    import io
    import json

    from django.core.management import call_command

    pool = make_pool()
    out = io.StringIO()
    try:
        call_command("pool_credentials", pool.slug, "--password", "pw-cmd", "--format", "json", stdout=out,
                     stderr=io.StringIO())
        env = json.loads(out.getvalue())
        out = io.StringIO()
        call_command("pool_credentials", pool.slug, "--password", "pw-cmd", stdout=out, stderr=io.StringIO())
        printed = dict(line.split("=", 1) for line in out.getvalue().splitlines())
        printed.pop("SECRET_KEY")  # a fresh one each run
        assert printed == {k: v for k, v in env.items() if k != "SECRET_KEY"}
        assert env["DILOCO_POOL"] == pool.slug and ":pw-cmd@" in env["DATABASE_URL"]
        with _connect(env) as conn:
            assert _rows(conn, "SELECT slug FROM inventory_pool") == [(pool.slug,)]
    finally:
        call_command("pool_credentials", pool.slug, "--revoke", stdout=io.StringIO(), stderr=io.StringIO())
    with pytest.raises(psycopg.OperationalError):
        _connect(env)


def test_redis_blob_store_on_the_same_server(make_pool, pool_credentials, settings):
    from trainer.transport import open_store

    settings.BLOB_STORE_URL = os.environ["REDIS_URL"]  # the broker's server, prefix blob:
    pool = make_pool()
    env = pool_credentials(pool.slug)
    assert env["BLOB_STORE_URL"].startswith(f"redis://diloco-pool-{pool.slug}:")
    store = open_store(env["BLOB_STORE_URL"])
    key = f"jobs/{pool.slug}/w"
    try:
        store.put(key, b"weights")
        assert store.get(key) == b"weights"
        assert store.list(f"jobs/{pool.slug}/") == [key]
    finally:
        store.delete(key)
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(env["BLOB_STORE_URL"]).get("asgi:secret")
