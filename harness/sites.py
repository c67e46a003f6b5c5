"""Several sites on one machine: a control plane and N sites in network namespaces, every
site behind its own shaped uplink. The processes are the platform's own (diloco_platform.processes),
started as docs/operations.md says, so what runs here is what a multi-site deployment runs.

    wan (a bridge: the "internet")
     |- ctl   10.77.0.1   PostgreSQL cluster, redis-server (broker + blob store), web,
     |                    coordinator, syncer, beat (unshaped: the control plane's data centre)
     |- s1 (a switch) -- uplink shaped at s1's rate, both ways
     |    |- s1n1 10.77.1.1   pool worker "s1", node 1 (its own var and cache directory)
     |    |- s1n2 10.77.1.2   ...  (links inside a site are unshaped)
     |- s2 ...

The blob store is the control plane's Redis, so weights and pseudo-gradients cross the
uplinks like everything else (Redis rather than an S3 server: it is already the broker, it
is on every machine of this kind, and the transport's Redis backend is the one a LAN uses).

A site's pool worker connects with the least-privilege credentials of docs/security.md
(`apps.inventory.credentials`): its own database role and Redis user, its own SECRET_KEY.

Faults: `partition(site)` takes the uplink down (frames dropped, TCP waits), `heal(site)`;
`kill_site(site)` SIGKILLs every process of a site at once, `start_site(site)` starts fresh
workers; `shape(site, mbit)` changes a live link's rate; `partition_node(site, j)` cuts one
node from its site's switch.

    with Sites(tmp, [SiteSpec("s1", 1000), SiteSpec("s2", 100), SiteSpec("s3", 20)]) as sites:
        job = sites.submit(spec)              # through the REST API, as a user
        sites.partition("s2"); ...; sites.heal("s2")
        sites.sql("select status from jobs_job where id = %s", [job])
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco_platform import processes

from . import netns

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CTL_ADDR = "10.77.0.1"
PG_PORT, REDIS_PORT, WEB_PORT = 5432, 6379, 8000
QUIET = ("--without-gossip", "--without-mingle")


class SitesError(RuntimeError):
    pass


@dataclass
class SiteSpec:
    """One site: its pool's slug, its uplink's rate (Mbit/s; None: unshaped), its nodes."""

    name: str
    mbit: float | None = None
    nodes: int = 1
    slots: int = 1  # learner slots (worker processes) per node


@dataclass
class Proc:
    name: str
    ns: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


SPAN_NODE = 99  # the node number, in every site, of the spanning pool's node


def node_addr(site_index: int, node: int) -> str:
    return f"10.77.{site_index}.{node}"


class Sites:
    """The namespaces, links and processes of a multi-site deployment; all gone on exit."""

    def __init__(self, tmp: Path | str, sites: list[SiteSpec], *, prefix: str | None = None,
                 heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 8.0,
                 extra_env: dict[str, str] | None = None, least_privilege: bool = True,
                 start_timeout: float = 120.0, spanning_pool: str | None = None):
        self.tmp = Path(tmp)
        self.logs = self.tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.sites = {s.name: s for s in sites}
        self.index = {s.name: i + 1 for i, s in enumerate(sites)}
        self.prefix = prefix or f"dls{secrets.token_hex(2)}"
        self.least_privilege = least_privilege
        # heartbeat_timeout_s: tc here has tbf and pfifo only (no fq_codel): a heartbeat queues behind
        # its site's bulk uploads (a checkpoint takes ~4 s at 20 Mbit/s), and at 5 s the watchdog
        # declared healthy learners of the 20 Mbit/s site lost in a fault-free run
        # a pool with one one-slot node in every site (SPAN_NODE): an island over it spans the sites'
        # shaped uplinks (the data-parallel baseline of the WAN benchmark)
        self.spanning_pool = spanning_pool
        self.start_timeout = start_timeout
        self.procs: dict[str, Proc] = {}
        self.redis_password = secrets.token_hex(12)
        self.secret_key = secrets.token_urlsafe(40)
        self.web_url = f"http://{CTL_ADDR}:{WEB_PORT}"
        self.database_url = f"postgres://postgres@{CTL_ADDR}:{PG_PORT}/diloco"
        self.redis_url = f"redis://:{self.redis_password}@{CTL_ADDR}:{REDIS_PORT}/0"
        self.blob_store_url = f"redis://:{self.redis_password}@{CTL_ADDR}:{REDIS_PORT}/1"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "DJANGO_SETTINGS_MODULE": "diloco_platform.settings",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "HEARTBEAT_INTERVAL_S": str(heartbeat_interval_s),
            "HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
            "DILOCO_CACHE_DIR": os.environ.get("DILOCO_CACHE_DIR") or str(ROOT / "var" / "cache"),
            # an island's collectives give up after this long: a rank cut off by a partition fails
            # its island within it (the default, 120 s, suits slow first steps on big models)
            "ISLAND_TIMEOUT_S": "20",
            **(extra_env or {}),
        }
        self.ctl_env = {
            **self.env,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "BLOB_STORE_URL": self.blob_store_url,
            "DILOCO_WEB_URL": self.web_url,
            "ALLOWED_HOSTS": f"{CTL_ADDR},127.0.0.1,localhost",
            "SECRET_KEY": self.secret_key,
            "COORDINATOR_TOKEN": "ct_" + secrets.token_urlsafe(24),
            "DILOCO_VAR_DIR": str(self.tmp / "ctl-var"),
        }
        self.bootstrap: dict = {}
        self.pg_dir: Path | None = None
        self._db = None

    # ------------------------------------------------------------------ names
    @property
    def wan(self) -> str:
        return f"{self.prefix}-wan"

    @property
    def ctl(self) -> str:
        return f"{self.prefix}-ctl"

    def switch(self, site: str) -> str:
        return f"{self.prefix}-s{self.index[site]}"

    def node_ns(self, site: str, j: int) -> str:
        return f"{self.prefix}-s{self.index[site]}n{j}"

    def uplink(self, site: str) -> tuple[str, str]:
        """(namespace, interface) of the wan end of a site's uplink."""
        return self.wan, f"up{self.index[site]}"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Sites:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        reason = netns.available()
        if reason:
            raise SitesError(reason)
        self._network()
        self._postgres()
        self._redis()
        self.bootstrap = self._bootstrap()
        names = [self._spawn_ctl(processes.web(WEB_PORT, host=CTL_ADDR, python=PY),
                                 {"WEB_CONCURRENCY": "1"}),
                 self._spawn_ctl(processes.coordinator(python=PY, extra=QUIET)),
                 self._spawn_ctl(processes.syncer(processes.SYNCER_SLOTS_DEFAULT, python=PY, extra=QUIET))]
        for site in self.sites:
            names += self.start_site(site, wait=False)
            if self.spanning_pool:
                names.append(self.start_node(site, SPAN_NODE, wait=False))
        names.append(self._spawn_ctl(processes.beat(schedule=str(self.tmp / "beat-schedule"), python=PY)))
        for name in names:
            self.wait_ready(name)

    def down(self) -> None:
        """Every process killed, every namespace deleted (their links with them), even midway."""
        for proc in self.procs.values():
            self._kill(proc, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=max(0.05, deadline - time.monotonic()))
                self._kill(proc, signal.SIGKILL)
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()
        for ns in netns.names(self.prefix + "-"):
            netns.delete(ns)
        if self.pg_dir is not None:
            shutil.rmtree(self.pg_dir, ignore_errors=True)

    @staticmethod
    def _kill(proc: Proc, sig: int) -> None:
        if proc.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, sig)
            if sig == signal.SIGKILL:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=10)

    # ------------------------------------------------------------------ network
    def _network(self) -> None:
        for ns in netns.names(self.prefix + "-"):
            netns.delete(ns)
        netns.add(self.wan)
        netns.bridge(self.wan)
        netns.add(self.ctl)
        netns.veth(self.ctl, "eth0", self.wan, "upctl")
        netns.attach(self.wan, "upctl")
        netns.address(self.ctl, "eth0", f"{CTL_ADDR}/16")
        for site, spec in self.sites.items():
            sw, (wan_ns, up) = self.switch(site), self.uplink(site)
            netns.add(sw)
            netns.bridge(sw)
            netns.veth(sw, "wan0", wan_ns, up)
            netns.attach(sw, "wan0")
            netns.attach(wan_ns, up)
            self.shape(site, spec.mbit)
            for j in [*range(1, spec.nodes + 1), *([SPAN_NODE] if self.spanning_pool else [])]:
                ns = self.node_ns(site, j)
                netns.add(ns)
                netns.veth(ns, "eth0", sw, f"n{j}")
                netns.attach(sw, f"n{j}")
                netns.address(ns, "eth0", f"{node_addr(self.index[site], j)}/16")

    def shape(self, site: str, mbit: float | None) -> None:
        """Both directions of a site's uplink at `mbit` (upload at the site, download at the wan)."""
        netns.shape(self.switch(site), "wan0", mbit)
        netns.shape(*self.uplink(site), mbit)
        self.sites[site].mbit = mbit

    def partition(self, site: str) -> None:
        netns.set_up(*self.uplink(site), False)

    def heal(self, site: str) -> None:
        netns.set_up(*self.uplink(site), True)

    def partition_node(self, site: str, j: int, cut: bool = True) -> None:
        netns.set_up(self.switch(site), f"n{j}", not cut)

    def uplink_bytes(self, site: str) -> dict[str, int]:
        """The site's uplink counters as the site sees them: tx = sent out, rx = received."""
        return netns.counters(self.switch(site), "wan0")

    # ------------------------------------------------------------------ services
    def _postgres(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        if not bins:
            raise SitesError("PostgreSQL server binaries not found under /usr/lib/postgresql")
        bindir = Path(bins[-1]).parent
        # a folder of its own: the postgres user cannot enter a 0700 parent such as pytest's tmp_path
        self.pg_dir = Path(tempfile.mkdtemp(prefix="sites-pg-"))
        data = self.pg_dir / "data"
        data.mkdir()
        shutil.chown(self.pg_dir, "postgres", "postgres")
        shutil.chown(data, "postgres", "postgres")
        _run(["runuser", "-u", "postgres", "--", str(bindir / "initdb"), "-D", str(data), "-U", "postgres",
              "--auth=trust", "--no-sync", "-E", "UTF8"], "initdb")
        # the owner only from the control plane; every other role (pools) with a password
        sites_auth = "scram-sha-256" if self.least_privilege else "trust"
        (data / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all postgres {CTL_ADDR}/32 trust\n"
            f"host all all 10.77.0.0/16 {sites_auth}\n")
        self._spawn("postgres", self.ctl, [
            "runuser", "-u", "postgres", "--", str(bindir / "postgres"), "-D", str(data),
            "-c", f"listen_addresses={CTL_ADDR}", "-c", f"port={PG_PORT}",
            "-c", f"unix_socket_directories={data}", "-c", "fsync=off", "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off", "-c", "max_connections=300"], self.env)
        self._wait(lambda: self._alive("postgres") and _run(
            ["ip", "netns", "exec", self.ctl, str(bindir / "pg_isready"), "-h", CTL_ADDR, "-p", str(PG_PORT)],
            check=False).returncode == 0, "postgres", 30)
        _run(["ip", "netns", "exec", self.ctl, "psql", "-h", CTL_ADDR, "-U", "postgres", "-c",
              "CREATE DATABASE diloco"], "createdb")

    def _redis(self) -> None:
        d = self.tmp / "redis"
        d.mkdir(exist_ok=True)
        self._spawn("redis", self.ctl, ["redis-server", "--bind", CTL_ADDR, "--port", str(REDIS_PORT),
                                        "--save", "", "--appendonly", "no", "--dir", str(d),
                                        "--requirepass", self.redis_password], self.env)
        self._wait(lambda: self._alive("redis") and "PONG" in _run(
            ["ip", "netns", "exec", self.ctl, "redis-cli", "-h", CTL_ADDR, "-a", self.redis_password,
             "--no-auth-warning", "ping"], check=False).stdout, "redis", 20)

    def _bootstrap(self) -> dict:
        """Migrate, then create the pools, their tokens and credentials and a user (harness.bootstrap)."""
        _run(["ip", "netns", "exec", self.ctl, PY, "manage.py", "migrate", "--noinput", "-v", "0"],
             "migrate", env=self.ctl_env)
        pools = {s: {"devices": spec.nodes * spec.slots, "mbit": spec.mbit} for s, spec in self.sites.items()}
        if self.spanning_pool:
            pools[self.spanning_pool] = {"devices": len(self.sites), "mbit": min(
                (s.mbit for s in self.sites.values() if s.mbit), default=None)}
        out = _run(["ip", "netns", "exec", self.ctl, PY, "-m", "harness.bootstrap", json.dumps(
            {"pools": pools, "least_privilege": self.least_privilege})], "bootstrap", env=self.ctl_env)
        return json.loads(out.stdout.strip().splitlines()[-1])

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, ns: str, argv: list[str], env: dict[str, str]) -> str:
        log = self.logs / f"{name}.log"
        proc = Proc(name, ns, argv, env, log)
        with open(log, "ab") as fh:
            fh.write(f"\n=== start {time.strftime('%H:%M:%S')} [{ns}] {' '.join(argv)}\n".encode())
            proc.popen = subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=ROOT, env=env,
                                          stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.procs[name] = proc
        return name

    def _spawn_ctl(self, spec: processes.ProcessSpec, env: dict[str, str] | None = None) -> str:
        return self._spawn(spec.name, self.ctl, list(spec.argv), {**self.ctl_env, **(env or {}), **spec.env})

    def worker_env(self, site: str, j: int, pool_slug: str | None = None) -> dict[str, str]:
        """A pool node's variables, exactly those docs/operations.md lists for another host."""
        pool = self.bootstrap["pools"][pool_slug or site]
        var = self.tmp / f"{self.node_ns(site, j)}-var"
        return {
            **self.env,
            **pool["env"],  # DATABASE_URL, REDIS_URL, BLOB_STORE_URL of the pool's own credentials
            "DILOCO_WEB_URL": self.web_url,
            "SECRET_KEY": secrets.token_urlsafe(40),  # the host's own: a worker signs nothing
            "DILOCO_VAR_DIR": str(var),
            "DILOCO_NODE_ADDRESS": node_addr(self.index[site], j),
            "GLOO_SOCKET_IFNAME": "eth0",
        }

    def worker_name(self, site: str, j: int) -> str:
        return f"{self.spanning_pool}-{site}" if j == SPAN_NODE else f"{site}-n{j}"

    def start_node(self, site: str, j: int, *, wait: bool = True) -> str:
        slug = self.spanning_pool if j == SPAN_NODE else site
        slots = 1 if j == SPAN_NODE else self.sites[site].slots
        name = self.worker_name(site, j)
        ps = processes.pool_worker(slug, slots, name=name, node=f"{name}@%h",
                                   token=self.bootstrap["pools"][slug]["token"], python=PY, extra=QUIET)
        self._spawn(name, self.node_ns(site, j), list(ps.argv), {**self.worker_env(site, j, slug), **ps.env})
        if wait:
            self.wait_ready(name)
        return name

    def start_site(self, site: str, *, wait: bool = True) -> list[str]:
        return [self.start_node(site, j, wait=wait) for j in range(1, self.sites[site].nodes + 1)]

    def kill_site(self, site: str) -> None:
        """Every process of the site SIGKILLed at once (a rack or a data centre gone)."""
        names = [self.worker_name(site, j) for j in range(1, self.sites[site].nodes + 1)]
        for name in names:
            if name in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.procs[name].popen.pid, signal.SIGKILL)
        for name in names:
            if name in self.procs:
                self.procs[name].popen.wait(timeout=10)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self._kill(self.procs[name], sig)

    def wait_ready(self, name: str, timeout: float | None = None) -> None:
        proc = self.procs[name]
        marker = "beat: Starting" if name == "beat" else ("Listening at" if name == "web" else " ready.")
        self._wait(lambda: self._ready(proc, marker), name, timeout or self.start_timeout)

    def _alive(self, name: str) -> bool:
        proc = self.procs[name]
        if not proc.alive():
            raise SitesError(f"{name} exited with {proc.popen.returncode}:\n{self.tail(name)}")
        return True

    def _ready(self, proc: Proc, marker: str) -> bool:
        if not proc.alive():
            raise SitesError(f"{proc.name} exited with {proc.popen.returncode}:\n{self.tail(proc.name)}")
        text = proc.log.read_text(errors="replace")
        return marker in text[text.rfind("=== start "):]

    def _wait(self, predicate: Callable[[], object], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise SitesError(f"{what} not ready after {timeout}s\n{self.dump_logs()}")
            time.sleep(0.2)

    def tail(self, name: str, lines: int = 60) -> str:
        proc = self.procs.get(name)
        if not proc or not proc.log.exists():
            return ""
        return "\n".join(proc.log.read_text(errors="replace").splitlines()[-lines:])

    def dump_logs(self, lines: int = 30) -> str:
        return "\n".join(f"----- {n} -----\n{self.tail(n, lines)}" for n in self.procs)

    # ------------------------------------------------------------------ the control plane, from the host
    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        with netns.entered(self.ctl):
            yield

    def sql(self, query: str, params: list | tuple = ()) -> list[tuple]:
        """Rows of `query` on the control plane's database (a connection opened inside ctl)."""
        import psycopg

        if self._db is None or self._db.closed:
            with self.inside():
                self._db = psycopg.connect(self.database_url.replace("postgres://", "postgresql://"),
                                           autocommit=True, connect_timeout=10)
        return self._db.execute(query, params).fetchall()

    def api(self, method: str, path: str, body: dict | None = None,
            token: str | None = None) -> tuple[int, dict]:
        """One REST call as the harness's user (or `token`)."""
        import http.client

        with self.inside():
            conn = http.client.HTTPConnection(CTL_ADDR, WEB_PORT, timeout=30)
            conn.connect()
        headers = {"Authorization": f"Token {token or self.bootstrap['user_token']}",
                   "Content-Type": "application/json", "Accept": "application/json"}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, (json.loads(raw) if raw else {})

    def submit(self, spec: dict) -> int:
        status, data = self.api("POST", "/api/v1/jobs/", {"spec": spec})
        if status != 201:
            raise SitesError(f"submit refused ({status}): {data}")
        return int(data["id"])


def _run(argv: list[str], what: str = "", *, check: bool = True,
         env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    if check and out.returncode:
        said = out.stderr[-2000:] or out.stdout[-2000:]
        raise SitesError(f"{what or argv[0]} failed ({out.returncode}): {said}")
    return out


def cleanup_stale(prefix: str = "dls") -> list[str]:
    """Delete namespaces a crashed harness left (all named <prefix>....-...)."""
    gone = [ns for ns in netns.names(prefix) if "-" in ns]
    for ns in gone:
        netns.delete(ns)
    return gone
