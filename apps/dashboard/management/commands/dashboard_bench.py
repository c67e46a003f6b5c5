"""Server render time of each dashboard page with many jobs and metric points.

    python manage.py dashboard_bench [--jobs 50] [--points 100000] [--repeat 5] [--json out.json]

Seeds the data (plus one more job holding another `--points` points, the worst case for
a job page) inside a transaction that is rolled back at the end (the database is left
as it was), renders every page through Django's test client as a staff user and as the
owner, and prints a table (median and max ms, SQL queries per page) plus JSON.
Target: every page under 300 ms.
"""
from __future__ import annotations

import json
import statistics
import time

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.dashboard.seeding import seed_jobs

TARGET_MS = 300.0


class Command(BaseCommand):
    help = "Measure server render time of the dashboard pages (50 jobs, 100k metric points by default)."

    def add_arguments(self, parser):
        parser.add_argument("--jobs", type=int, default=50)
        parser.add_argument("--points", type=int, default=100_000)
        parser.add_argument("--repeat", type=int, default=5)
        parser.add_argument("--json", dest="json_path", default="", help="also write the results here")

    def handle(self, *args, jobs: int, points: int, repeat: int, json_path: str, **opts):
        if jobs < 1 or points < 0 or repeat < 1:
            self.stderr.write("need --jobs >= 1, --points >= 0, --repeat >= 1")
            return
        results: list[dict] = []
        with transaction.atomic():
            t0 = time.perf_counter()
            user = get_user_model().objects.create_user(
                "dashboard-bench", "bench@example.com", "bench-pw-123456", is_staff=True)
            created = seed_jobs(user, jobs=jobs, points=points)
            seed_s = time.perf_counter() - t0
            running = next((j for j in created if j.status == "running"), created[0])
            pages = [
                ("overview", "/"),
                ("fleet", "/fleet/"),
                ("pool", "/fleet/h100-east/"),
                ("jobs", "/jobs/"),
                ("jobs?status=running&q=bench", "/jobs/?status=running&q=bench"),
                ("jobs/new", "/jobs/new"),
                ("job detail", f"/jobs/{running.pk}/"),
                ("job series.json", f"/jobs/{running.pk}/series.json"),
            ]
            # worst case for one job page: every metric point in a single job
            hot = seed_jobs(user, jobs=1, points=points, running_share=1.0, seed=1)[0]
            pages += [
                (f"job detail ({points // 1000}k pts in 1 job)", f"/jobs/{hot.pk}/"),
                ("job series.json (same job)", f"/jobs/{hot.pk}/series.json"),
            ]
            if connection.vendor == "postgresql":
                # Fresh statistics, as autovacuum keeps them on a live database (the seeded
                # rows are uncommitted, so autovacuum cannot see them here).
                with connection.cursor() as cur:
                    for model in ("jobs_metricpoint", "jobs_job", "jobs_learner", "jobs_event"):
                        cur.execute(f"ANALYZE {connection.ops.quote_name(model)}")
            client = Client()
            client.force_login(user)
            for label, url in pages:
                times, queries, status = [], 0, 0
                for i in range(repeat + 1):  # first run warms caches and is not counted
                    with CaptureQueriesContext(connection) as ctx:
                        t = time.perf_counter()
                        resp = client.get(url)
                        _ = resp.content
                        dt = (time.perf_counter() - t) * 1000
                    status = resp.status_code
                    if i:
                        times.append(dt)
                        queries = len(ctx.captured_queries)
                results.append({
                    "page": label, "url": url, "status": status,
                    "median_ms": round(statistics.median(times), 1),
                    "max_ms": round(max(times), 1), "queries": queries,
                    "ok": status == 200 and statistics.median(times) < TARGET_MS,
                })
            transaction.set_rollback(True)
        report = {"jobs": jobs, "metric_points": points, "repeat": repeat, "seed_s": round(seed_s, 1),
                  "target_ms": TARGET_MS, "database": connection.vendor, "pages": results,
                  "all_under_target": all(r["ok"] for r in results)}
        self.stdout.write(f"dashboard bench: {jobs} jobs, {points} metric points, {connection.vendor}, "
                          f"median of {repeat} renders (seeded in {seed_s:.1f} s)")
        self.stdout.write(f"{'page':36} {'status':>6} {'median ms':>10} {'max ms':>8} {'queries':>8}  target")
        for r in results:
            mark = "ok" if r["ok"] else "SLOW"
            self.stdout.write(f"{r['page']:36} {r['status']:>6} {r['median_ms']:>10.1f} {r['max_ms']:>8.1f} "
                              f"{r['queries']:>8}  {mark}")
        text = json.dumps(report, indent=2)
        self.stdout.write(text)
        if json_path:
            with open(json_path, "w") as fh:
                fh.write(text + "\n")
