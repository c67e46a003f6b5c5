"""Websocket consumers: the agent socket (workers, coordinator) and the dashboard sockets.

Close codes (agent socket): 4400 malformed frame, 4401 missing/invalid token, 4403 repeated
refused messages. Dashboard sockets: 4403 not signed in / not allowed, 4404 no such job
(staff only; others get 4403). Before closing, the server sends
`{"type": "error", "reason": ..., "code": ..., "fatal": true}` because daphne does not pass a
close reason on; the close frame carries the reason on servers that do.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import defaultdict, deque
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.utils import timezone

from . import publish
from .auth import is_coordinator_token
from .guards import access_allowed, events_gate, token_registry
from .protocol import JOB_SERIES, POOL_EVENT_KINDS, ProtocolError, clean_text, parse_frame
from .scope import LearnerPlace, cache
from .writer import event as event_row
from .writer import get_writer
from .writer import point as point_row

log = logging.getLogger(__name__)

CLOSE_MALFORMED = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_TOO_MANY = 4429

ACK_DELAY_S = 0.05
ABUSE_WINDOW_S = 60.0
NODE_RETRY_S = 5.0
REAUTH_S = 30.0
# How stale a dashboard socket's access decision may be when it forwards a message.
ACCESS_RECHECK_S = 2.0

# Process-wide counters (benchmarks, health pages, tests).
STATS: dict[str, int] = defaultdict(int)


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def dumps(msg: dict) -> str:
    """JSON for browsers and agents: never NaN/Infinity (JSON.parse rejects them)."""
    try:
        return json.dumps(msg, allow_nan=False, default=str)
    except ValueError:
        return json.dumps(_clean(msg), allow_nan=False, default=str)


class Refused(Exception):
    """A well-formed message this connection may not send (error reply, not a close)."""

    def __init__(self, reason: str, code: str = "forbidden", abuse: bool = True):
        super().__init__(reason)
        self.reason, self.code, self.abuse = reason, code, abuse


def _token_from_scope(scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            v = value.decode("latin-1").strip()
            if v.lower().startswith("bearer "):
                return v[7:].strip()
            if v.lower().startswith("token "):
                return v[6:].strip()
    qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return (qs.get("token") or [""])[0]


class BaseSocket(AsyncWebsocketConsumer):
    closing = False

    async def send_json(self, msg: dict) -> None:
        await self.send(text_data=dumps(msg))

    async def fail(self, code: int, reason: str, kind: str) -> None:
        """Tell the peer why, then close with `code`."""
        if self.closing:
            return
        self.closing = True
        try:
            await self.send_json({"type": "error", "reason": reason, "code": kind, "fatal": True})
        finally:
            await self.close(code=code, reason=reason)

    async def telemetry_forward(self, event: dict) -> None:
        if not self.closing:
            await self.send(text_data=dumps(event["message"]))


class AgentConsumer(BaseSocket):
    """`/ws/agent/`: heartbeats, metrics and events in; acks, errors and control out."""

    role: str | None = None  # "pool" | "coordinator"
    pool_id: int | None = None
    pool_slug: str | None = None

    async def connect(self) -> None:
        await self.accept()  # accept first: close codes only reach the client after a handshake
        self.max_bytes = int(getattr(settings, "WS_MAX_FRAME_BYTES", 64 * 1024))
        self.abuse_limit = int(getattr(settings, "TELEMETRY_ABUSE_LIMIT", 20))
        self.processed = 0
        self.acked = 0
        self.ack_task: asyncio.Task | None = None
        self.refusals: deque[float] = deque()
        self.subscriptions: set[tuple[int, int]] = set()
        self.worker: str | None = None
        self.node_pk: int | None = None
        self.node_lookup_at = 0.0
        # Token bucket on items (a heartbeat/event = 1, a metrics message = its points): when a
        # connection goes faster, the consumer waits (backpressure through the client's window
        # of unacknowledged frames) instead of letting one token flood the database.
        self.rate = float(getattr(settings, "TELEMETRY_MAX_ITEMS_PER_S", 5000))
        self.bucket, self.bucket_at = 2 * self.rate, time.monotonic()
        token = _token_from_scope(self.scope)
        if not token:
            STATS["auth_failures"] += 1
            await self.fail(CLOSE_UNAUTHORIZED, "missing token: send 'Authorization: Bearer <token>'",
                            "unauthorized")
            return
        if is_coordinator_token(token):
            self.role = "coordinator"
        else:
            from apps.inventory.models import PoolToken

            pool = await database_sync_to_async(PoolToken.authenticate)(token)
            if pool is None:
                STATS["auth_failures"] += 1
                await self.fail(CLOSE_UNAUTHORIZED, "invalid or revoked token", "unauthorized")
                return
            self.role, self.pool_id, self.pool_slug = "pool", pool.pk, pool.slug
            self.token, self.auth_checked = token, time.monotonic()
            # Per-token limits (sockets, bytes/s) and the close on revocation (guards.py).
            self.token_hash = PoolToken.hash(token)
            self.token_state = token_registry().join(self, self.token_hash)
            if self.token_state is None:
                STATS["socket_cap_closes"] += 1
                self.role = None
                await self.fail(CLOSE_TOO_MANY, "too many open sockets for this token", "too_many_sockets")
                return
            await self.channel_layer.group_add(publish.token_group(self.token_hash), self.channel_name)
        STATS["connections"] += 1
        await self.send_json({
            "type": "hello", "role": self.role, "pool": self.pool_slug,
            "max_frame_bytes": self.max_bytes,
            "heartbeat_interval_s": getattr(settings, "HEARTBEAT_INTERVAL_S", 1.0),
        })

    async def disconnect(self, code) -> None:
        if getattr(self, "ack_task", None) is not None:
            self.ack_task.cancel()
        layer = self.channel_layer
        if getattr(self, "token_state", None) is not None:
            token_registry().leave(self)
            self.token_state = None
            with contextlib.suppress(Exception):
                await layer.group_discard(publish.token_group(self.token_hash), self.channel_name)
        for job_id, index in getattr(self, "subscriptions", ()):
            with contextlib.suppress(Exception):
                await layer.group_discard(publish.agent_group(job_id, index), self.channel_name)

    # -- receive ----------------------------------------------------------------------------

    async def receive(self, text_data=None, bytes_data=None) -> None:
        if self.closing or self.role is None:
            return
        if self.role == "pool" and time.monotonic() - self.auth_checked > REAUTH_S:
            # A token revoked while its socket is open stops working within REAUTH_S.
            from apps.inventory.models import PoolToken

            self.auth_checked = time.monotonic()
            pool = await database_sync_to_async(PoolToken.authenticate)(self.token)
            if pool is None or pool.pk != self.pool_id:
                STATS["auth_failures"] += 1
                await self.fail(CLOSE_UNAUTHORIZED, "token revoked", "unauthorized")
                return
        try:
            msg = parse_frame(text_data, self.max_bytes)
        except ProtocolError as exc:
            STATS["malformed"] += 1
            log.info("agent %s sent a malformed frame: %s", self._who(), exc.reason)
            await self._send_ack()
            await self.fail(CLOSE_MALFORMED, exc.reason, "malformed")
            return
        await self._throttle(len(msg["points"]) if msg["type"] == "metrics" else 1)
        if self.role == "pool":
            await self._throttle_bytes(len(text_data) if text_data.isascii() else len(text_data.encode()))
        try:
            await getattr(self, "on_" + msg["type"])(msg)
        except Refused as r:
            self.processed += 1
            if await self._refused(msg, r):
                return
        except Exception:
            # Not the agent's fault (e.g. the database is away): close without acking this
            # frame, so the client sends it again after reconnecting.
            STATS["server_errors"] += 1
            log.exception("agent %s: handling a %s message failed", self._who(), msg["type"])
            await self._send_ack()
            await self.fail(1011, "server error, retry later", "server_error")
            return
        else:
            STATS["accepted"] += 1
            self.processed += 1
        self._schedule_ack()

    async def _throttle(self, items: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.bucket = min(2 * self.rate, self.bucket + (now - self.bucket_at) * self.rate)
        self.bucket_at = now
        self.bucket -= items
        if self.bucket < 0:
            STATS["throttled"] += 1
            await asyncio.sleep(-self.bucket / self.rate)

    async def _throttle_bytes(self, size: int) -> None:
        """Bytes per second over every socket of this pool token (in this process)."""
        state = self.token_state
        if state is None:
            return
        wait = state.take_bytes(size)
        if wait > 0:
            STATS["throttled_bytes"] += 1
            await asyncio.sleep(wait)

    async def _refused(self, msg: dict, r: Refused) -> bool:
        """Reply with the reason; True when the connection was closed for repeated abuse."""
        STATS["refused"] += 1
        # Forbidden messages are worth a warning (a misbehaving or hostile worker); stale
        # incarnations and finished jobs are routine after a migration or a cancel.
        log.log(logging.WARNING if r.abuse else logging.INFO, "agent %s: refused a %s message: %s",
                self._who(), msg["type"], r.reason)
        await self.send_json({"type": "error", "reason": r.reason, "code": r.code,
                              "in_reply_to": msg["type"]})
        if not r.abuse:
            return False
        now = time.monotonic()
        self.refusals.append(now)
        while self.refusals and now - self.refusals[0] > ABUSE_WINDOW_S:
            self.refusals.popleft()
        if len(self.refusals) <= self.abuse_limit:
            return False
        STATS["abuse_closes"] += 1
        log.warning("agent %s closed after %d refused messages", self._who(), len(self.refusals))
        await self._send_ack()
        await self.fail(CLOSE_FORBIDDEN, f"too many refused messages ({r.reason})", "abuse")
        return True

    def _who(self) -> str:
        return clean_text(f"{self.role}:{self.pool_slug or '-'}:{self.worker or '?'}")

    def _schedule_ack(self) -> None:
        if self.ack_task is None or self.ack_task.done():
            self.ack_task = asyncio.get_running_loop().create_task(self._ack_later())

    async def _ack_later(self) -> None:
        await asyncio.sleep(ACK_DELAY_S)
        await self._send_ack()

    async def _send_ack(self) -> None:
        if self.processed != self.acked and not self.closing:
            self.acked = self.processed
            await self.send_json({"type": "ack", "n": self.processed})

    # -- authorization ----------------------------------------------------------------------

    async def _learner(self, job_id: int, index: int, incarnation: int | None = None) -> LearnerPlace:
        js = await cache.get(job_id)
        lp = js.learners.get(index)
        stale = (not js.exists or lp is None or (self.role == "pool" and lp.pool_id != self.pool_id)
                 or (incarnation is not None and incarnation > lp.incarnation))
        if stale:  # maybe placed/moved/re-incarnated a moment ago
            js = await cache.refresh(job_id)
            lp = js.learners.get(index)
        if not js.exists:
            raise Refused(f"job {job_id} does not exist")
        if lp is None:
            raise Refused(f"job {job_id} has no learner {index}")
        if self.role == "pool" and lp.pool_id != self.pool_id:
            raise Refused(f"learner {index} of job {job_id} is not placed on pool {self.pool_slug}")
        if self.role == "pool" and js.terminal:
            raise Refused(f"job {job_id} is {js.status}", code="job_finished", abuse=False)
        if incarnation is not None and incarnation != lp.incarnation:
            code = "stale_incarnation" if incarnation < lp.incarnation else "unknown_incarnation"
            raise Refused(f"learner {index} of job {job_id} is at incarnation {lp.incarnation}, "
                          f"not {incarnation}", code=code, abuse=False)
        return lp

    async def _job(self, job_id: int | None):
        if job_id is None:
            if self.role != "coordinator":
                raise Refused("only the coordinator may send messages without a job")
            return None
        js = await cache.get(job_id)
        if not js.exists or (self.role == "pool" and not js.serves(self.pool_id)):
            js = await cache.refresh(job_id)
        if not js.exists:
            raise Refused(f"job {job_id} does not exist")
        if self.role == "pool":
            if not js.serves(self.pool_id):
                raise Refused(f"job {job_id} has no learner on pool {self.pool_slug}")
            if js.terminal:
                raise Refused(f"job {job_id} is {js.status}", code="job_finished", abuse=False)
        return js

    async def _subscribe(self, job_id: int, index: int) -> None:
        key = (job_id, index)
        if key not in self.subscriptions:
            await self.channel_layer.group_add(publish.agent_group(job_id, index), self.channel_name)
            self.subscriptions.add(key)

    async def _node(self) -> int | None:
        if self.worker and self.node_pk is None and time.monotonic() - self.node_lookup_at > NODE_RETRY_S:
            await self._lookup_node()
        return self.node_pk

    async def _lookup_node(self) -> None:
        from apps.inventory.models import Node

        self.node_lookup_at = time.monotonic()
        row = await database_sync_to_async(
            lambda: Node.objects.filter(worker_name=self.worker).values("pk", "pool_id").first()
        )()
        if row is None:
            return
        if self.role == "pool" and row["pool_id"] != self.pool_id:
            self.worker = None
            raise Refused(f"worker {row['pk']} belongs to another pool")
        self.node_pk = row["pk"]

    # -- handlers ---------------------------------------------------------------------------

    async def on_hello(self, msg: dict) -> None:
        if msg["pool"] and self.role == "pool" and msg["pool"] != self.pool_slug:
            raise Refused(f"this token belongs to pool {self.pool_slug}, not {msg['pool']}")
        if msg["worker"]:
            self.worker, self.node_pk = msg["worker"], None
            await self._lookup_node()

    async def on_ping(self, msg: dict) -> None:
        await self.send_json({"type": "pong", "time": time.time()})

    async def on_heartbeat(self, msg: dict) -> None:
        lp = await self._learner(msg["job"], msg["learner"], msg["incarnation"])
        now = timezone.now()
        writer = get_writer()
        writer.add_heartbeat(lp.pk, msg["job"], msg["learner"], msg, now)
        # The node this socket said hello from, else the one the runtime placed the learner on.
        node = await self._node() or lp.node_id
        if node is not None:
            writer.touch_node(node, now, lp.pk, msg["tokens_per_s"])
        await self._subscribe(msg["job"], msg["learner"])

    async def on_subscribe(self, msg: dict) -> None:
        await self._learner(msg["job"], msg["learner"])
        await self._subscribe(msg["job"], msg["learner"])

    async def on_metrics(self, msg: dict) -> None:
        if self.role != "coordinator" and any(p["learner"] is None for p in msg["points"]):
            # Job-level series (val_loss, goodput...) are the coordinator's: a pool that runs one
            # learner of a job must not draw into the job's own charts. The whole message is
            # refused, so nothing of it is half-written.
            raise Refused("only the coordinator may write job-level metrics (learner null)")
        if self.role != "coordinator":
            names = sorted({p["name"] for p in msg["points"]} & JOB_SERIES)
            if names:  # not even per learner: the job's figures would read them
                raise Refused(f"{', '.join(names)}: job-level series, the coordinator's only")
        js = await self._job(msg["job"])
        now = timezone.now()
        rows = []
        for p in msg["points"]:
            idx = p["learner"]
            lp = None
            if idx is not None:
                lp = js.learners.get(idx)
                if lp is None or (self.role == "pool" and lp.pool_id != self.pool_id):
                    lp = await self._learner(msg["job"], idx)
            rows.append(point_row(msg["job"], lp.pk if lp else None, idx, p, now))
        writer = get_writer()
        writer.add_points(rows)
        node = await self._node()
        if node is not None:
            writer.touch_node(node, now)

    async def on_event(self, msg: dict) -> None:
        if self.role == "pool":
            msg = await self._pool_event(msg)
        else:
            await self._job(msg["job"])
        pool_id = self.pool_id
        if msg["pool"] is not None and self.role != "pool":
            pool_id = await _pool_id(msg["pool"])
            if pool_id is None:
                raise Refused(f"no pool {msg['pool']}", abuse=False)
        get_writer().add_event(event_row(msg["job"], pool_id, msg, timezone.now()))

    async def _pool_event(self, msg: dict) -> dict:
        """What a pool may put on a job's timeline: a note (`info`), at the server's time,
        marked as the pool's, for a learner it runs, at most so many per job and minute."""
        if msg["kind"] not in POOL_EVENT_KINDS:
            raise Refused(f"event kind {msg['kind']!r} is the coordinator's; pools may send "
                          f"{', '.join(sorted(POOL_EVENT_KINDS))}")
        if msg["pool"] is not None and msg["pool"] != self.pool_slug:
            raise Refused(f"this token belongs to pool {self.pool_slug}, not {msg['pool']}")
        await self._job(msg["job"])
        if msg["learner"] is not None:
            await self._learner(msg["job"], msg["learner"])
        if not events_gate().allow(msg["job"]):
            STATS["events_capped"] += 1
            raise Refused(f"too many events for job {msg['job']} (at most {events_gate().limit} a minute "
                          "from pools)", code="rate_limited")
        text = f"pool {self.pool_slug}: {msg['message']}" if msg["message"] else f"pool {self.pool_slug}"
        # the client's clock is not trusted: the row gets the receive time (event_row's fallback)
        return {**msg, "time": None, "message": text[:300]}

    async def on_publish(self, msg: dict) -> None:
        if self.role != "coordinator":
            raise Refused("only the coordinator may publish to dashboards")
        if msg["job"] is None:
            await publish.apublish_fleet(msg["message"])
        else:
            await publish.apublish_job(msg["job"], msg["message"])

    # -- from the channel layer -------------------------------------------------------------

    async def agent_control(self, event: dict) -> None:
        if not self.closing:
            STATS["control_delivered"] += 1
            await self.send(text_data=dumps(event["message"]))

    async def agent_revoked(self, event: dict) -> None:
        """The token was revoked (group `agent.token.<hash>`, or the periodic check)."""
        if self.role == "pool" and not self.closing:
            STATS["auth_failures"] += 1
            await self.fail(CLOSE_UNAUTHORIZED, "token revoked", "unauthorized")


async def _pool_id(slug: str) -> int | None:
    from apps.inventory.models import Pool

    return await database_sync_to_async(
        lambda: Pool.objects.filter(slug=slug).values_list("pk", flat=True).first()
    )()


# -- dashboards -------------------------------------------------------------------------------

class DashboardSocket(BaseSocket):
    """A browser socket: its access is checked again while it lives, not only at connect.

    Before forwarding a message, at most every `ACCESS_RECHECK_S`, the socket re-reads its
    session (logged out, expired, password changed), its user (deactivated) and, for a job,
    whether the user may still see it (left the team, job moved to another team). Signals
    (logout, a change of the user's groups; apps.telemetry.apps) also ask the user's sockets
    to check at once through the group `user.<id>`.
    """

    job_id: int | None = None
    user_pk: int | None = None
    access_checked = 0.0

    async def watch_access(self, user) -> None:
        session = self.scope.get("session")
        self.session_key = getattr(session, "session_key", None)
        self.user_pk = user.pk
        self.access_checked = time.monotonic()
        self.user_group = publish.user_group(user.pk)
        await self.channel_layer.group_add(self.user_group, self.channel_name)

    async def disconnect(self, code) -> None:
        if getattr(self, "user_group", None):
            with contextlib.suppress(Exception):
                await self.channel_layer.group_discard(self.user_group, self.channel_name)

    async def check_access(self, force: bool = False) -> bool:
        if self.closing:
            return False
        if self.user_pk is None:
            return True
        now = time.monotonic()
        if not force and now - self.access_checked < ACCESS_RECHECK_S:
            return True
        self.access_checked = now
        try:
            ok = await database_sync_to_async(access_allowed)(self.session_key, self.user_pk, self.job_id)
        except Exception:
            # The database is away: forward nothing until a check succeeds (the next message
            # tries again), but do not close every dashboard over a blip.
            log.warning("dashboard socket: access check failed", exc_info=True)
            self.access_checked = 0.0
            return False
        if not ok and not self.closing:
            STATS["dashboard_access_closes"] += 1
            await self.fail(CLOSE_FORBIDDEN, "access ended", "forbidden")
        return ok

    async def telemetry_forward(self, event: dict) -> None:
        if await self.check_access():
            await self.send(text_data=dumps(event["message"]))

    async def access_check(self, event: dict) -> None:
        """From the group `user.<id>`: the user logged out, or their groups changed."""
        ended = event.get("logout")
        if ended and ended == getattr(self, "session_key", None) and not self.closing:
            STATS["dashboard_access_closes"] += 1
            await self.fail(CLOSE_FORBIDDEN, "signed out", "unauthorized")
            return
        await self.check_access(force=True)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        if text_data and len(text_data) < 200 and '"ping"' in text_data and await self.check_access():
            await self.send_json({"type": "pong", "time": time.time()})


class JobConsumer(DashboardSocket):
    """`/ws/jobs/<id>/`: live updates of one job for its owner, its team and staff."""

    async def connect(self) -> None:
        await self.accept()
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.fail(CLOSE_FORBIDDEN, "sign in to watch jobs", "unauthorized")
            return
        self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        snapshot = None
        if self.job_id <= 2**63 - 1:
            snapshot = await database_sync_to_async(_job_snapshot)(self.job_id, user)
        if snapshot is None:
            if user.is_staff:
                await self.fail(CLOSE_NOT_FOUND, f"no job {self.job_id}", "not_found")
            else:
                await self.fail(CLOSE_FORBIDDEN, f"job {self.job_id} is not yours", "forbidden")
            return
        await self.watch_access(user)
        self.group = publish.job_group(self.job_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        for msg in snapshot:
            await self.send_json(msg)

    async def disconnect(self, code) -> None:
        await super().disconnect(code)
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)


def _job_snapshot(job_id: int, user) -> list[dict] | None:
    from apps.jobs.access import visible_jobs
    from apps.jobs.models import Job, Learner

    qs = visible_jobs(user, Job.objects.filter(pk=job_id))
    row = qs.values(*publish.JOB_FIELDS).first()
    if row is None:
        return None
    msgs = [publish.job_message(row)]
    msgs += [publish.learner_message(r)
             for r in Learner.objects.filter(job_id=job_id).values(*publish.LEARNER_FIELDS)]
    return msgs


class FleetConsumer(DashboardSocket):
    """`/ws/fleet/`: pool and node updates for any signed-in user."""

    group = publish.FLEET_GROUP

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.accept()  # close codes only reach the client after a handshake
            await self.fail(CLOSE_FORBIDDEN, "sign in to watch the fleet", "unauthorized")
            return
        # groups first: whatever is published once the handshake is done reaches this socket
        await self.watch_access(user)
        self.joined = True
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code) -> None:
        await super().disconnect(code)
        if getattr(self, "joined", False):
            await self.channel_layer.group_discard(self.group, self.channel_name)
