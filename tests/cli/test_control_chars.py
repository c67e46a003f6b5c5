"""Issue 35, Low: terminal escapes in server strings (event messages, job names) reached the CLI
raw: cursor moves, screen clears, OSC 8 hyperlinks; a CI log could be spoofed."""
from __future__ import annotations

import json

import pytest
from rich.console import Console

from apps.jobs.models import Event, Job
from diloco_cli.safe import SafeConsole, clean

pytestmark = pytest.mark.django_db

HOSTILE = ("ok \x1b[2J\x1b[H\x1b]8;;https://evil.example/\x07click\x1b]8;;\x07 "
           "\x1b]0;title\x1b\\\x9b31m\x07\x08\r\x01bell \u202eevil\u202c"
           "\n2026-01-01 00:00:00 completed   job finished")


def _no_controls(text: str) -> None:
    for ch in text:
        code = ord(ch)
        bad = code < 0x20 or 0x7F <= code <= 0x9F or 0x202A <= code <= 0x202E
        assert ch in "\n\t" or not bad, repr(text)
    assert "evil.example" not in text  # the hyperlink target is gone with its OSC sequence


def test_clean_strips_sequences_and_keeps_text():
    assert clean("plain text, é ü 中") == "plain text, é ü 中"
    assert clean("a\x1b[31mred\x1b[0m b") == "ared b"
    assert clean("x\x1b]8;;http://evil\x07link\x1b]8;;\x07y") == "xlinky"
    assert clean("a\x1b]0;title\x1b\\b") == "ab"
    assert clean("line1\nline2\tcol") == "line1\nline2\tcol"
    assert clean("a\rb\x08c\x00d\x7fe\x85f") == "abcdef"
    assert clean("8bit\x9b2Jcsi") == "8bitcsi"
    assert clean("bidi\u202eoverride\u2066") == "bidioverride"
    assert clean(42) == "42"


def test_safe_console_cleans_print_and_table_cells():
    from rich.table import Table

    con = SafeConsole(record=True, force_terminal=False, width=200)
    con.print(f"message: {HOSTILE}")
    t = Table("name")
    t.add_row("[link=https://markup.example/]job[/link] \x1b[1A")
    con.print(t)
    text = con.export_text()
    _no_controls(text)
    assert "[link=" in text  # rich markup from the server is shown, not obeyed


def test_plain_rich_console_passes_escapes_through():
    """Why SafeConsole exists: rich alone keeps ESC (it strips only BEL, BS, VT, FF and CR)."""
    con = Console(record=True, force_terminal=False, width=200, markup=False)
    con.print("a\x1b[2Jb")
    assert "\x1b[2J" in con.export_text()


def test_jobs_logs_prints_no_escape_sequences(cli, alice):
    job = Job.objects.create(owner=alice, name="j", status="running",
                             spec={"learners": 1, "steps": 10, "batch_size": 4, "seq_len": 8})
    Event.objects.create(job=job, kind="placed", message=HOSTILE)
    r = cli("jobs", "logs", job.pk)
    assert r.exit_code == 0
    _no_controls(r.stdout)
    assert "click" in r.stdout and "bell" in r.stdout
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, lines  # the newline cannot forge a second event line
    # --json stays exact: json.dumps escapes the control characters
    raw = cli("jobs", "logs", job.pk, "--json").stdout
    assert "\x1b" not in raw
    assert json.loads(raw.strip())["message"] == HOSTILE


def test_errors_and_names_are_cleaned(cli, alice):
    name = "evil\x1b[2Jname\x1b]8;;https://evil.example/\x07x"
    job = Job.objects.create(owner=alice, name=name, status="running",
                             spec={"learners": 1, "steps": 10, "batch_size": 4, "seq_len": 8})
    r = cli("jobs", "status", job.pk)
    assert r.exit_code == 0
    _no_controls(r.stdout)
    assert "evilname" in r.stdout
    r = cli("jobs", "list")
    _no_controls(r.stdout)
