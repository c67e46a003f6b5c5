"""manage.py export_inventory [-o FILE]: the inventory as YAML that import_inventory reads back."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand

from apps.inventory.inventory_file import dump


class Command(BaseCommand):
    help = "Export pools and their accelerator types as a YAML inventory file."

    def add_arguments(self, parser):
        parser.add_argument("-o", "--output", help="write to this file instead of standard output")
        parser.add_argument(
            "--all-accelerators",
            action="store_true",
            help="include every catalogue entry, not only those the pools use",
        )

    def handle(self, *args, output: str | None, all_accelerators: bool, **opts):
        text = dump(all_accelerators=all_accelerators)
        if output:
            Path(output).write_text(text, encoding="utf-8")
            self.stderr.write(f"wrote {output}")
        else:
            self.stdout.write(text, ending="")
