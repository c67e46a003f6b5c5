"""Blob-store layout of a job (every key starts with jobs/<job>/).

    global/f<PPP>/v<VVVVVVVV>-e<EEEE>   a GlobalFragment written by syncer epoch E (before its
                                        OuterStep row; the epoch keeps a fenced syncer from
                                        overwriting a committed version)
    update/f<PPP>/v<VVVVVVVV>-e<EEEE>   the same version as a compressed update from v - 1, when
                                        the job sets global_compression (written before the
                                        global, so a committed version has both)
    head                                JSON {fragment: version, "epochs": {fragment: epoch}} of
                                        committed versions (written after the row); with
                                        syncer_shards S > 1, shard k > 0 writes head-s<KK> for
                                        its fragments (p % S == k) and learners read all S
    contrib/l<LLL>-i<IIII>-f<PPP>-v<BBBBBBBB>-t<start>-<end>
                                        a Contribution; [start, end) is the learner's token-stream
                                        range behind it (exactly-once accounting)
    learners/l<LLL>/i<IIII>             newest checkpoint of that learner incarnation
    syncer/s<CCCCCCCC>-e<EEEE>[-k<KK>]  syncer snapshot after commit C by epoch E (of shard K > 0)
    checkpoints/v<VVVVVVVV>-<kind>.safetensors   model exports (periodic / final)
"""
from __future__ import annotations

import re
from dataclasses import dataclass


def job_prefix(job) -> str:
    return f"jobs/{job}/"


def global_key(job, fragment: int, version: int, epoch: int | None = None) -> str:
    base = f"jobs/{job}/global/f{fragment:03d}/v{version:08d}"
    return base if epoch is None else f"{base}-e{int(epoch):04d}"


def update_key(job, fragment: int, version: int, epoch: int | None = None) -> str:
    base = f"jobs/{job}/update/f{fragment:03d}/v{version:08d}"
    return base if epoch is None else f"{base}-e{int(epoch):04d}"


def head_blob(versions: dict, epochs: dict) -> bytes:
    import json

    out: dict = {str(k): int(v) for k, v in versions.items()}
    out["epochs"] = {str(k): int(v) for k, v in epochs.items()}
    return json.dumps(out).encode()


def parse_head(blob: bytes) -> tuple[dict[int, int], dict[int, int]]:
    """(versions, epochs) from a head blob; epochs empty for heads written without them."""
    import json

    data = json.loads(blob)
    epochs = {int(k): int(v) for k, v in (data.pop("epochs", None) or {}).items()}
    return {int(k): int(v) for k, v in data.items()}, epochs


def head_key(job, shard: int = 0) -> str:
    """The committed versions of the fragments one syncer shard merges (shard 0: `head`)."""
    return f"jobs/{job}/head" if not shard else f"jobs/{job}/head-s{int(shard):02d}"


def head_keys(job, shards: int = 1) -> list[str]:
    return [head_key(job, k) for k in range(max(1, int(shards)))]


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


def syncer_state_key(job, commit: int, epoch: int = 0, shard: int = 0) -> str:
    suffix = f"-k{int(shard):02d}" if shard else ""
    return f"jobs/{job}/syncer/s{commit:08d}-e{int(epoch):04d}{suffix}"


def checkpoint_key(job, version: int, kind: str) -> str:
    return f"jobs/{job}/checkpoints/v{version:08d}-{kind}.safetensors"
