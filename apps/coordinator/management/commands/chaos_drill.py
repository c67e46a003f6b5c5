"""python manage.py chaos_drill [--quick] [--islands] [--json PATH]: SIGKILL drill against a real stack."""
from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = ("Start a real stack (web, coordinator, beat, three one-slot pools, a private Redis), run a "
            "job failure-free, then again while killing a learner's worker, the coordinator and Redis "
            "and draining a pool; print a JSON report (recovery times, downtime, duplicates, loss).")

    def add_arguments(self, parser):
        parser.add_argument("--quick", action="store_true", help="small job (one to three minutes)")
        parser.add_argument("--json", dest="json_path", help="also write the report to this file")
        parser.add_argument("--islands", action="store_true",
                            help="then kill -9 one rank of a learner of 2 processes (islands, gloo)")
        parser.add_argument("--tmp", help="folder for logs, blobs and the private Redis (default: a new one)")

    def handle(self, *args, quick=False, json_path=None, tmp=None, islands=False, **opts):
        from apps.coordinator.chaos import run_drill
        from apps.coordinator.stack import StackError

        try:
            report = run_drill(quick=quick, json_path=json_path, tmp=tmp, islands=islands,
                               log=lambda m: self.stderr.write(m))
        except (StackError, RuntimeError) as exc:
            raise CommandError(str(exc)[:4000]) from None
        self.stdout.write(json.dumps(report, indent=2, default=str))
        ok = report.get("status") == "completed" and report.get("duplicates_applied") == 0
        island = report.get("island")
        if island is not None:
            ok = ok and island["status"] == "completed" and island["duplicates_applied"] == 0 \
                and not island["other_learner_restarted"]
        if not ok:
            raise CommandError("drill failed: see the report above")
