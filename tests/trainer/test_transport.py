"""One contract, every blob store: memory, filesystem, Redis on 127.0.0.1, S3 (moto server)."""

from __future__ import annotations

import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainer.transport import BlobStore, FileStore, MemoryStore, open_store, version_key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _redis_url() -> str:
    return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/6")


@pytest.fixture(params=["memory", "file", "redis", "s3"])
def store(request, tmp_path) -> BlobStore:
    kind = request.param
    ns = uuid.uuid4().hex[:8]
    if kind == "memory":
        yield open_store(f"memory://contract-{ns}")
    elif kind == "file":
        yield open_store(f"file://{tmp_path}/blobs")
    elif kind == "redis":
        import redis

        url = _redis_url()
        try:
            redis.Redis.from_url(url).ping()
        except redis.exceptions.ConnectionError:
            pytest.fail(f"Redis is not reachable at {url} (the suite runs against a real Redis)")
        s = open_store(f"{url}?prefix=test-blob-{ns}:")
        yield s
        for key in s.list(""):
            s.delete(key)
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        import boto3

        bucket = f"bucket-{ns}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield open_store(f"s3://{bucket}/jobs?endpoint_url={endpoint}")


def test_put_get_roundtrip_binary(store):
    data = bytes(range(256)) * 10
    store.put("job-1/contrib/0000000001", data)
    assert store.get("job-1/contrib/0000000001") == data
    assert store.exists("job-1/contrib/0000000001")


def test_overwrite_replaces(store):
    store.put("a/x", b"one")
    store.put("a/x", b"two")
    assert store.get("a/x") == b"two"


def test_missing_key_raises_keyerror(store):
    with pytest.raises(KeyError):
        store.get("nope/missing")
    assert not store.exists("nope/missing")


def test_empty_blob(store):
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_list_by_prefix_sorted(store):
    for key in ("j/g/0/0000000002", "j/g/0/0000000010", "j/g/1/0000000001", "j/c/x", "other/y"):
        store.put(key, key.encode())
    assert store.list("j/g/0/") == ["j/g/0/0000000002", "j/g/0/0000000010"]
    assert store.list("j/g/") == ["j/g/0/0000000002", "j/g/0/0000000010", "j/g/1/0000000001"]
    assert store.list("j/g/0/00000000") == ["j/g/0/0000000002", "j/g/0/0000000010"]
    assert store.list("zzz/") == []
    assert set(store.list("")) >= {"j/c/x", "other/y"}


def test_latest_version(store):
    assert store.latest("job/frag0/") is None
    for v in (3, 12, 7):
        store.put(version_key("job/frag0", v), str(v).encode())
    assert store.latest("job/frag0/") == version_key("job/frag0", 12)
    assert store.get(store.latest("job/frag0/")) == b"12"


def test_delete_is_idempotent(store):
    store.put("d/k", b"x")
    store.delete("d/k")
    store.delete("d/k")
    assert not store.exists("d/k")
    assert store.list("d/") == []


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", "../up", "sp ace", "a\x00b", "x" * 600])
def test_bad_keys_are_refused(store, bad):
    with pytest.raises(ValueError, match="invalid blob key"):
        store.put(bad, b"x")


def test_concurrent_writers(store):
    def put(i):
        store.put(f"conc/{i:04d}", str(i).encode())

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(put, range(20)))
    assert len(store.list("conc/")) == 20


def test_open_store_urls(tmp_path):
    assert isinstance(open_store("memory://x"), MemoryStore)
    assert open_store("memory://same") is open_store("memory://same")
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    assert isinstance(open_store(str(tmp_path / "plain")), FileStore)
    with pytest.raises(ValueError, match="unsupported"):
        open_store("ftp://host/x")


def test_file_store_writes_atomically(tmp_path):
    s = FileStore(tmp_path)
    s.put("k/v", b"x" * 1000)
    assert [p.name for p in (tmp_path / "k").iterdir()] == ["v"]  # no temp files left behind
