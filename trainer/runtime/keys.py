"""Blob-store layout of a job (every key starts with jobs/<job>/).

    global/f<PPP>/v<VVVVVVVV>           a GlobalFragment (written before its OuterStep row)
    head                                JSON {fragment: version} of committed versions (after the row)
    contrib/l<LLL>-i<IIII>-f<PPP>-v<BBBBBBBB>-t<start>-<end>
                                        a Contribution; [start, end) is the learner's token-stream
                                        range behind it (exactly-once accounting)
    learners/l<LLL>/i<IIII>             newest checkpoint of that learner incarnation
    syncer/s<CCCCCCCC>                  syncer snapshot after commit C
    checkpoints/v<VVVVVVVV>-<kind>.safetensors   model exports (periodic / final)
"""
from __future__ import annotations

import re
from dataclasses import dataclass


def job_prefix(job) -> str:
    return f"jobs/{job}/"


def global_key(job, fragment: int, version: int) -> str:
    return f"jobs/{job}/global/f{fragment:03d}/v{version:08d}"


def head_key(job) -> str:
    return f"jobs/{job}/head"


def contrib_prefix(job) -> str:
    return f"jobs/{job}/contrib/"


def contrib_key(job, learner: int, incarnation: int, fragment: int, base_version: int,
                start: int, end: int) -> str:
    return (f"jobs/{job}/contrib/l{learner:03d}-i{incarnation:04d}-f{fragment:03d}"
            f"-v{base_version:08d}-t{start:014d}-{end:014d}")


_CONTRIB_RE = re.compile(
    r"^jobs/(?P<job>[^/]+)/contrib/l(?P<learner>\d+)-i(?P<incarnation>\d+)-f(?P<fragment>\d+)"
    r"-v(?P<base_version>\d+)-t(?P<start>\d+)-(?P<end>\d+)$"
)


@dataclass(frozen=True)
class ContribRef:
    key: str
    learner: int
    incarnation: int
    fragment: int
    base_version: int
    start: int
    end: int


def parse_contrib_key(key: str) -> ContribRef | None:
    m = _CONTRIB_RE.match(key)
    if not m:
        return None
    d = {k: int(v) for k, v in m.groupdict().items() if k != "job"}
    if d["end"] < d["start"]:
        return None
    return ContribRef(key=key, **d)


def learner_prefix(job, learner: int) -> str:
    return f"jobs/{job}/learners/l{learner:03d}/"


def learner_ckpt_key(job, learner: int, incarnation: int) -> str:
    return f"jobs/{job}/learners/l{learner:03d}/i{incarnation:04d}"


def parse_learner_ckpt_incarnation(key: str) -> int | None:
    m = re.search(r"/i(\d+)$", key)
    return int(m.group(1)) if m else None


def syncer_state_key(job, commit: int) -> str:
    return f"jobs/{job}/syncer/s{commit:08d}"


def checkpoint_key(job, version: int, kind: str) -> str:
    return f"jobs/{job}/checkpoints/v{version:08d}-{kind}.safetensors"
