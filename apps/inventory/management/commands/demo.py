"""manage.py demo: the whole platform on this machine, in one command.

1. migrates the database (embedded default: SQLite under var/, filesystem broker),
2. seeds the demo fleet (apps/inventory/demo_fleet.yaml: cpu-new, cpu-mid, cpu-old, three
   "generations" on this CPU told apart by their speed_factor),
3. creates the admin user (password from DEMO_ADMIN_PASSWORD, else generated and kept in
   var/demo-admin-password) and issues a fresh worker token per demo pool,
4. starts web (daphne), one Celery worker per demo pool, the coordinator worker and beat
   as child processes with prefixed output,
5. waits for /healthz, submits the demo job (examples/job.yaml, else the JobSpec defaults),
   prints the dashboard URL and the admin login, and runs until Ctrl-C, which stops every
   child process cleanly.

--chaos kills one pool worker (SIGKILL, the whole process group: like a host dying) after
--chaos-after seconds and starts it again --chaos-restart seconds later.
--seed-only does steps 1-3 and exits (no processes).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, connections

from apps.inventory.inventory_file import apply, load
from apps.inventory.models import Node, Pool, PoolToken

FLEET_FILE = Path(__file__).resolve().parents[2] / "demo_fleet.yaml"
COLOURS = ["36", "33", "32", "35", "34", "31", "96", "93"]


# --------------------------------------------------------------------------- supervisor


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    colour: str
    popen: subprocess.Popen | None = None
    expected_down: bool = False
    restarts: int = 0
    pump: threading.Thread | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if the demo process dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Supervisor:
    """Start child processes in their own process groups, prefix their output, stop them all."""

    def __init__(self, out, width: int = 12, colour: bool = False):
        self.out = out
        self.width = width
        self.colour = colour
        self.children: dict[str, Child] = {}
        self._lock = threading.Lock()
        self._colours = itertools.cycle(COLOURS)
        self.stopping = False

    def say(self, name: str, line: str, colour: str = "1") -> None:
        prefix = f"{name:<{self.width}}|"
        if self.colour:
            prefix = f"\x1b[{colour}m{prefix}\x1b[0m"
        with self._lock:
            self.out.write(f"{prefix} {line.rstrip()}\n")
            self.out.flush()

    def add(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(name, argv, env, next(self._colours))
        self.children[name] = child
        return child

    def start(self, child: Child) -> None:
        child.expected_down = False
        child.popen = subprocess.Popen(
            child.argv,
            cwd=settings.BASE_DIR,
            env=child.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
        )
        self.say(
            child.name, f"started (pid {child.popen.pid}): {' '.join(child.argv[1:6])} ...", child.colour
        )
        child.pump = threading.Thread(target=self._pump, args=(child, child.popen), daemon=True)
        child.pump.start()

    def _pump(self, child: Child, popen: subprocess.Popen) -> None:
        for raw in iter(popen.stdout.readline, b""):
            self.say(child.name, raw.decode("utf-8", "replace"), child.colour)
        popen.stdout.close()

    def signal_group(self, child: Child, sig: int) -> None:
        if child.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.popen.pid, sig)

    def kill(self, child: Child) -> None:
        """SIGKILL the child's whole group (main process and pool children), on purpose."""
        child.expected_down = True
        self.signal_group(child, signal.SIGKILL)
        child.popen.wait(10)

    def crashed(self) -> Child | None:
        for child in self.children.values():
            if child.popen is not None and not child.alive() and not child.expected_down:
                return child
        return None

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM (warm shutdown), then SIGQUIT (Celery's cold shutdown), then SIGKILL."""
        self.stopping = True
        live = [c for c in self.children.values() if c.alive()]
        for child in live:
            child.expected_down = True
            # the main process only: a Celery worker then stops its own pool children
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
        for sig, wait in ((signal.SIGQUIT, grace_s), (signal.SIGKILL, 4.0)):
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(c.alive() for c in live):
                time.sleep(0.1)
            for child in live:
                if child.alive():
                    self.say(child.name, f"still running, sending {signal.Signals(sig).name}", child.colour)
                    self.signal_group(child, sig)
        for child in self.children.values():
            if child.popen is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(5)
            # pool children of a worker may outlive their parent, also one that died before the
            # stop (a crash, or PDEATHSIG when the thread that started it ended): clear every group
            self.signal_group(child, signal.SIGKILL)
            if child.pump is not None:
                child.pump.join(timeout=2)


# --------------------------------------------------------------------------- command


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _http_get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own local URL
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class Command(BaseCommand):
    help = "Run the whole platform on this machine: web, one worker per demo pool, coordinator, beat."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000, help="web port on 127.0.0.1 (default 8000)")
        parser.add_argument("--no-job", action="store_true", help="do not submit the demo job")
        parser.add_argument(
            "--job-file",
            default=None,
            help="job spec YAML/JSON to submit (default examples/job.yaml, else defaults)",
        )
        parser.add_argument(
            "--chaos",
            action="store_true",
            help="kill one pool worker mid-run (SIGKILL) and start it again later",
        )
        parser.add_argument("--chaos-pool", default="cpu-mid", help="pool whose worker --chaos kills")
        parser.add_argument("--chaos-after", type=float, default=45.0, help="seconds before the kill")
        parser.add_argument("--chaos-restart", type=float, default=20.0, help="seconds until the restart")
        parser.add_argument(
            "--seed-only",
            action="store_true",
            help="migrate, seed the fleet, create the admin user, issue tokens; start nothing",
        )
        parser.add_argument(
            "--run-for",
            type=float,
            default=0,
            help="stop by itself after this many seconds (0: run until Ctrl-C)",
        )

    # ------------------------------------------------------------------ set-up
    def handle(self, *args, **opts):
        port = self.port = opts["port"]
        if not opts["seed_only"] and not _port_free(port):
            raise CommandError(f"port {port} on 127.0.0.1 is in use; pick another with --port")
        self.stdout.write(self.style.MIGRATE_HEADING("Migrating the database"))
        call_command("migrate", interactive=False, verbosity=0)
        if connection.vendor == "sqlite":
            # Several processes share the file: write-ahead logging lets readers and a writer overlap.
            with connection.cursor() as cur:
                cur.execute("PRAGMA journal_mode=WAL")
        summary = apply(load(FLEET_FILE.read_bytes()))
        self.stdout.write(f"Demo fleet ({FLEET_FILE.name}): {summary}")
        username, password = self._admin_user()
        tokens = self._pool_tokens()
        Path(settings.STATIC_ROOT).mkdir(parents=True, exist_ok=True)
        if opts["seed_only"]:
            self._banner(port, username, password, started=False)
            return
        self._run(port, username, password, tokens, opts)

    def _admin_user(self) -> tuple[str, str]:
        User = get_user_model()
        username = os.environ.get("DEMO_ADMIN_USER", "admin")
        from_env = os.environ.get("DEMO_ADMIN_PASSWORD", "")
        keep = Path(settings.VAR_DIR) / "demo-admin-password"
        user = User.objects.filter(username=username).first()
        if from_env:
            password = from_env
        elif user and keep.exists() and user.check_password(keep.read_text().strip()):
            password = keep.read_text().strip()
        else:
            password = secrets.token_urlsafe(12)
            keep.write_text(password + "\n")
            keep.chmod(0o600)
        if user is None:
            user = User.objects.create_superuser(username, f"{username}@localhost", password)
        else:
            user.is_staff = user.is_superuser = user.is_active = True
            user.set_password(password)
            user.save()
        return username, password

    def _pool_tokens(self) -> dict[str, str]:
        """A fresh token per demo pool (earlier demo tokens are revoked)."""
        from django.utils import timezone

        slugs = [p["slug"] for p in load(FLEET_FILE.read_bytes()).pools]
        PoolToken.objects.filter(pool__slug__in=slugs, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        return {slug: PoolToken.issue(Pool.objects.get(slug=slug))[1] for slug in slugs}

    def _banner(self, port: int, username: str, password: str, started: bool = True) -> None:
        w = self.stdout.write
        w("")
        w(self.style.SUCCESS("DiLoCo platform demo" + (" is up" if started else ": database ready")))
        w(f"  Dashboard:  http://127.0.0.1:{port}/")
        w(f"  Admin:      http://127.0.0.1:{port}/admin/")
        w(f"  Login:      {username} / {password}")
        w(f"  Health:     http://127.0.0.1:{port}/healthz")
        if started:
            w("  Stop:       Ctrl-C")
        w("")

    # ------------------------------------------------------------------ processes
    def _run(self, port: int, username: str, password: str, tokens: dict[str, str], opts) -> None:
        py = sys.executable
        base = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "diloco_platform.settings",
            "DILOCO_WEB_URL": f"http://127.0.0.1:{port}",
            "OMP_NUM_THREADS": "1",
        }
        base.pop("DILOCO_POOL", None)
        base.pop("DILOCO_POOL_TOKEN", None)
        sup = Supervisor(self.stdout._out, colour=self.stdout.isatty())
        celery = [py, "-m", "celery", "-A", "diloco_platform"]
        redis_only = ["--disable-prefetch"] if settings.REDIS_URL else []  # a Redis transport option
        web = sup.add(
            "web",
            [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "diloco_platform.asgi:application"],
            base,
        )
        sup.add(
            "coordinator",
            [
                *celery,
                "worker",
                "-Q",
                "coordinator",
                "-n",
                "coordinator@%h",
                "-P",
                "threads",
                "--concurrency",
                "8",
                "--prefetch-multiplier",
                "1",
                "-l",
                "INFO",
            ],
            base,
        )
        for pool in Pool.objects.filter(slug__in=tokens).order_by("-speed_factor"):
            sup.add(
                pool.slug,
                [
                    *celery,
                    "worker",
                    "-Q",
                    pool.queue,
                    "-n",
                    f"{pool.slug}@%h",
                    "--concurrency",
                    str(max(1, pool.device_count)),
                    "--prefetch-multiplier",
                    "1",
                    *redis_only,
                    "-O",
                    "fair",
                    "-l",
                    "INFO",
                ],
                {**base, "DILOCO_POOL": pool.slug, "DILOCO_POOL_TOKEN": tokens[pool.slug]},
            )
        sup.add(
            "beat",
            [
                *celery,
                "beat",
                "-l",
                "INFO",
                "--pidfile=",
                "-s",
                str(Path(settings.VAR_DIR) / "celerybeat-schedule"),
            ],
            base,
        )
        connections.close_all()

        interrupted = threading.Event()

        def on_signal(signum, frame):
            interrupted.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            for child in sup.children.values():
                sup.start(child)
            if not self._wait_healthy(port, web, interrupted, timeout=90):
                code = 1
                return
            self._banner(port, username, password)
            self._wait_nodes(sup, tokens, interrupted)
            if not opts["no_job"]:
                self._submit_job(username, opts["job_file"], sup)
            code = self._watch(sup, interrupted, opts)
        finally:
            sup.say("demo", "stopping all processes ...")
            sup.stop_all()
            sup.say("demo", "stopped")
            connections.close_all()
            for s, h in old.items():
                signal.signal(s, h)
        if code:
            raise CommandError("a process of the demo stopped unexpectedly (see its output above)")

    def _wait_healthy(self, port: int, web: Child, interrupted: threading.Event, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline and not interrupted.is_set():
            if not web.alive():
                self.stderr.write("web exited before it became healthy")
                return False
            try:
                status, body = _http_get(f"http://127.0.0.1:{port}/healthz")
                if status == 200:
                    self.stdout.write(self.style.SUCCESS(f"/healthz: 200 {body}"))
                    return True
                last = f"{status} {body}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.5)
        if not interrupted.is_set():
            self.stderr.write(f"web not healthy after {timeout:.0f}s (last answer: {last})")
        return False

    def _wait_nodes(self, sup: Supervisor, tokens: dict[str, str], interrupted: threading.Event) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not interrupted.is_set():
            online = set(
                Node.objects.filter(pool__slug__in=tokens, state=Node.State.ONLINE).values_list(
                    "pool__slug", flat=True
                )
            )
            if online >= set(tokens):
                break
            time.sleep(0.5)
        rows = Node.objects.filter(pool__slug__in=tokens, state=Node.State.ONLINE).select_related("pool")
        for node in rows:
            sup.say(
                "demo",
                f"node {node.worker_name} online in pool {node.pool.slug} "
                f"(speed factor {node.pool.speed_factor})",
            )
        connections.close_all()

    def _submit_job(self, username: str, job_file: str | None, sup: Supervisor) -> None:
        import yaml

        from apps.jobs.services import submit_job
        from apps.jobs.spec import SpecError

        path = Path(job_file) if job_file else Path(settings.BASE_DIR) / "examples" / "job.yaml"
        if path.is_file():
            spec = yaml.safe_load(path.read_text())
            if isinstance(spec, dict) and isinstance(spec.get("spec"), dict):
                spec = spec["spec"]
            origin = str(path)
        elif job_file:
            raise CommandError(f"{job_file}: no such file")
        else:
            from trainer.spec import JobSpec

            spec, origin = JobSpec().model_dump(mode="json"), "the JobSpec defaults"
        admin = get_user_model().objects.get(username=username)
        try:
            job, _ = submit_job(admin, spec)
        except SpecError as exc:
            sup.say("demo", f"demo job from {origin} is invalid: {exc}")
            return
        except Exception as exc:  # the runtime may be missing pieces: keep the platform up
            sup.say("demo", f"could not submit the demo job: {type(exc).__name__}: {exc}")
            return
        finally:
            connections.close_all()
        sup.say(
            "demo",
            f"submitted job #{job.pk} {job.name!r} from {origin}: "
            f"http://127.0.0.1:{self.port}/jobs/{job.pk}/",
        )

    def _watch(self, sup: Supervisor, interrupted: threading.Event, opts) -> int:
        started = time.monotonic()
        chaos = sup.children.get(opts["chaos_pool"]) if opts["chaos"] else None
        if opts["chaos"] and chaos is None:
            sup.say("demo", f"--chaos: no pool {opts['chaos_pool']!r} in the demo fleet; chaos is off")
        killed_at = None
        while not interrupted.is_set():
            now = time.monotonic() - started
            if opts["run_for"] and now >= opts["run_for"]:
                return 0
            if chaos is not None and killed_at is None and now >= opts["chaos_after"]:
                sup.say("chaos", f"killing worker {chaos.name} (SIGKILL, whole process group)")
                sup.kill(chaos)
                killed_at = now
            if (
                chaos is not None
                and killed_at is not None
                and chaos.restarts == 0
                and now >= killed_at + opts["chaos_restart"]
            ):
                sup.say("chaos", f"starting worker {chaos.name} again")
                chaos.restarts += 1
                sup.start(chaos)
            dead = sup.crashed()
            if dead is not None:
                sup.say(dead.name, f"exited with code {dead.popen.returncode}; stopping the demo")
                return 1
            time.sleep(0.25)
        return 0
