"""manage.py api_bench: latency of the job list, job detail and metrics endpoints under load.

Seeds a bench user with N jobs (4 learners each) and M metric points spread over them,
starts the real ASGI server (daphne, as in production) on a free port (or uses --url),
and runs C concurrent clients (threads, keep-alive httpx clients) against each endpoint.
Prints p50/p95/p99 latency and throughput per endpoint and writes them as JSON. Figures
are reported, never asserted. The seeded rows are deleted afterwards (unless --keep).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.utils import timezone

from apps.api.models import ApiToken
from apps.jobs.models import Event, Job, Learner, MetricPoint
from trainer.spec import JobSpec

NAMES = ("train_loss", "val_loss", "tokens_per_s", "goodput")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


class Command(BaseCommand):
    help = "Benchmark the REST API (job list, job detail, metrics) under concurrent clients."

    def add_arguments(self, parser):
        parser.add_argument("--jobs", type=int, default=50)
        parser.add_argument("--points", type=int, default=100_000, help="metric points in all")
        parser.add_argument("--clients", type=int, default=20, help="concurrent clients")
        parser.add_argument("--requests", type=int, default=25, help="requests per client per endpoint")
        parser.add_argument("--metric-points", type=int, default=200, help="`points` of the metrics query")
        parser.add_argument("--url", help="benchmark this running server instead of starting daphne")
        parser.add_argument("--json", dest="json_path", default=str(Path(settings.VAR_DIR) / "bench" /
                                                                    "api_bench.json"))
        parser.add_argument("--keep", action="store_true", help="keep the seeded rows")

    def handle(self, *args, **opts):
        if min(opts["jobs"], opts["clients"], opts["requests"]) < 1 or opts["points"] < 0:
            raise CommandError("--jobs, --clients and --requests must be positive")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        t0 = time.monotonic()
        user, token, job_ids = self.seed(opts["jobs"], opts["points"])
        seeded_s = time.monotonic() - t0
        self.stdout.write(f"seeded {len(job_ids)} jobs, {opts['points']} metric points in {seeded_s:.1f} s")
        server = None
        try:
            url = opts["url"]
            if not url:
                server, url = self.start_server()
            results = self.run(url.rstrip("/"), token, job_ids, opts)
        finally:
            if server is not None:
                self.stop_server(server)
            if not opts["keep"]:
                user.delete()  # cascades to the jobs, learners, metrics, events, tokens
        report = {
            "server": "given URL" if opts["url"] else "daphne (1 process)",
            "database": connection.vendor, "jobs": opts["jobs"], "metric_points": opts["points"],
            "clients": opts["clients"], "requests_per_client": opts["requests"],
            "metrics_query_points": opts["metric_points"], "cpu_count": os.cpu_count(),
            "endpoints": results,
        }
        self.print_table(report)
        path = Path(opts["json_path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        self.stdout.write(f"wrote {path}")

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
    def start_server(self):
        port = _free_port()
        exe = Path(sys.executable).parent / "daphne"
        cmd = [str(exe) if exe.exists() else "daphne", "-b", "127.0.0.1", "-p", str(port),
               "diloco_platform.asgi:application"]
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "diloco_platform.settings", "LOG_LEVEL": "WARNING"}
        if connection.settings_dict.get("NAME") and connection.vendor == "postgresql":
            sd = connection.settings_dict
            env["DATABASE_URL"] = (f"postgres://{sd.get('USER') or 'postgres'}@"
                                   f"{sd.get('HOST') or '127.0.0.1'}:{sd.get('PORT') or 5432}/{sd['NAME']}")
        proc = subprocess.Popen(cmd, env=env, cwd=settings.BASE_DIR, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise CommandError(f"daphne exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/api/schema/", timeout=2).status_code < 500:
                    return proc, url
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop_server(proc)
        raise CommandError("daphne did not start within 60 s")

    @staticmethod
    def stop_server(proc) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    # --- load ----------------------------------------------------------------------------------
    def run(self, url: str, token: str, job_ids: list[int], opts) -> dict:
        endpoints = {
            "job list": lambda rnd: "/api/v1/jobs/?limit=50",
            "job detail": lambda rnd: f"/api/v1/jobs/{rnd.choice(job_ids)}/",
            "metrics": lambda rnd: (f"/api/v1/jobs/{rnd.choice(job_ids)}/metrics/"
                                    f"?points={opts['metric_points']}"),
        }
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:  # warm up every endpoint
            for make in endpoints.values():
                c.get(make(random.Random(0))).raise_for_status()
        results = {}
        for name, make in endpoints.items():
            lat: list[float] = []
            errors: list[int] = []
            lock = threading.Lock()
            start = threading.Barrier(opts["clients"] + 1)

            def client(seed: int, make=make, lat=lat, errors=errors, lock=lock, start=start):
                rnd = random.Random(seed)
                with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
                    start.wait()
                    for _ in range(opts["requests"]):
                        t = time.perf_counter()
                        try:
                            r = c.get(make(rnd))
                            ok = r.status_code == 200
                            code = r.status_code
                        except httpx.TransportError:
                            ok, code = False, -1
                        dt = time.perf_counter() - t
                        with lock:
                            lat.append(dt)
                            if not ok:
                                errors.append(code)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(opts["clients"])]
            for th in threads:
                th.start()
            start.wait()
            t0 = time.perf_counter()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t0
            results[name] = {
                "requests": len(lat), "errors": len(errors), "error_codes": sorted(set(errors)),
                "p50_ms": _pct(lat, 0.5) * 1e3, "p95_ms": _pct(lat, 0.95) * 1e3,
                "p99_ms": _pct(lat, 0.99) * 1e3,
                "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
                "throughput_rps": len(lat) / wall if wall else 0.0, "wall_s": wall,
            }
        return results

    def print_table(self, report: dict) -> None:
        self.stdout.write(f"\nAPI bench: {report['clients']} concurrent clients, {report['jobs']} jobs, "
                          f"{report['metric_points']} metric points, server {report['server']}, "
                          f"db {report['database']}, {report['cpu_count']} CPUs")
        head = (f"{'endpoint':<12} {'requests':>8} {'errors':>6} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} "
                f"{'req/s':>8}")
        self.stdout.write(head)
        self.stdout.write("-" * len(head))
        for name, r in report["endpoints"].items():
            self.stdout.write(f"{name:<12} {r['requests']:>8} {r['errors']:>6} {r['p50_ms']:>9.1f} "
                              f"{r['p95_ms']:>9.1f} {r['p99_ms']:>9.1f} {r['throughput_rps']:>8.1f}")
