"""A real platform stack as subprocesses: end-to-end tests (api/cli/browser too) and chaos_drill.

    from tests.support.stack import Stack

    @pytest.fixture
    def stack(transactional_db, tmp_path):          # the processes must see committed rows
        with Stack(tmp_path, pools={"alpha": 2, "beta": 2}) as s:
            yield s

    def test_x(stack):
        stack.web_url                     # http://127.0.0.1:<free port> (HTTP + websockets)
        stack.pools["alpha"].token        # raw pool token (telemetry auth)
        stack.kill_worker("alpha-0")      # SIGKILL the whole worker (main process + pool children)
        stack.start_worker("alpha")       # a fresh worker node for the pool
        stack.kill("coordinator"); stack.restart("coordinator")
        stack.kill("syncer"); stack.restart("syncer")     # the worker that runs the syncer shards
        stack.wait_for(lambda: ..., timeout=10, what="...")

Processes (all with the Redis broker from REDIS_URL and the test database of the caller), the
command lines of diloco_platform.processes (as the Procfile, compose and the demo):
  web           gunicorn + uvicorn workers on a free port (`web_workers=N`; default 1: a test
                that needs several processes, e.g. the channel layer's fan-out, asks for them)
  <pool>-<i>    `celery worker -Q pool.<slug> --concurrency N --prefetch-multiplier 1
                 --disable-prefetch`, env DILOCO_POOL=<slug>, DILOCO_POOL_TOKEN=<raw token>, and
                 `pool_env[<slug>]` on top (e.g. the restricted DATABASE_URL / REDIS_URL of
                 apps.inventory.credentials)
  coordinator   `celery worker -Q coordinator` (threads pool; short housekeeping tasks);
                `coordinators=2` adds a standby "coordinator-1" (any coordinator worker runs the
                watchdog and restarts syncers)
  syncer        `celery worker -Q syncer --concurrency <SYNCER_SLOTS>` (threads pool; the syncer
                shards; SYNCER_SLOTS from extra_env, default 8); as many as coordinators unless
                `syncers=N` says otherwise ("syncer-1" ...: hot standbys)
  beat          `celery beat` (watchdog, rebalancer ticks)

Each process runs in its own session (process group), logs to <tmp>/logs/<name>.log, and
is killed (group SIGKILL after a short SIGTERM grace) when the stack stops. The helper
creates the pools it is given (and a CPU accelerator type) if they do not exist, and
flushes its Redis database first (pass flush_redis=False to keep it).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from diloco_platform import processes

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
QUIET = ("--without-gossip", "--without-mingle")  # fewer broker messages between test nodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    """DATABASE_URL of the database this process uses (in a test run: the test database)."""
    from django.db import connection

    sd = connection.settings_dict
    if "sqlite" in sd["ENGINE"]:
        name = str(sd["NAME"])
        if name == ":memory:" or name.startswith("file:memorydb"):
            raise RuntimeError("the live stack cannot share an in-memory SQLite database")
        return f"sqlite:///{name}"
    if "postgresql" not in sd["ENGINE"]:
        raise RuntimeError("the live stack needs PostgreSQL or a SQLite file")
    auth = quote(sd.get("USER") or "postgres")
    if sd.get("PASSWORD"):
        auth += ":" + quote(sd["PASSWORD"])
    host = sd.get("HOST") or "127.0.0.1"
    port = sd.get("PORT") or 5432
    return f"postgres://{auth}@{host}:{port}/{sd['NAME']}"


@dataclass
class PoolHandle:
    slug: str
    slots: int
    token: str
    workers: list[str] = field(default_factory=list)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class StackError(RuntimeError):
    pass


class RedisServer:
    """A private redis-server on a free port (so a drill can kill and restart it)."""

    def __init__(self, tmp: Path | str):
        self.dir = Path(tmp) / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.popen: subprocess.Popen | None = None

    def start(self, timeout: float = 10) -> None:
        import redis

        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - lives as long as the server
        self.popen = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping()
                return
            except Exception:
                time.sleep(0.05)
        raise StackError("redis-server did not start")

    def kill(self) -> None:
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class Stack:
    """Start web, pool workers, coordinator, syncer and beat as real processes; stop them all on exit."""

    def __init__(
        self,
        tmp: Path | str,
        pools: dict[str, int] | None = None,
        *,
        workers_per_pool: int = 1,
        coordinator: bool = True,
        coordinators: int = 1,
        syncers: int | None = None,
        beat: bool = True,
        web: bool = True,
        web_workers: int = 1,
        heartbeat_interval_s: float = 0.5,
        heartbeat_timeout_s: float = 1.5,
        blob_store_url: str | None = None,
        redis_url: str | None = None,
        speed_factors: dict[str, float] | None = None,
        extra_env: dict[str, str] | None = None,
        pool_env: dict[str, dict[str, str]] | None = None,
        flush_redis: bool = True,
        start_timeout: float = 60.0,
    ):
        self.tmp = Path(tmp)
        self.logs = self.tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.var = self.tmp / "var"
        self.var.mkdir(exist_ok=True)
        self.pool_slots = dict(pools if pools is not None else {"alpha": 2, "beta": 2})
        self.workers_per_pool = workers_per_pool
        self.want = {"coordinator": coordinator, "beat": beat, "web": web}
        self.web_workers = web_workers
        self.coordinators = coordinators
        self.syncers = coordinators if syncers is None else syncers
        self.speed_factors = speed_factors or {}
        self.pool_env = pool_env or {}  # slug -> variables of that pool's workers (e.g. their credentials)
        self.redis_url = redis_url or os.environ.get("REDIS_URL", "")
        if not self.redis_url:
            raise StackError("the live stack needs Redis (set REDIS_URL)")
        self.blob_store_url = blob_store_url or f"file://{self.tmp / 'blobs'}"
        self.coordinator_token = "ct_" + secrets.token_urlsafe(24)
        self.port = free_port()
        self.web_url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.flush_redis = flush_redis
        self.start_timeout = start_timeout
        self.procs: dict[str, Proc] = {}
        self.pools: dict[str, PoolHandle] = {}
        self.env = {
            **os.environ,
            "DILOCO_CACHE_DIR": os.environ.get("DILOCO_CACHE_DIR") or str(ROOT / "var" / "cache"),
            "DJANGO_SETTINGS_MODULE": "diloco_platform.settings",
            "DATABASE_URL": database_url(),
            "REDIS_URL": self.redis_url,
            "BLOB_STORE_URL": self.blob_store_url,
            "DILOCO_VAR_DIR": str(self.var),
            "DILOCO_WEB_URL": self.web_url,
            "COORDINATOR_TOKEN": self.coordinator_token,
            "HEARTBEAT_INTERVAL_S": str(heartbeat_interval_s),
            "HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "DJANGO_ALLOW_ASYNC_UNSAFE": "true",
            **(extra_env or {}),
        }
        self.env.pop("PYTEST_CURRENT_TEST", None)
        self.syncer_slots = int(self.env.get("SYNCER_SLOTS") or processes.SYNCER_SLOTS_DEFAULT)
        self._worker_seq: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.flush_redis:
            import redis

            redis.Redis.from_url(self.redis_url).flushdb()
        self._ensure_pools()
        names = []
        if self.want["web"]:
            names.append(self._spawn(processes.web(self.port, python=PY),
                                     {"WEB_CONCURRENCY": str(self.web_workers)}))
        if self.want["coordinator"]:
            for i in range(self.coordinators):
                names.append(self._spawn_coordinator("coordinator" if i == 0 else f"coordinator-{i}"))
            for i in range(self.syncers):
                names.append(self._spawn_syncer("syncer" if i == 0 else f"syncer-{i}"))
        for slug in self.pool_slots:
            for _ in range(self.workers_per_pool):
                names.append(self.start_worker(slug, wait=False))
        if self.want["beat"]:
            names.append(self._spawn_beat())
        for name in names:
            self.wait_ready(name)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            if proc.popen is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.05, deadline - time.monotonic()))
            # the group may hold pool children even after the main process exited
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=5)
        from django.db import connections

        connections.close_all()

    # ------------------------------------------------------------------ processes
    def _spawn(self, spec: processes.ProcessSpec, env: dict[str, str] | None = None) -> str:
        log = self.logs / f"{spec.name}.log"
        proc = Proc(spec.name, list(spec.argv), {**self.env, **(env or {}), **spec.env}, log)
        with open(log, "ab") as fh:
            fh.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(proc.cmd)}\n".encode())
            proc.popen = processes.spawn(spec, proc.env, stdout=fh, cwd=ROOT)
        self.procs[spec.name] = proc
        return spec.name

    def _node(self, name: str) -> str:
        return f"{name}-{self.port}@%h"

    def _spawn_coordinator(self, name: str = "coordinator") -> str:
        return self._spawn(processes.coordinator(name=name, node=self._node(name), python=PY, extra=QUIET))

    def _spawn_syncer(self, name: str = "syncer") -> str:
        return self._spawn(processes.syncer(self.syncer_slots, name=name, node=self._node(name), python=PY,
                                            extra=QUIET))

    def _spawn_beat(self) -> str:
        return self._spawn(processes.beat(schedule=str(self.var / "beat-schedule"),
                                          pidfile=str(self.var / "beat.pid"), python=PY))

    def start_worker(self, slug: str, *, slots: int | None = None, wait: bool = True,
                     env: dict[str, str] | None = None) -> str:
        """Start one more worker node for pool `slug` (`env`: this worker's own variables on top, e.g.
        DILOCO_NODE_ADDRESS); returns its process name (<slug>-<i>)."""
        i = self._worker_seq.get(slug, 0)
        self._worker_seq[slug] = i + 1
        name = f"{slug}-{i}"
        pool = self.pools[slug]
        self._spawn(processes.pool_worker(slug, slots or pool.slots, name=name, node=self._node(name),
                                          token=pool.token, python=PY, extra=QUIET),
                    {**self.pool_env.get(slug, {}), **(env or {})})
        pool.workers.append(name)
        if wait:
            self.wait_ready(name)
        return name

    def worker_hostname(self, name: str) -> str:
        return f"{name}-{self.port}@{socket.gethostname()}"

    def wait_ready(self, name: str, timeout: float | None = None) -> None:
        proc = self.procs[name]
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise StackError(f"{name} exited with {proc.popen.returncode}:\n{self.tail(name)}")
            if name == "web":
                if self._http_ok("/healthz"):
                    return
            else:
                text = self._log_since_start(proc)
                marker = "beat: Starting" if name == "beat" else " ready."
                if marker in text:
                    return
            time.sleep(0.2)
        raise StackError(f"{name} not ready after {timeout or self.start_timeout}s:\n{self.tail(name)}")

    def _log_since_start(self, proc: Proc) -> str:
        text = proc.log.read_text(errors="replace")
        return text[text.rfind("=== start "):]

    def _http_ok(self, path: str) -> bool:
        import http.client

        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", path)
            status = conn.getresponse().status
            conn.close()
            return status < 500 or status == 503  # 503 = degraded but serving
        except OSError:
            return False

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group of `name` (main process and its pool children)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, sig)
        if sig == signal.SIGKILL:
            proc.popen.wait(timeout=10)

    def kill_worker(self, name: str) -> None:
        self.kill(name, signal.SIGKILL)

    def restart(self, name: str, wait: bool = True) -> None:
        """Kill (if alive) and start `name` again with the same command line."""
        proc = self.procs[name]
        if proc.alive():
            self.kill(name)
        self._spawn(processes.ProcessSpec(name, tuple(proc.cmd)), proc.env)
        if wait:
            self.wait_ready(name)

    def children(self, name: str) -> list[int]:
        """PIDs of the pool child processes of a worker (where learners run)."""
        out = subprocess.run(["pgrep", "-P", str(self.procs[name].pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def tail(self, name: str, lines: int = 60) -> str:
        proc = self.procs.get(name)
        if not proc or not proc.log.exists():
            return ""
        return "\n".join(proc.log.read_text(errors="replace").splitlines()[-lines:])

    def dump_logs(self, lines: int = 40) -> str:
        return "\n".join(f"----- {n} -----\n{self.tail(n, lines)}" for n in self.procs)

    # ------------------------------------------------------------------ data
    def _ensure_pools(self) -> None:
        from apps.inventory.models import AcceleratorType, Pool, PoolToken

        acc = AcceleratorType.objects.filter(kind="cpu").first()
        if acc is None:
            acc = AcceleratorType.objects.create(
                slug="test-cpu", vendor="Generic", model="CPU core", kind="cpu", generation="x86-64",
                year=2024, memory_gib=8, peak_bf16_tflops=0.5, tdp_watts=15,
            )
        for slug, slots in self.pool_slots.items():
            pool, _ = Pool.objects.get_or_create(
                slug=slug,
                defaults={"name": f"Test pool {slug}", "region": "local", "accelerator": acc,
                          "device_count": slots, "link_gbps": 10.0,
                          "speed_factor": self.speed_factors.get(slug, 1.0)},
            )
            _, raw = PoolToken.issue(pool)
            self.pools[slug] = PoolHandle(slug, slots, raw)

    # ------------------------------------------------------------------ waiting
    def wait_for(self, predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition",
                 interval: float = 0.1):
        """Poll `predicate` (DB reads are fine) until truthy; returns its value or raises with logs."""
        from django.db import close_old_connections

        deadline = time.monotonic() + timeout
        while True:
            close_old_connections()
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout}s waiting for {what}\n{self.dump_logs()}")
            time.sleep(interval)
