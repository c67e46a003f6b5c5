"""Validation of agent -> server websocket messages (see docs/telemetry.md).

Everything a worker or the coordinator sends over `/ws/agent/` goes through `parse_frame`: it
returns a clean dict (only known fields, right types, finite numbers, sane bounds) or raises
`ProtocolError` with a reason that names the offending field. The consumer closes the
connection with code 4400 and that reason; nothing here touches the database.
"""
from __future__ import annotations

import json
import math
import re
import unicodedata
from typing import Any

MAX_INT64 = 2**63 - 1
MAX_INT32 = 2**31 - 1
# Token counts (a heartbeat's `tokens`, a metric point's `step`): exact in a double, and a sum
# over millions of learners still fits PostgreSQL's bigint.
MAX_COUNT = 2**53 - 1
MAX_POINTS = 2000
MAX_MESSAGE_CHARS = 300
MAX_NAME_CHARS = 255
# An event's payload, as compact JSON: enough for a reason and a few figures, not a store.
MAX_PAYLOAD_BYTES = 2048
# Unix seconds between 2001 and 2286: catches milliseconds and garbage.
MIN_TIME, MAX_TIME = 1e9, 1e10

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
TYPE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
SLUG_RE = re.compile(r"^[-a-zA-Z0-9_]{1,40}$")

# Event.Kind values (kept in sync with apps/jobs/models.py; checked by a test).
EVENT_KINDS = frozenset(
    {"status", "placed", "failed", "reassigned", "rebalanced", "joined", "left", "checkpointed",
     "merged", "rejected", "drained", "info"}
)
# What a pool token may report: the others (status, placement, moves, checkpoints, merges...)
# are the coordinator's decisions, and the dashboards draw them as such (job status, move
# markers). Pool workers send no events today; `info` is a note on the job's timeline.
POOL_EVENT_KINDS = frozenset({"info"})
# Metric series that describe the whole job, written by the coordinator only (learner null):
# a learner-level point with one of these names is refused from pools and ignored by the
# dashboards' figures.
JOB_SERIES = frozenset({"val_loss", "goodput", "bytes_sent", "outer_step_norm"})
CONTROL_ACTIONS = frozenset({"resize", "stop", "migrate", "pause"})


# Bidirectional overrides and isolates: they reorder what a terminal or a page shows.
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) == "Cc" or ch in _BIDI


def clean_text(text: str) -> str:
    """`text` without control characters (C0, DEL, C1: newlines, terminal escapes...) nor
    bidirectional overrides: a line break or a tab becomes a space, the rest is dropped, so
    text from an agent can neither forge log lines nor drive a terminal."""
    if text.isprintable():  # the common case: nothing to do (no Cc, no Cf, no separators)
        return text
    out = []
    for ch in text:
        if ch in "\t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029":
            out.append(" ")
        elif not _is_control(ch):
            out.append(ch)
    return "".join(out)


def clean_json(obj: Any) -> Any:
    """`clean_text` on every string (keys too) of a decoded JSON value."""
    if isinstance(obj, str):
        return clean_text(obj)
    if isinstance(obj, dict):
        return {clean_text(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean_json(v) for v in obj]
    return obj


class ProtocolError(ValueError):
    """A malformed frame; `reason` is short enough for a websocket close frame (<= 123 bytes)."""

    def __init__(self, reason: str):
        reason = clean_text(reason)  # it is logged, and it may quote the agent's own text
        if len(reason.encode()) > 120:
            reason = reason.encode()[:117].decode(errors="ignore") + "..."
        super().__init__(reason)
        self.reason = reason


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"non-finite number {name} is not allowed")


MAX_DEPTH = 32


def _check_strings(obj: Any, depth: int = 0) -> None:
    """Reject what PostgreSQL cannot store (NUL characters, lone surrogates) and deep nesting."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"JSON nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, str):
        if "\x00" in obj:
            raise ProtocolError("strings may not contain NUL characters")
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError("strings must be valid Unicode (lone surrogate escape)") from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_strings(k, depth + 1)
            _check_strings(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_strings(v, depth + 1)


def loads(text: str) -> Any:
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints over Python's digit limit
        raise ProtocolError(f"invalid JSON: {str(exc)[:80]}") from None
    _check_strings(obj)
    return obj


# -- field checkers -----------------------------------------------------------------------------

def _int(msg: dict, key: str, *, lo: int = 0, hi: int = MAX_INT64, where: str) -> int:
    v = msg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{where}.{key} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(f"{where}.{key} out of range [{lo}, {hi}]")
    return v


def _float(msg: dict, key: str, *, lo: float = -1e30, hi: float = 1e30, where: str) -> float:
    v = msg[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ProtocolError(f"{where}.{key} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise ProtocolError(f"{where}.{key} must be finite")
    if not lo <= v <= hi:
        raise ProtocolError(f"{where}.{key} out of range [{lo:g}, {hi:g}]")
    return v


def _str(msg: dict, key: str, *, max_len: int, where: str, pattern: re.Pattern | None = None) -> str:
    v = msg[key]
    if not isinstance(v, str):
        raise ProtocolError(f"{where}.{key} must be a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(f"{where}.{key} longer than {max_len} characters")
    if "\x00" in v:
        raise ProtocolError(f"{where}.{key} contains a NUL character")
    if not v.isprintable() and any(_is_control(ch) for ch in v):
        raise ProtocolError(f"{where}.{key} contains control characters")
    if pattern is not None and not pattern.match(v):
        raise ProtocolError(f"{where}.{key} has an invalid format")
    return v


def _check_keys(msg: dict, required: set[str], optional: set[str], where: str) -> None:
    missing = required - msg.keys()
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {', '.join(sorted(missing))}")
    unknown = msg.keys() - required - optional
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))[:60]}")


def _opt(msg: dict, key: str, fn, **kw) -> Any:
    return None if msg.get(key) is None else fn(msg, key, **kw)


def _time(msg: dict, where: str) -> float | None:
    return _opt(msg, "time", _float, lo=MIN_TIME, hi=MAX_TIME, where=where)


# -- message types ------------------------------------------------------------------------------

def _hello(msg: dict) -> dict:
    w = "hello"
    _check_keys(msg, {"type"}, {"worker", "pool", "version"}, w)
    return {
        "type": "hello",
        "worker": _opt(msg, "worker", _str, max_len=MAX_NAME_CHARS, where=w),
        "pool": _opt(msg, "pool", _str, max_len=40, where=w, pattern=SLUG_RE),
        "version": _opt(msg, "version", _str, max_len=40, where=w),
    }


def _heartbeat(msg: dict) -> dict:
    w = "heartbeat"
    _check_keys(
        msg,
        {"type", "job", "learner", "incarnation", "step", "tokens"},
        {"loss", "tokens_per_s", "util", "power_w", "staleness", "time"},
        w,
    )
    return {
        "type": "heartbeat",
        "job": _int(msg, "job", lo=1, where=w),
        "learner": _int(msg, "learner", hi=MAX_INT32, where=w),
        "incarnation": _int(msg, "incarnation", hi=MAX_INT32, where=w),
        "step": _int(msg, "step", hi=MAX_INT32, where=w),
        "tokens": _int(msg, "tokens", hi=MAX_COUNT, where=w),
        "loss": _opt(msg, "loss", _float, where=w),
        "tokens_per_s": _opt(msg, "tokens_per_s", _float, lo=0, hi=1e15, where=w),
        "util": _opt(msg, "util", _float, lo=0, hi=100, where=w),
        "power_w": _opt(msg, "power_w", _float, lo=0, hi=1e7, where=w),
        "staleness": _opt(msg, "staleness", _int, lo=-MAX_INT32, hi=MAX_INT32, where=w) or 0,
        "time": _time(msg, w),
    }


def _point(p: Any, i: int) -> dict:
    w = f"metrics.points[{i}]"
    if not isinstance(p, dict):
        raise ProtocolError(f"{w} must be an object")
    _check_keys(p, {"name", "value"}, {"learner", "step", "time"}, w)
    return {
        # learner null is a job-level point (coordinator token only; checked by the consumer)
        "learner": _opt(p, "learner", _int, hi=MAX_INT32, where=w),
        "name": _str(p, "name", max_len=40, where=w, pattern=NAME_RE),
        # tokens (a learner's own, or the job's for job-level points)
        "step": _opt(p, "step", _int, hi=MAX_COUNT, where=w) or 0,
        "value": _float(p, "value", where=w),
        "time": _time(p, w),
    }


def _metrics(msg: dict) -> dict:
    w = "metrics"
    _check_keys(msg, {"type", "job", "points"}, set(), w)
    points = msg["points"]
    if not isinstance(points, list):
        raise ProtocolError("metrics.points must be a list")
    if len(points) > MAX_POINTS:
        raise ProtocolError(f"metrics.points: at most {MAX_POINTS} points per message")
    return {
        "type": "metrics",
        "job": _int(msg, "job", lo=1, where=w),
        "points": [_point(p, i) for i, p in enumerate(points)],
    }


def _event(msg: dict) -> dict:
    w = "event"
    _check_keys(msg, {"type", "job", "kind"}, {"message", "payload", "learner", "time", "pool"}, w)
    kind = _str(msg, "kind", max_len=16, where=w)
    if kind not in EVENT_KINDS:
        raise ProtocolError(f"event.kind {kind!r} unknown; one of {', '.join(sorted(EVENT_KINDS))}")
    payload = msg.get("payload")
    if payload is None:
        payload = {}
    elif not isinstance(payload, dict):
        raise ProtocolError("event.payload must be an object")
    elif len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"event.payload larger than {MAX_PAYLOAD_BYTES} bytes (as JSON)")
    message = msg.get("message")
    if message is not None and not isinstance(message, str):
        raise ProtocolError(f"event.message must be a string, got {type(message).__name__}")
    if message is not None and len(message) > MAX_MESSAGE_CHARS:
        raise ProtocolError(f"event.message longer than {MAX_MESSAGE_CHARS} characters")
    return {
        "type": "event",
        # job may be null for fleet-level events (coordinator token only; checked by the consumer)
        "job": _opt(msg, "job", _int, lo=1, where=w),
        "kind": kind,
        # free text shown on timelines, in logs and in terminals: control characters removed
        "message": clean_text(message or ""),
        "payload": clean_json(payload),
        "learner": _opt(msg, "learner", _int, hi=MAX_INT32, where=w),
        "pool": _opt(msg, "pool", _str, max_len=40, where=w, pattern=SLUG_RE),
        "time": _time(msg, w),
    }


def _subscribe(msg: dict) -> dict:
    w = "subscribe"
    _check_keys(msg, {"type", "job", "learner"}, set(), w)
    return {
        "type": "subscribe",
        "job": _int(msg, "job", lo=1, where=w),
        "learner": _int(msg, "learner", hi=MAX_INT32, where=w),
    }


def _publish(msg: dict) -> dict:
    w = "publish"
    _check_keys(msg, {"type", "message"}, {"job"}, w)
    inner = msg["message"]
    if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
        raise ProtocolError("publish.message must be an object with a string 'type'")
    if not TYPE_RE.match(inner["type"]):
        raise ProtocolError("publish.message.type has an invalid format")
    return {"type": "publish", "job": _opt(msg, "job", _int, lo=1, where=w), "message": inner}


def _ping(msg: dict) -> dict:
    _check_keys(msg, {"type"}, {"time"}, "ping")
    return {"type": "ping"}


PARSERS = {
    "hello": _hello,
    "heartbeat": _heartbeat,
    "metrics": _metrics,
    "event": _event,
    "subscribe": _subscribe,
    "publish": _publish,
    "ping": _ping,
}


def parse_message(obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("message has no string 'type'")
    parser = PARSERS.get(kind)
    if parser is None:
        raise ProtocolError(f"unknown message type {kind[:40]!r}")
    return parser(obj)


def parse_frame(text: str | None, max_bytes: int) -> dict:
    """Decode and validate one text frame; ProtocolError on anything malformed."""
    if text is None:
        raise ProtocolError("binary frames are not accepted; send JSON text")
    # len(text) <= bytes <= 4 * len(text): only encode when it can matter.
    if len(text) > max_bytes or (
        4 * len(text) > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes
    ):
        raise ProtocolError(f"frame larger than {max_bytes} bytes")
    return parse_message(loads(text))
