"""manage.py demo: the whole platform on this machine, in one command.

Over 500 lines because it is one guided script (seed, supervise, submit, guide, chaos) that a
newcomer reads top to bottom; the process command lines live in diloco_platform.processes.

1. migrates the database (embedded default: SQLite under var/, filesystem broker),
2. seeds the demo fleet (apps/inventory/demo_fleet.yaml: cpu-new, cpu-mid, cpu-old, three
   "generations" on this CPU told apart by their speed_factor),
3. creates the admin user (password from DEMO_ADMIN_PASSWORD, else generated and kept in
   var/demo-admin-password) and issues a fresh worker token per demo pool,
4. starts web (gunicorn + uvicorn workers), one Celery worker per demo pool, the coordinator
   worker, the syncer worker and beat as child processes with prefixed output (the command lines of
   diloco_platform.processes, as in the Procfile and the test Stack),
5. waits for /healthz, submits the demo job (examples/job.yaml with its budget of inner steps
   sized from a quick measurement of this machine so it trains for about --minutes, 5 by
   default), then a second job that waits in the queue behind it (the fleet has no room for
   both), prints what to look at, and runs until Ctrl-C, which stops every child process cleanly.

--chaos kills one pool worker (SIGKILL, the whole process group: like a host dying) after
--chaos-after seconds and starts it again --chaos-restart seconds later; by default the worker
of a pool that runs a learner of the demo job, so an incident opens, the learner moves and
the incident heals on the job page. Staff also get a "Kill a worker (demo)" button on the job
page (DILOCO_DEMO_CHAOS=1, set for the demo's processes only; apps/dashboard/demo_chaos.py):
the web server leaves a request in VAR_DIR that this supervisor carries out the same way.
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
from diloco_platform import processes

FLEET_FILE = Path(__file__).resolve().parents[2] / "demo_fleet.yaml"
SERVICES = frozenset({"web", "coordinator", "syncer", "beat"})  # the children that are not pool workers
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

    def add_spec(self, spec: processes.ProcessSpec, env: dict[str, str]) -> Child:
        """Add one process of diloco_platform.processes, with `env` plus its own variables."""
        return self.add(spec.name, list(spec.argv), {**env, **spec.env})

    def start(self, child: Child) -> None:
        child.expected_down = False
        child.popen = processes.spawn(processes.ProcessSpec(child.name, tuple(child.argv)), child.env,
                                      stdout=subprocess.PIPE, cwd=settings.BASE_DIR, die_with_parent=True)
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
        parser.add_argument("--chaos-pool", default="auto",
                            help="pool whose worker --chaos kills (auto: one running the demo job)")
        parser.add_argument("--chaos-after", type=float, default=45.0, help="seconds before the kill")
        parser.add_argument("--chaos-restart", type=float, default=20.0, help="seconds until the restart")
        parser.add_argument("--minutes", type=float, default=5.0,
                            help="how long the demo job should train (sizes its budget; default 5)")
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
            "DILOCO_DEMO_CHAOS": "1",  # the job page's "Kill a worker (demo)" button (staff only)
        }
        base.pop("DILOCO_POOL", None)
        base.pop("DILOCO_POOL_TOKEN", None)
        sup = Supervisor(self.stdout._out, colour=self.stdout.isatty())
        # The command lines of diloco_platform.processes (as the Procfile and the test Stack).
        web = sup.add_spec(processes.web(port, python=py), base)
        sup.add_spec(processes.coordinator(python=py), base)
        sup.add_spec(processes.syncer(settings.SYNCER_SLOTS, python=py), base)  # the syncer shards' threads
        redis = bool(settings.REDIS_URL)  # --disable-prefetch is a Redis transport option
        for pool in Pool.objects.filter(slug__in=tokens).order_by("-speed_factor"):
            sup.add_spec(processes.pool_worker(pool.slug, pool.device_count, token=tokens[pool.slug],
                                               redis=redis, python=py), base)
        sup.add_spec(processes.beat(schedule=str(Path(settings.VAR_DIR) / "celerybeat-schedule"),
                                    python=py), base)
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
                self._submit_jobs(username, opts, sup)
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

    # ------------------------------------------------------------------ the demo's jobs
    def _load_spec(self, job_file: str | None) -> tuple[dict, str]:
        import yaml

        path = Path(job_file) if job_file else Path(settings.BASE_DIR) / "examples" / "job.yaml"
        if path.is_file():
            spec = yaml.safe_load(path.read_text())
            if isinstance(spec, dict) and isinstance(spec.get("spec"), dict):
                spec = spec["spec"]
            return spec, str(path)
        if job_file:
            raise CommandError(f"{job_file}: no such file")
        from trainer.spec import JobSpec

        return JobSpec().model_dump(mode="json"), "the JobSpec defaults"

    def _submit(self, username: str, spec: dict, origin: str, sup: Supervisor):
        from apps.jobs.services import submit_job
        from apps.jobs.spec import SpecError

        admin = get_user_model().objects.get(username=username)
        try:
            job, _ = submit_job(admin, spec)
        except SpecError as exc:
            sup.say("demo", f"demo job from {origin} is invalid: {exc}")
            return None
        except Exception as exc:  # the runtime may be missing pieces: keep the platform up
            sup.say("demo", f"could not submit the demo job: {type(exc).__name__}: {exc}")
            return None
        finally:
            connections.close_all()
        sup.say("demo", f"submitted job #{job.pk} {job.name!r} from {origin}: "
                        f"http://127.0.0.1:{self.port}/jobs/{job.pk}/")
        return job

    def _submit_jobs(self, username: str, opts, sup: Supervisor) -> None:
        """The long demo job, then (once it is placed) a second one that has to queue behind it."""
        from apps.inventory.demo_budget import sized_for

        self.demo_job = None
        spec, origin = self._load_spec(opts["job_file"])
        if not isinstance(spec, dict):
            sup.say("demo", f"{origin} is not a mapping of job fields; no demo job")
            return
        second = dict(spec)
        if not opts["job_file"] and opts["minutes"] > 0:
            spec, note = sized_for(spec, opts["minutes"], self._slot_speeds())
            sup.say("demo", note)
        job = self._submit(username, spec, origin, sup)
        if job is None:
            return
        self.demo_job = job.pk
        placed = self._wait_placed(job.pk, timeout=60)
        if opts["job_file"]:
            self._guide(job, None, opts)
            return
        # one learner more than the fleet has free next to the demo job: it waits in the queue
        total = sum(int(p.device_count) for p in Pool.objects.filter(state=Pool.State.ACTIVE))
        free = total - int(spec.get("learners") or 1)
        second.update(name=f"queued behind job {job.pk}", learners=max(2, free + 1),
                      quorum=min(int(second.get("quorum") or 2), max(2, free + 1)))
        queued = self._submit(username, second, "examples/job.yaml", sup) if placed else None
        connections.close_all()
        self._guide(job, queued, opts)

    def _slot_speeds(self) -> list[float]:
        """Speed factor of every learner slot of the active demo pools, fastest first."""
        rows = Pool.objects.filter(state=Pool.State.ACTIVE).values_list("speed_factor", "device_count")
        return sorted((float(f) for f, n in rows for _ in range(int(n))), reverse=True)

    def _wait_placed(self, job_id: int, timeout: float) -> bool:
        from apps.jobs.models import Job

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
            connections.close_all()
            if status in ("running", "completed"):
                return True
            if status in ("failed", "cancelled", None):
                return False
            time.sleep(0.5)
        return False

    def _guide(self, job, queued, opts) -> None:
        """What a newcomer should look at, and when."""
        url = f"http://127.0.0.1:{self.port}"
        lines = [
            "What to look at (log in as the admin above):",
            f"  Live job     {url}/jobs/{job.pk}/  loss and tokens/s charts grow live over the websocket",
        ]
        if queued is not None:
            lines.append(f"  Queue        {url}/jobs/{queued.pk}/  job #{queued.pk} waits for capacity "
                         f"behind #{job.pk}, then trains")
            lines.append(f"  Compare      {url}/compare/?jobs={job.pk},{queued.pk}  both loss curves, "
                         "gap to the baseline at equal tokens")
        if opts["chaos"]:
            lines.append(f"  Chaos        in {opts['chaos_after']:.0f} s a pool worker running job #{job.pk} "
                         f"is killed (SIGKILL) and started again {opts['chaos_restart']:.0f} s later:")
        else:
            lines.append("  Chaos        press \"Kill a worker (demo)\" on the job page (staff), "
                         "or start with --chaos:")
        lines.append("               a red incident band opens on the charts, the learner moves to another "
                     "pool (dashed line), the band closes when it heals; the timeline says the same")
        for line in lines:
            self.stdout.write(line)

    # ------------------------------------------------------------------ chaos
    def _kill_one(self, sup: Supervisor, pools: list[str], why: str, restarts: dict, now: float,
                  opts) -> bool:
        for slug in pools:
            child = sup.children.get(slug)
            if child is None or child.name in SERVICES:  # pool workers only, never web or beat
                continue
            if not child.alive() or slug in restarts:
                continue
            sup.say("chaos", f"{why}: killing worker {child.name} (SIGKILL, whole process group); "
                             f"it starts again in {opts['chaos_restart']:.0f} s")
            sup.kill(child)
            restarts[slug] = now + opts["chaos_restart"]
            return True
        sup.say("chaos", f"{why}: no running worker of {', '.join(pools) or 'any pool'} to kill")
        return False

    def _chaos_pools(self, opts) -> list[str]:
        if opts["chaos_pool"] != "auto":
            return [opts["chaos_pool"]]
        if getattr(self, "demo_job", None) is None:
            return []
        from apps.dashboard.demo_chaos import kill_candidates

        try:
            return kill_candidates(self.demo_job)
        finally:
            connections.close_all()

    def _watch(self, sup: Supervisor, interrupted: threading.Event, opts) -> int:
        from apps.dashboard.demo_chaos import take_request

        started = time.monotonic()
        chaos_at = opts["chaos_after"] if opts["chaos"] else None
        restarts: dict[str, float] = {}  # pool worker -> when to start it again
        while not interrupted.is_set():
            now = time.monotonic() - started
            if opts["run_for"] and now >= opts["run_for"]:
                return 0
            if chaos_at is not None and now >= chaos_at:
                pools = self._chaos_pools(opts)
                if pools or now > opts["chaos_after"] + 120:
                    self._kill_one(sup, pools, "--chaos", restarts, now, opts)
                    chaos_at = None
                else:
                    chaos_at = now + 5  # the demo job is not running yet: try again shortly
            request = take_request()
            if request is not None:
                self._kill_one(sup, [str(p) for p in request["pools"]],
                               f"{request.get('user', 'staff')} pressed Kill a worker", restarts, now, opts)
            for slug, when in list(restarts.items()):
                if now >= when:
                    sup.say("chaos", f"starting worker {slug} again")
                    sup.children[slug].restarts += 1
                    sup.start(sup.children[slug])
                    del restarts[slug]
            dead = sup.crashed()
            if dead is not None:
                sup.say(dead.name, f"exited with code {dead.popen.returncode}; stopping the demo")
                return 1
            time.sleep(0.25)
        return 0
