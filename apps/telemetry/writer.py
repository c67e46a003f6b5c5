"""The batching writer: agent messages -> database rows, a few statements per flush.

The agent consumer validates and authorizes a message, then hands it here; nothing is written
per message. Every `TELEMETRY_FLUSH_INTERVAL_S` (or as soon as `TELEMETRY_FLUSH_MAX_ITEMS`
items wait) one flush, in one transaction:

- heartbeats, coalesced to the newest per learner, become one `bulk_update` of Learner rows,
  fenced by incarnation (a zombie of an old incarnation never overwrites the new one) and
  never moving a learner's token count backwards (replays after an outage);
- nodes seen on the agent sockets get `last_seen` and `measured_tokens_per_s` (mean tokens/s of
  the learners they reported in the window, i.e. per device slot) in one `bulk_update`;
- metric points and events become `bulk_create`s.

After the commit the flush fans out to dashboards: `metrics`, `learner`, `event` and `job`
messages to `job.<id>`, `node` messages (and job-less events) to `fleet`.

One writer per event loop (daphne runs one loop per process).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction

from . import publish

log = logging.getLogger(__name__)

METRICS_CHUNK = 500


def _setting(name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def _dt(t: float | None, fallback: datetime) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC) if t is not None else fallback


class TelemetryWriter:
    def __init__(self, interval: float | None = None, max_items: int | None = None,
                 max_buffer: int | None = None):
        self.interval = float(interval if interval is not None
                              else _setting("TELEMETRY_FLUSH_INTERVAL_S", 0.5))
        self.max_items = int(max_items if max_items is not None
                             else _setting("TELEMETRY_FLUSH_MAX_ITEMS", 1000))
        self.max_buffer = int(max_buffer if max_buffer is not None
                              else _setting("TELEMETRY_MAX_BUFFER", 100_000))
        self._heartbeats: dict[int, dict] = {}
        self._nodes: dict[int, dict] = {}
        self._points: list[dict] = []
        self._events: list[dict] = []
        self._items = 0
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._lock = asyncio.Lock()
        self.stats: dict[str, int] = defaultdict(int)

    # -- intake (called from consumers, in the loop) ----------------------------------------

    def add_heartbeat(self, learner_pk: int, job_id: int, index: int, hb: dict, received: datetime) -> None:
        self._heartbeats[learner_pk] = {**hb, "job": job_id, "learner": index, "received": received}
        self._added(1)

    def touch_node(self, node_pk: int, received: datetime, learner_pk: int | None = None,
                   tokens_per_s: float | None = None) -> None:
        n = self._nodes.setdefault(node_pk, {"last_seen": received, "tps": {}})
        n["last_seen"] = max(n["last_seen"], received)
        if learner_pk is not None and tokens_per_s is not None:
            n["tps"][learner_pk] = tokens_per_s

    def add_points(self, points: list[dict]) -> None:
        self._points.extend(points)
        overflow = len(self._points) - self.max_buffer
        if overflow > 0:  # the database is not keeping up: keep the newest
            del self._points[:overflow]
            self.stats["points_dropped"] += overflow
        self._added(len(points))

    def add_event(self, event: dict) -> None:
        self._events.append(event)
        overflow = len(self._events) - self.max_buffer
        if overflow > 0:
            del self._events[:overflow]
            self.stats["events_dropped"] += overflow
        self._added(1)

    def _added(self, n: int) -> None:
        self._items += n
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        if self._items >= self.max_items:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._heartbeats) + len(self._nodes) + len(self._points) + len(self._events)

    # -- flushing ------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval)
            self._wake.clear()
            if not self.pending:
                return  # idle: the next add starts a new task
            await self.flush()

    async def flush(self) -> int:
        """Write everything buffered now, then fan out; returns the number of items written."""
        async with self._lock:
            hb, nodes, points, events = self._heartbeats, self._nodes, self._points, self._events
            if not (hb or nodes or points or events):
                return 0
            self._heartbeats, self._nodes, self._points, self._events = {}, {}, [], []
            self._items = 0
            t0 = time.perf_counter()
            try:
                out = await database_sync_to_async(_write)(hb, nodes, points, events)
            except Exception as exc:
                self.stats["flush_errors"] += 1
                if not isinstance(exc, OperationalError | InterfaceError):
                    # Bad data, not an outage: retrying would fail forever and block the rest.
                    log.exception("telemetry flush failed; dropping %d heartbeats, %d points, %d events",
                                  len(hb), len(points), len(events))
                    self.stats["batches_dropped"] += 1
                    return 0
                log.warning("telemetry flush failed (%s); keeping %d points, %d events for the next one",
                            exc, len(points), len(events))
                # Heartbeats/nodes: newer values that arrived meanwhile win.
                for k, v in hb.items():
                    self._heartbeats.setdefault(k, v)
                for k, v in nodes.items():
                    self._nodes.setdefault(k, v)
                self._points[:0] = points[-self.max_buffer:]
                self._events[:0] = events[-self.max_buffer:]
                return 0
            self.stats["flushes"] += 1
            self.stats["learners_updated"] += out["learners_updated"]
            self.stats["heartbeats_fenced"] += out["fenced"]
            self.stats["heartbeats_stale"] += out["stale"]
            self.stats["points_written"] += out["points"]
            self.stats["events_written"] += out["events"]
            self.stats["flush_ms_total"] += int((time.perf_counter() - t0) * 1000)
        for group, msg in out["messages"]:
            await publish.agroup_send(group, {"type": "telemetry.forward", "message": msg})
        return len(hb) + len(points) + len(events)

    async def stop(self) -> None:
        """Flush what is left and stop the background task (tests, shutdown).

        The task is woken and awaited, not cancelled: cancelling a flush between its commit and
        its fan-out would lose the dashboard messages of rows already written.
        """
        task, self._task = self._task, None
        if task is not None and not task.done():
            self._stopping = True
            self._wake.set()
            try:
                with contextlib.suppress(Exception):
                    await task
            finally:
                self._stopping = False
        await self.flush()


def _write(hb: dict[int, dict], nodes: dict[int, dict], points: list[dict], events: list[dict]) -> dict:
    """One flush, in a worker thread: returns the rows written and the messages to fan out."""
    with transaction.atomic():
        updated, fenced, stale = _write_heartbeats(hb)
        _write_nodes(nodes)
        points, events = _alive(points, events)
        created_events = _write_rows(points, events)
    messages = _fanout(hb, nodes, points, updated, created_events)
    return {"learners_updated": len(updated), "fenced": fenced, "stale": stale, "points": len(points),
            "events": len(events), "messages": messages}


def _write_heartbeats(hb: dict[int, dict]) -> tuple[list[int], int, int]:
    """Learner rows from the newest heartbeats: (learners updated, fenced, stale)."""
    from apps.jobs.models import Learner

    if not hb:
        return [], 0, 0
    fenced = stale = 0
    current = {
        pk: (inc, tokens)
        for pk, inc, tokens in Learner.objects.select_for_update()
        .filter(pk__in=sorted(hb))
        .order_by("pk")
        .values_list("pk", "incarnation", "tokens")
    }
    objs = []
    for pk in sorted(hb):
        h = hb[pk]
        inc, tokens = current.get(pk, (None, 0))
        if inc != h["incarnation"]:
            fenced += 1
            continue
        if h["tokens"] < tokens:
            # Older than what the learner already wrote (e.g. replayed from a client
            # buffer after an outage): never move a learner backwards.
            stale += 1
            continue
        objs.append(Learner(
            pk=pk, tokens=h["tokens"], inner_steps=h["step"], tokens_per_s=h["tokens_per_s"],
            loss=h["loss"], staleness=h["staleness"], last_heartbeat=h["received"],
        ))
    if objs:
        Learner.objects.bulk_update(
            objs, ["tokens", "inner_steps", "tokens_per_s", "loss", "staleness", "last_heartbeat"]
        )
    return [o.pk for o in objs], fenced, stale


def _write_nodes(nodes: dict[int, dict]) -> None:
    """Nodes seen on the agent sockets: last_seen, and measured tokens/s when reported."""
    from apps.inventory.models import Node

    if not nodes:
        return
    objs = []
    for pk in sorted(nodes):
        n = nodes[pk]
        tps = list(n["tps"].values())
        objs.append(Node(pk=pk, last_seen=n["last_seen"],
                         measured_tokens_per_s=sum(tps) / len(tps) if tps else None))
    with_tps = [o for o in objs if o.measured_tokens_per_s is not None]
    without = [o for o in objs if o.measured_tokens_per_s is None]
    if with_tps:
        Node.objects.bulk_update(with_tps, ["last_seen", "measured_tokens_per_s"])
    if without:
        Node.objects.bulk_update(without, ["last_seen"])


def _alive(points: list[dict], events: list[dict]) -> tuple[list[dict], list[dict]]:
    """Leave out rows of jobs/learners deleted since the message was accepted (they would fail
    the batch); events keep their job but lose a pool deleted meanwhile."""
    from apps.inventory.models import Pool
    from apps.jobs.models import Job, Learner

    if not (points or events):
        return points, events
    jobs_alive = set(Job.objects.filter(
        pk__in={p["job"] for p in points} | {e["job"] for e in events if e["job"]}
    ).values_list("pk", flat=True))
    learners_alive = set(Learner.objects.filter(
        pk__in={p["learner_pk"] for p in points if p["learner_pk"]}
    ).values_list("pk", flat=True))
    points = [p for p in points if p["job"] in jobs_alive
              and (p["learner_pk"] is None or p["learner_pk"] in learners_alive)]
    pools_alive = set(Pool.objects.filter(
        pk__in={e["pool_id"] for e in events if e["pool_id"]}
    ).values_list("pk", flat=True)) if events else set()
    events = [{**e, "pool_id": e["pool_id"] if e["pool_id"] in pools_alive else None}
              for e in events if e["job"] is None or e["job"] in jobs_alive]
    return points, events


def _write_rows(points: list[dict], events: list[dict]) -> list:
    """Metric points and events as bulk inserts; returns the events created."""
    from apps.jobs.models import Event, MetricPoint

    if points:
        MetricPoint.objects.bulk_create(
            [MetricPoint(job_id=p["job"], learner_id=p["learner_pk"], name=p["name"], step=p["step"],
                         value=p["value"], time=p["time"]) for p in points],
            batch_size=1000,
        )
    if not events:
        return []
    return Event.objects.bulk_create(
        [Event(job_id=e["job"], pool_id=e["pool_id"], kind=e["kind"], message=e["message"],
               payload=e["payload"], time=e["time"]) for e in events],
        batch_size=500,
    )


def _fanout(hb: dict[int, dict], nodes: dict[int, dict], points: list[dict], updated: list[int],
            created_events: list) -> list[tuple[str, dict]]:
    """The dashboard messages of a flush, read after its commit: (group, message) pairs."""
    from apps.inventory.models import Node, Pool
    from apps.jobs.models import Job, Learner

    messages: list[tuple[str, dict]] = []
    jobs: set[int] = set()
    by_job: dict[int, list[dict]] = defaultdict(list)
    for p in points:
        by_job[p["job"]].append({"learner": p["learner"], "name": p["name"], "step": p["step"],
                                 "value": p["value"], "time": p["time"].timestamp()})
    for job_id, pts in by_job.items():
        jobs.add(job_id)
        for i in range(0, len(pts), METRICS_CHUNK):
            messages.append((publish.job_group(job_id),
                             {"type": "metrics", "job": job_id, "points": pts[i:i + METRICS_CHUNK]}))
    if updated:
        extra = {pk: {"util": hb[pk]["util"], "power_w": hb[pk]["power_w"]} for pk in updated}
        for row in Learner.objects.filter(pk__in=updated).values(*publish.LEARNER_FIELDS):
            jobs.add(row["job_id"])
            messages.append((publish.job_group(row["job_id"]),
                             publish.learner_message(row, extra[row["id"]])))
    pool_slugs: dict[int, str] = {}
    if any(e.pool_id for e in created_events):
        pool_slugs = dict(Pool.objects.filter(pk__in={e.pool_id for e in created_events if e.pool_id})
                          .values_list("pk", "slug"))
    for e in created_events:
        msg = {"type": "event", "id": e.pk, "job": e.job_id, "kind": e.kind, "message": e.message,
               "payload": e.payload, "pool": pool_slugs.get(e.pool_id), "time": e.time.timestamp()}
        if e.job_id:
            jobs.add(e.job_id)
            messages.append((publish.job_group(e.job_id), msg))
        else:
            messages.append((publish.FLEET_GROUP, msg))
    if jobs:
        for row in Job.objects.filter(pk__in=jobs).values(*publish.JOB_FIELDS):
            messages.append((publish.job_group(row["id"]), publish.job_message(row)))
    if nodes:
        for row in Node.objects.filter(pk__in=list(nodes)).values(*publish.NODE_FIELDS):
            messages.append((publish.FLEET_GROUP, publish.node_message(row)))
    return messages


_writers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_writer() -> TelemetryWriter:
    """The writer of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    w = _writers.get(loop)
    if w is None:
        w = _writers[loop] = TelemetryWriter()
    return w


def point(job_id: int, learner_pk: int | None, learner_index: int | None, p: dict,
          received: datetime) -> dict:
    return {"job": job_id, "learner_pk": learner_pk, "learner": learner_index, "name": p["name"],
            "step": p["step"], "value": p["value"], "time": _dt(p["time"], received)}


def event(job_id: int | None, pool_id: int | None, e: dict, received: datetime) -> dict:
    payload = dict(e["payload"])
    if e.get("learner") is not None:
        payload.setdefault("learner", e["learner"])
    return {"job": job_id, "pool_id": pool_id, "kind": e["kind"], "message": e["message"],
            "payload": payload, "time": _dt(e["time"], received)}
