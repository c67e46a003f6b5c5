"""python manage.py sites_drill [--quick] [--json PATH]: faults across sites in network namespaces."""
from __future__ import annotations

import json
import tempfile

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = ("Start a control plane and three sites in network namespaces (uplinks shaped at 1000, 100 "
            "and 20 Mbit/s), run a decoupled job fault-free, then again through a partition of a site, "
            "the loss of a whole site and a slow uplink, then an island over two nodes with one node "
            "partitioned; print a JSON report (detection and healing times, gaps, duplicates, loss). "
            "Needs root (ip netns, tc).")

    def add_arguments(self, parser):
        parser.add_argument("--quick", action="store_true", help="20 s partition, shorter jobs")
        parser.add_argument("--json", dest="json_path", help="also write the report to this file")
        parser.add_argument("--tmp", help="folder for logs and the control plane's data (default: a new one)")

    def handle(self, *args, quick=False, json_path=None, tmp=None, **opts):
        from harness.drill import run_sites_drill
        from harness.sites import SitesError

        try:
            report = run_sites_drill(tmp or tempfile.mkdtemp(prefix="sites-drill-"), quick=quick,
                                     json_path=json_path, log=lambda m: self.stderr.write(m))
        except SitesError as exc:
            raise CommandError(str(exc)[:4000]) from None
        self.stdout.write(json.dumps(report, indent=2, default=str))
        ok = (report.get("status") == "completed" and report.get("duplicates_applied") == 0
              and report.get("fenced_applied") == 0 and report.get("every_incident_healed"))
        if not ok:
            raise CommandError("drill failed: see the report above")
