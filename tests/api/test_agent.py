"""Worker endpoints: a pool token acts only for learners placed on its own pool."""
from __future__ import annotations

import pytest

from apps.inventory.models import PoolToken
from apps.jobs.models import Learner

from .conftest import client_for, make_job

pytestmark = pytest.mark.django_db


def url(job, i):
    return f"/api/v1/agent/jobs/{job.pk}/learners/{i}/"


def test_right_pool_reads_its_assignment(alice_job, token_a):
    r = client_for(token=token_a).get(url(alice_job, 1))
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["job"] == alice_job.pk and body["index"] == 1 and body["pool"] == "pool-a"
    assert body["work_size"] == 20 and body["spec"]["learners"] == 2 and body["job_status"] == "running"


def test_wrong_pool_is_refused(alice_job, token_b):
    r = client_for(token=token_b).get(url(alice_job, 0))
    assert r.status_code == 403
    assert "pool-b" in r.json()["detail"]


def test_job_the_pool_does_not_serve(alice, alice_job, pool_a, pool_b, token_a, token_b):
    mixed = make_job(alice, pool=pool_a)
    Learner.objects.filter(job=mixed, index=1).update(pool=pool_b)
    assert client_for(token=token_a).get(url(mixed, 0)).status_code == 200
    assert client_for(token=token_a).get(url(mixed, 1)).status_code == 403
    assert client_for(token=token_b).get(url(mixed, 1)).status_code == 200
    assert client_for(token=token_a).get(url(mixed, 7)).status_code == 403  # no such learner
    assert client_for(token=token_a).get(f"/api/v1/agent/jobs/{10**12}/learners/0/").status_code == 404


def test_terminal_job_has_no_assignment(alice, pool_a, token_a):
    done = make_job(alice, status="completed", pool=pool_a)
    assert client_for(token=token_a).get(url(done, 0)).status_code == 403


def test_people_and_revoked_tokens_cannot_act_as_workers(alice_job, as_alice, as_staff, anon, pool_a):
    assert as_alice.get(url(alice_job, 0)).status_code == 401  # a personal token is no pool token
    assert as_staff.get(url(alice_job, 0)).status_code == 401
    assert anon.get(url(alice_job, 0)).status_code == 401
    tok, raw = PoolToken.issue(pool_a)
    from django.utils import timezone

    PoolToken.objects.filter(pk=tok.pk).update(revoked_at=timezone.now())
    assert client_for(token=raw).get(url(alice_job, 0)).status_code == 401


def test_assignment_list_is_scoped(alice, bob, alice_job, pool_a, pool_b, token_a, token_b):
    make_job(bob, pool=pool_b, learners=1)
    make_job(alice, status="cancelled", pool=pool_a)
    rows = client_for(token=token_a).get("/api/v1/agent/assignments/").json()
    assert [(r["job"], r["index"]) for r in rows] == [(alice_job.pk, 0), (alice_job.pk, 1)]
    rows = client_for(token=token_b).get("/api/v1/agent/assignments/").json()
    assert [r["pool"] for r in rows] == ["pool-b"]


def _commit(job, fragment, version, epoch, store, blob):
    """What the syncer does for one outer step: the global blob under the committing epoch's key
    (SyncerLoop.commit), then the commit transaction of the lease's epoch (DjangoSyncerHost.commit)."""
    from apps.coordinator.models import SyncerLease
    from apps.coordinator.syncer import DjangoSyncerHost
    from trainer.runtime import keys
    from trainer.runtime.syncer_host import Commit

    key = keys.global_key(job.pk, fragment, version, epoch)
    store.put(key, blob)
    SyncerLease.objects.update_or_create(job=job, shard=0, defaults={"epoch": epoch})
    commits = job.outer_step_records.count() + 1
    DjangoSyncerHost(job.pk, epoch, "w").commit(Commit(
        fragment=fragment, version=version, contributors=[], merged_norm=1.0, duration_s=0.0, blob_key=key,
        blob_bytes=len(blob), commits=commits, state_key=keys.syncer_state_key(job.pk, commits, epoch),
        head={fragment: version}, head_epochs={fragment: epoch}, counters={"duplicates_refused": 0,
                                                                          "zombies_refused": 0},
        tokens=0))
    return key


def test_global_fragment_blob_is_scoped_to_the_pool(alice, pool_a, token_a, token_b, settings, tmp_path):
    transport = pytest.importorskip("trainer.transport")
    keys = pytest.importorskip("trainer.runtime.keys")
    settings.BLOB_STORE_URL = f"file://{tmp_path}"
    job = make_job(alice, pool=pool_a, fragments=2, inner_steps=4)
    store = transport.open_store(settings.BLOB_STORE_URL)
    v3 = _commit(job, 1, 3, 0, store, b"v3-bytes")
    # epoch 1 wrote version 12 and was fenced before its commit; epoch 2 wrote and committed it
    store.put(keys.global_key(job.pk, 1, 12, 1), b"v12-fenced")
    v12 = _commit(job, 1, 12, 2, store, b"v12-bytes")
    # written by epoch 2, never committed (the syncer stopped between the blob and the commit)
    store.put(keys.global_key(job.pk, 1, 13, 2), b"v13-uncommitted")
    base = f"/api/v1/agent/jobs/{job.pk}/learners/0/global/"
    r = client_for(token=token_a).get(base + "1/")
    assert r.status_code == 200, r.content
    assert b"".join(r.streaming_content) == b"v12-bytes" and r["X-Blob-Key"] == v12
    r = client_for(token=token_a).get(base + "1/?version=3")
    assert r.status_code == 200, r.content
    assert b"".join(r.streaming_content) == b"v3-bytes" and r["X-Blob-Key"] == v3
    r = client_for(token=token_a).get(base + "1/?version=12")
    assert r.status_code == 200 and b"".join(r.streaming_content) == b"v12-bytes"
    assert client_for(token=token_a).get(base + "1/?version=13").status_code == 404  # not committed
    assert client_for(token=token_a).get(base + "1/?version=5").status_code == 404  # never written
    assert client_for(token=token_a).get(base + "0/").status_code == 404  # no version yet
    assert client_for(token=token_a).get(base + "2/").status_code == 404  # no such fragment
    assert client_for(token=token_a).get(base + "1/?version=x").status_code == 400
    # the token of another pool reads nothing of this job
    assert client_for(token=token_b).get(base + "1/").status_code == 403
