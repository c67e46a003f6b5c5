"""A model factory that must never run on the platform: importing or calling it leaves a mark.

The tenant-boundary tests name it in hostile specs; a file in $DILOCO_TRIPWIRE proves that the
platform imported user-named code.
"""
from __future__ import annotations

import os
from pathlib import Path


def _mark(what: str) -> None:
    target = os.environ.get("DILOCO_TRIPWIRE")
    if target:
        with Path(target).open("a") as fh:
            fh.write(what + "\n")


_mark("imported")


def build(**kwargs):
    _mark("called")
    raise RuntimeError("tripwire factory called")
