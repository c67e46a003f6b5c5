"""manage.py api_bench: latency of the job list, job detail and metrics endpoints under load.

Seeds a bench user with N jobs (4 learners each) and M metric points spread over them,
starts the production web process (diloco_platform.processes.web: gunicorn with uvicorn
workers; `--server daphne` for the one-process daphne it replaced) on a free port, or uses
--url, and runs each client level (default: 1, then 20 concurrent keep-alive clients, one
thread and one http.client connection each) against each endpoint. Prints p50/p95/p99 latency,
req/s and the CPU per request of the server and of the clients per endpoint and level against
issue 19's targets, writes JSON (and --markdown). Figures are reported,
never asserted. The seeded rows are deleted afterwards (unless --keep).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.utils import timezone

from apps.api.models import ApiToken
from apps.coordinator.stack import database_url, free_port
from apps.jobs.models import Event, Job, Learner, MetricPoint
from diloco_platform import processes
from diloco_platform.gunicorn_conf import web_db_pool, web_workers
from trainer.spec import JobSpec

NAMES = ("train_loss", "val_loss", "tokens_per_s", "goodput")
# Issue 19's targets (printed beside the figures, never asserted).
TARGET_SINGLE_P50_MS = 15.0
TARGET_LOADED_RPS = 150.0
TARGET_LOADED_P95_MS = 250.0
LOADED_CLIENTS = 20


class KeepAliveClient:
    """One keep-alive HTTP/1.1 connection (http.client): the load generator's own CPU per
    request is about a third of httpx's (0.3 against 0.9 ms measured here), and on a 2-core
    machine every millisecond the clients spend is taken from the server and the database."""

    def __init__(self, url: str, headers: dict[str, str]):
        parts = urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.conn = kind(parts.hostname, parts.port, timeout=120)
        self.prefix = parts.path.rstrip("/")
        self.headers = headers

    def get(self, path: str) -> int:
        """GET path and read the whole body; the status code."""
        try:
            self.conn.request("GET", self.prefix + path, headers=self.headers)
            r = self.conn.getresponse()
            r.read()
            return r.status
        except (http.client.HTTPException, OSError):
            self.conn.close()  # reconnects on the next request
            raise OSError("request failed") from None

    def close(self) -> None:
        self.conn.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system) used so far by the live processes of group `pgid` (Linux /proc):
    the server's cost per request, which other load on the machine hardly changes."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    ticks = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # after the name: state ppid pgrp ... utime(11) stime(12)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"--clients: comma-separated positive integers, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise CommandError("--clients: comma-separated positive integers")
    return levels


def verdicts(runs: dict[str, dict]) -> list[dict]:
    """Issue 19's targets against the figures: one row per target that the runs cover."""
    rows = []
    for name, r in (runs.get("1") or {}).items():
        rows.append({"target": f"1 client, {name}: p50 <= {TARGET_SINGLE_P50_MS:g} ms",
                     "value": round(r["p50_ms"], 1), "met": r["p50_ms"] <= TARGET_SINGLE_P50_MS})
    loaded = runs.get(str(LOADED_CLIENTS)) or {}
    if loaded:
        rps = sum(r["throughput_rps"] for r in loaded.values()) / len(loaded)
        rows.append({"target": f"{LOADED_CLIENTS} clients: >= {TARGET_LOADED_RPS:g} req/s "
                               "(mean over the endpoints)", "value": round(rps, 1),
                     "met": rps >= TARGET_LOADED_RPS})
        for name, r in loaded.items():
            rows.append({"target": f"{LOADED_CLIENTS} clients, {name}: p95 <= {TARGET_LOADED_P95_MS:g} ms",
                         "value": round(r["p95_ms"], 1), "met": r["p95_ms"] <= TARGET_LOADED_P95_MS})
    return rows


def markdown(report: dict) -> str:
    """The figures as a markdown table (one row per client level and endpoint), then the targets."""
    lines = [f"API bench: server {report['server']}, db {report['database']}, {report['jobs']} jobs, "
             f"{report['metric_points']} metric points, {report['cpu_count']} CPUs", "",
             "| clients | endpoint | requests | errors | p50 ms | p95 ms | p99 ms | req/s "
             "| server CPU ms/req | client CPU ms/req |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for level, results in report["runs"].items():
        for name, r in results.items():
            cpu, own = r.get("server_cpu_ms_per_request"), r.get("client_cpu_ms_per_request")
            lines.append(f"| {level} | {name} | {r['requests']} | {r['errors']} | {r['p50_ms']:.1f} | "
                         f"{r['p95_ms']:.1f} | {r['p99_ms']:.1f} | {r['throughput_rps']:.1f} | "
                         f"{'-' if cpu is None else f'{cpu:.1f}'} | {'-' if own is None else f'{own:.2f}'} |")
    if report.get("targets"):
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |"
                  for t in report["targets"]]
    return "\n".join(lines) + "\n"


class Command(BaseCommand):
    help = "Benchmark the REST API (job list, job detail, metrics): 1 client, then 20 concurrent clients."

    def add_arguments(self, parser):
        parser.add_argument("--jobs", type=int, default=50)
        parser.add_argument("--points", type=int, default=100_000, help="metric points in all")
        parser.add_argument("--clients", default=f"1,{LOADED_CLIENTS}",
                            help="client levels, comma-separated (default 1,20)")
        parser.add_argument("--requests", type=int, default=None,
                            help="requests per client per endpoint (default: 200 for one client, 25 each "
                                 "for more)")
        parser.add_argument("--metric-points", type=int, default=200, help="`points` of the metrics query")
        parser.add_argument("--url", help="benchmark this running server instead of starting one")
        parser.add_argument("--server", choices=["gunicorn", "daphne"], default="gunicorn",
                            help="web server to start: the production one (default), or one daphne process")
        parser.add_argument("--web-workers", type=int, default=None,
                            help="web workers to start (default: diloco_platform.gunicorn_conf's choice)")
        parser.add_argument("--json", dest="json_path", default=str(Path(settings.VAR_DIR) / "bench" /
                                                                    "api_bench.json"))
        parser.add_argument("--markdown", dest="md_path", default=None, help="also write the markdown table")
        parser.add_argument("--keep", action="store_true", help="keep the seeded rows")

    def handle(self, *args, **opts):
        levels = _levels(str(opts["clients"]))
        if min(opts["jobs"], opts["requests"] or 1, opts["metric_points"]) < 1 or opts["points"] < 0:
            raise CommandError("--jobs, --requests and --metric-points must be positive, --points >= 0")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        t0 = time.monotonic()
        user, token, job_ids = self.seed(opts["jobs"], opts["points"])
        self.stdout.write(f"seeded {len(job_ids)} jobs, {opts['points']} metric points "
                          f"in {time.monotonic() - t0:.1f} s")
        server, label = None, "given URL"
        try:
            url = opts["url"]
            if not url:
                server, url, label = self.start_server(opts["server"], opts["web_workers"])
            pgid = server.pid if server is not None else None
            runs = {str(c): self.run(url.rstrip("/"), token, job_ids, c, opts, pgid) for c in levels}
        finally:
            if server is not None:
                self.stop_server(server)
            if not opts["keep"]:
                user.delete()  # cascades to the jobs, learners, metrics, events, tokens
        report = {
            "server": label, "database": connection.vendor, "jobs": opts["jobs"],
            "metric_points": opts["points"], "client_levels": levels,
            "metrics_query_points": opts["metric_points"], "cpu_count": os.cpu_count(),
            "runs": runs, "endpoints": runs[str(levels[-1])], "clients": levels[-1],
            "targets": verdicts(runs),
        }
        self.stdout.write("\n" + markdown(report))
        path = Path(opts["json_path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        self.stdout.write(f"wrote {path}")
        if opts["md_path"]:
            Path(opts["md_path"]).parent.mkdir(parents=True, exist_ok=True)
            Path(opts["md_path"]).write_text(markdown(report))
            self.stdout.write(f"wrote {opts['md_path']}")

    # --- data ----------------------------------------------------------------------------------
    def seed(self, n_jobs: int, n_points: int):
        user = get_user_model().objects.create_user(f"bench-{secrets.token_hex(4)}", password=None)
        _, token = ApiToken.issue(user, "bench")
        spec = JobSpec(name="bench", learners=4).model_dump(mode="json")
        now = timezone.now()
        jobs = Job.objects.bulk_create(
            Job(owner=user, name=f"bench {i}", spec=spec, status=random.choice(["running", "completed"]),
                tokens_computed=random.randint(0, 10**6), outer_steps=random.randint(0, 100))
            for i in range(n_jobs))
        learners = Learner.objects.bulk_create(
            Learner(job=j, index=k, state="running", work_size=20, tokens=1000 * k)
            for j in jobs for k in range(4))
        Event.objects.bulk_create(Event(job=j, kind="merged", message=f"fragment 0 v{v}")
                                  for j in jobs for v in range(20))
        by_job = {j.pk: [lr for lr in learners if lr.job_id == j.pk] for j in jobs}
        per_job = n_points // n_jobs
        batch = []
        for j in jobs:
            for i in range(per_job):
                name = NAMES[i % len(NAMES)]
                lr = None if name in ("val_loss", "goodput") or i % 8 < 4 else by_job[j.pk][i % 4]
                batch.append(MetricPoint(job=j, learner=lr, name=name, step=i * 512,
                                         value=5.0 / (1 + i / 500), time=now + timedelta(milliseconds=i)))
                if len(batch) >= 10_000:
                    MetricPoint.objects.bulk_create(batch)
                    batch = []
        MetricPoint.objects.bulk_create(batch)
        if connection.vendor == "postgresql":  # fresh planner statistics, as autovacuum would give
            with connection.cursor() as cur:
                for model in (Job, Learner, Event, MetricPoint):
                    cur.execute(f"ANALYZE {connection.ops.quote_name(model._meta.db_table)}")
        return user, token, [j.pk for j in jobs]

    # --- server --------------------------------------------------------------------------------
    def start_server(self, kind: str, workers: int | None):
        port = free_port()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "diloco_platform.settings", "LOG_LEVEL": "WARNING",
               "DATABASE_URL": database_url()}
        if kind == "daphne":
            spec = processes.ProcessSpec("web", (sys.executable, "-m", "daphne", "-b", "127.0.0.1",
                                                 "-p", str(port), processes.ASGI_APP))
            label = "daphne (1 process)"
        else:
            spec = processes.web(port, python=sys.executable)
            if workers:
                env["WEB_CONCURRENCY"] = str(workers)
            pooled = web_db_pool(env) or env.get("DB_POOL", "").lower() in ("1", "true", "yes", "on")
            label = (f"gunicorn + uvicorn workers ({web_workers(env)} processes, "
                     f"{'pooled' if pooled else 'unpooled'} database connections)")
        # a file, not a pipe: nobody reads a pipe while the clients run, and a full one blocks the server
        log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        proc = processes.spawn(spec, env, stdout=log)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise CommandError(f"{spec.argv[2]} exited: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code in (200, 503):
                    return proc, url, label
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop_server(proc)
        raise CommandError(f"the web server did not start within 60 s: {' '.join(spec.argv)}")

    @staticmethod
    def stop_server(proc) -> None:
        processes.signal_group(proc, 15)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            processes.signal_group(proc, 9)
            proc.wait(timeout=5)

    # --- load ----------------------------------------------------------------------------------
    def run(self, url: str, token: str, job_ids: list[int], clients: int, opts, pgid: int | None) -> dict:
        per_client = opts["requests"] or (200 if clients == 1 else 25)
        endpoints = {
            "job list": lambda rnd: "/api/v1/jobs/?limit=50",
            "job detail": lambda rnd: f"/api/v1/jobs/{rnd.choice(job_ids)}/",
            "metrics": lambda rnd: (f"/api/v1/jobs/{rnd.choice(job_ids)}/metrics/"
                                    f"?points={opts['metric_points']}"),
        }
        headers = {"Authorization": f"Bearer {token}"}
        # warm up every endpoint in every worker (new connections spread over the workers)
        for i in range(8):
            with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
                for make in endpoints.values():
                    c.get(make(random.Random(i))).raise_for_status()
        results = {}
        for name, make in endpoints.items():
            lat: list[float] = []
            errors: list[int] = []
            lock = threading.Lock()
            start = threading.Barrier(clients + 1)

            def client(seed: int, make=make, lat=lat, errors=errors, lock=lock, start=start):
                rnd = random.Random(seed)
                conn = KeepAliveClient(url, headers)
                try:
                    with contextlib.suppress(OSError):  # a failure here is counted below, not a hang
                        conn.get("/api/v1/jobs/?limit=1")  # open the keep-alive connection before the clock
                    start.wait()
                    for _ in range(per_client):
                        t = time.perf_counter()
                        try:
                            code = conn.get(make(rnd))
                        except OSError:
                            code = -1
                        dt = time.perf_counter() - t
                        with lock:
                            lat.append(dt)
                            if code != 200:
                                errors.append(code)
                finally:
                    conn.close()

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for th in threads:
                th.start()
            start.wait()
            t0 = time.perf_counter()
            own0 = time.process_time()
            cpu0 = group_cpu_s(pgid) if pgid else None
            for th in threads:
                th.join()
            wall = time.perf_counter() - t0
            cpu1 = group_cpu_s(pgid) if cpu0 is not None else None
            own = time.process_time() - own0
            results[name] = {
                "requests": len(lat), "errors": len(errors), "error_codes": sorted(set(errors)),
                "p50_ms": _pct(lat, 0.5) * 1e3, "p95_ms": _pct(lat, 0.95) * 1e3,
                "p99_ms": _pct(lat, 0.99) * 1e3,
                "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
                "throughput_rps": len(lat) / wall if wall else 0.0, "wall_s": wall,
                "server_cpu_ms_per_request": (None if cpu1 is None or not lat
                                              else (cpu1 - cpu0) * 1e3 / len(lat)),
                "client_cpu_ms_per_request": own * 1e3 / len(lat) if lat else None,
            }
        return results
