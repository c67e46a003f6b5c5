"""Terminal-safe text: every string the server sent is cleaned before the CLI prints it.

Event messages, job and pool names, error details come from other people (a pool token
writes events; a teammate names a job). Printed raw, an escape sequence in one of them moves
the cursor, rewrites earlier lines, sets the window title or plants an OSC 8 hyperlink: a CI
log or a terminal would show what the sender chose, not what happened. `clean` removes:

- ESC sequences: CSI (`ESC [ ... final`), OSC/DCS/SOS/PM/APC strings (up to BEL or `ESC \\`),
  and any other `ESC x`;
- C0 control characters except newline and tab, DEL, and the C1 range (U+0080-U+009F: the
  8-bit forms of CSI and OSC, which some terminals obey);
- bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069), which reorder
  what a line appears to say.

`SafeConsole` applies it to every string a rich Console renders (print arguments, table
cells and headers) and turns rich markup off, so `[link=...]` in a job name stays text.
JSON output (`--json`) needs nothing: json.dumps escapes every control character.
"""
from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape

_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"                      # CSI ... final byte
    r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?"     # OSC, DCS, SOS, PM, APC ... BEL or ST
    r"|\x1b[ -/]*[0-~]?"                              # other ESC sequences (and a lone ESC)
    r"|\x9b[0-?]*[ -/]*[@-~]?"                        # 8-bit CSI
    r"|[\x9d\x90\x98\x9e\x9f][^\x07\x1b\x9c]*(?:\x07|\x9c|\x1b\\)?"  # 8-bit OSC, DCS, SOS, PM, APC
)
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: object) -> str:
    """`text` as a string with no terminal control sequences (newlines and tabs kept)."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():  # the common case: nothing to strip (newline and tab are not printable)
        return s
    return _CONTROLS.sub("", _ESCAPES.sub("", s))


def clean_markup(text: object) -> str:
    """`clean`, then rich markup escaped: for a value put into a markup template."""
    return escape(clean(text))


class SafeConsole(Console):
    """A rich Console that cleans every string it renders; markup and emoji codes off by default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("markup", False)
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    def render_str(self, text: str, **kwargs):
        return super().render_str(clean(text), **kwargs)
