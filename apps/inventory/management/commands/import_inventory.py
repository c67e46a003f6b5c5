"""manage.py import_inventory FILE.yaml: upsert accelerator types and pools, all or nothing."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from apps.inventory.inventory_file import InventoryFileError, apply, load


class Command(BaseCommand):
    help = "Import pools (and extra accelerator types) from a YAML inventory file ('-' reads stdin)."

    def add_arguments(self, parser):
        parser.add_argument("file", help="path of the YAML file, or - for standard input")
        parser.add_argument("--dry-run", action="store_true", help="validate only; change nothing")
        parser.add_argument(
            "--only-new",
            action="store_true",
            help="create what is missing; leave existing pools and accelerators as they are",
        )

    def handle(self, *args, file: str, dry_run: bool, only_new: bool, **opts):
        if file == "-":
            import sys

            raw = sys.stdin.buffer.read()
        else:
            path = Path(file)
            if not path.is_file():
                raise CommandError(f"{file}: no such file")
            raw = path.read_bytes()
        try:
            inv = load(raw)
        except InventoryFileError as exc:
            raise CommandError(
                f"{file}: nothing imported, {len(exc.errors)} problem(s):\n  " + "\n  ".join(exc.errors)
            ) from None
        if dry_run:
            self.stdout.write(f"{file}: valid ({len(inv.accelerators)} accelerators, {len(inv.pools)} pools)")
            return
        summary = apply(inv, only_new=only_new)
        self.stdout.write(self.style.SUCCESS(f"{file}: imported; {summary}"))
