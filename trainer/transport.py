"""Blob stores: where contributions, global fragments and checkpoints travel.

One small interface, four backends, all passing the same contract tests:

  memory://[name]                    in-process dict (one shared store per name)
  file:///abs/path  or a plain path  a directory; writes are atomic (temp file + rename)
  redis://host:port/db[?prefix=p]    one Redis key per blob, under `p` (default `blob:`)
  s3://bucket[/prefix][?endpoint_url=http://host:port]
                                     S3-compatible object storage through fsspec/s3fs;
                                     the endpoint may also come from $S3_ENDPOINT_URL or
                                     $AWS_ENDPOINT_URL, credentials from the usual AWS_* vars

Keys are relative paths of letters, digits and `_ . = / -` (no `..`, no leading `/`).
`latest(prefix)` returns the greatest key under the prefix in byte order, so versioned keys
must carry zero-padded numbers (see `version_key`). `get` of a missing key raises KeyError;
`delete` of a missing key is a no-op.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qs, urlparse

_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=/-]*$")
MAX_KEY = 512


def check_key(key: str) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY or not _KEY_RE.match(key):
        raise ValueError(f"invalid blob key {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid blob key {key!r}")
    return key


def check_prefix(prefix: str) -> str:
    if prefix == "":
        return prefix
    if not _KEY_RE.match(prefix) or ".." in prefix.split("/") or "//" in prefix or len(prefix) > MAX_KEY:
        raise ValueError(f"invalid blob prefix {prefix!r}")
    return prefix


def version_key(prefix: str, version: int, width: int = 10) -> str:
    """`prefix/0000000042`: versions that sort as numbers."""
    return f"{prefix.rstrip('/')}/{version:0{width}d}"


@runtime_checkable
class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def latest(self, prefix: str) -> str | None: ...


class _Base:
    url = ""

    def latest(self, prefix: str) -> str | None:
        keys = self.list(prefix)  # type: ignore[attr-defined]
        return max(keys) if keys else None


class MemoryStore(_Base):
    _named: dict[str, MemoryStore] = {}
    _named_lock = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        with cls._named_lock:
            if name not in cls._named:
                cls._named[name] = cls(name)
            return cls._named[name]

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._lock:
            self._data[key] = bytes(data)

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._data[key]
            except KeyError:
                raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._data

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        with self._lock:
            return sorted(k for k in self._data if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._data.pop(key, None)


class FileStore(_Base):
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not start.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(start):
            for f in files:
                if f.startswith(".tmp-"):
                    continue
                key = Path(dirpath, f).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()


class RedisStore(_Base):
    def __init__(self, url: str, namespace: str = "blob:") -> None:
        import redis  # noqa: PLC0415 - only needed for this backend

        parsed = urlparse(url)
        query = parse_qs(parsed.query)
        self.namespace = query.pop("prefix", [namespace])[0]
        clean = parsed._replace(query="").geturl()
        self.client = redis.Redis.from_url(clean)
        self.url = url

    def _k(self, key: str) -> str:
        return self.namespace + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        self.client.set(self._k(key), bytes(data))

    def get(self, key: str) -> bytes:
        data = self.client.get(self._k(key))
        if data is None:
            raise KeyError(key)
        return data

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(self._k(key)))

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.namespace + prefix) + "*"
        n = len(self.namespace)
        return sorted(k.decode()[n:] for k in self.client.scan_iter(match=pattern, count=1000))

    def delete(self, key: str) -> None:
        self.client.delete(self._k(key))


class S3Store(_Base):
    def __init__(self, url: str) -> None:
        import s3fs  # noqa: PLC0415 - only needed for this backend

        parsed = urlparse(url)
        query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
        endpoint = query.get("endpoint_url") or os.environ.get("S3_ENDPOINT_URL") or os.environ.get(
            "AWS_ENDPOINT_URL")
        if not parsed.netloc:
            raise ValueError(f"s3 url {url!r} needs a bucket")
        self.bucket = parsed.netloc
        self.base = parsed.path.strip("/")
        client_kwargs = {"endpoint_url": endpoint} if endpoint else {}
        if query.get("region"):
            client_kwargs["region_name"] = query["region"]
        self.fs = s3fs.S3FileSystem(client_kwargs=client_kwargs, use_listings_cache=False,
                                    skip_instance_cache=True)
        self.url = url

    def _path(self, key: str) -> str:
        check_key(key)
        return "/".join(x for x in (self.bucket, self.base, key) if x)

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), bytes(data))

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        try:
            self.fs.info(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        root = "/".join(x for x in (self.bucket, self.base) if x)
        start = root + ("/" + prefix.rsplit("/", 1)[0] if "/" in prefix else "")
        try:
            found = self.fs.find(start)
        except FileNotFoundError:
            return []
        out = []
        for path in found:
            key = path[len(root) + 1:]
            if key.startswith(prefix):
                out.append(key)
        return sorted(out)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(key))


def open_store(url: str) -> BlobStore:
    """A blob store from its URL (see the module doc)."""
    if not url:
        raise ValueError("empty blob store url")
    parsed = urlparse(url)
    scheme = parsed.scheme
    if scheme == "memory":
        return MemoryStore.named(parsed.netloc + parsed.path)
    if scheme == "file":
        if not parsed.path:
            raise ValueError(f"file url {url!r} needs a path")
        return FileStore(parsed.path)
    if scheme == "":
        return FileStore(url)
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url)
    if scheme == "s3":
        return S3Store(url)
    raise ValueError(f"unsupported blob store {url!r}: use memory://, file://, redis:// or s3://")
