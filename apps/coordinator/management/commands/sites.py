"""python manage.py sites up|down: a control plane and sites in network namespaces, for people."""
from __future__ import annotations

import signal
import tempfile
import time

from django.core.management.base import BaseCommand, CommandError


def _site(text: str):
    """NAME:MBIT[:NODES[:SLOTS]], e.g. iad:1000:2:1 (MBIT 0: unshaped)."""
    from harness.sites import SiteSpec

    parts = text.split(":")
    try:
        mbit = float(parts[1]) if len(parts) > 1 else 0
        nodes = int(parts[2]) if len(parts) > 2 else 1
        slots = int(parts[3]) if len(parts) > 3 else 1
    except ValueError:
        raise CommandError(f"--site {text!r}: expected NAME:MBIT[:NODES[:SLOTS]]") from None
    bounded = 0 <= mbit <= 100_000 and 1 <= nodes <= 8 and 1 <= slots <= 8
    if not parts[0].isidentifier() or not bounded:
        raise CommandError(f"--site {text!r}: a name, 0-100000 Mbit/s, 1-8 nodes, 1-8 slots")
    return SiteSpec(parts[0], mbit or None, nodes, slots)


class Command(BaseCommand):
    help = ("`sites up`: start a control plane (its own PostgreSQL and Redis, web, coordinator, syncer, "
            "beat) and sites behind shaped uplinks in network namespaces, print how to reach them and "
            "stay up until Ctrl-C (everything is torn down then). `sites down`: remove namespaces a "
            "killed run left.")

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["up", "down"])
        parser.add_argument("--site", action="append", default=[], metavar="NAME:MBIT[:NODES[:SLOTS]]",
                            help="a site (repeatable; default s1:1000 s2:100 s3:20)")
        parser.add_argument("--tmp", help="folder for logs and the control plane's data")

    def handle(self, *args, action: str, site: list[str], tmp: str | None = None, **opts):
        from harness.sites import Sites, SitesError, cleanup_stale

        if action == "down":
            gone = cleanup_stale()
            self.stdout.write(f"removed {len(gone)} namespaces" + (f": {' '.join(gone)}" if gone else ""))
            return
        specs = [_site(s) for s in site] or [_site("s1:1000"), _site("s2:100"), _site("s3:20")]
        folder = tmp or tempfile.mkdtemp(prefix="sites-")
        stop = []
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        try:
            with Sites(folder, specs) as sites:
                self.stdout.write(f"control plane: namespace {sites.ctl}, web {sites.web_url}, "
                                  f"logs {sites.logs}")
                for s in specs:
                    self.stdout.write(f"  site {s.name}: {s.mbit or 'unshaped'} Mbit/s, "
                                      + ", ".join(sites.node_ns(s.name, j) for j in range(1, s.nodes + 1)))
                self.stdout.write(f"API token of user 'sites': {sites.bootstrap['user_token']}")
                self.stdout.write(f"e.g. ip netns exec {sites.ctl} curl -H 'Authorization: Bearer <token>' "
                                  f"{sites.web_url}/api/v1/jobs/   (Ctrl-C tears everything down)")
                while not stop:
                    time.sleep(1)
        except SitesError as exc:
            raise CommandError(str(exc)[:4000]) from None
        except KeyboardInterrupt:
            pass
