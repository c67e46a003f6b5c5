"""Publishing to dashboards and agents through the channel layer.

Sync helpers for ordinary Django code (views, services, Celery tasks), async twins for
consumers. They never raise: a telemetry hiccup must not break the caller; they return False
and log instead.

Which processes can reach browsers: with the in-memory channel layer (embedded default, no
REDIS_URL) only the web process that holds the browser sockets can; workers and the
coordinator must report over the agent socket (`apps.telemetry.client.TelemetryClient`),
and the web server fans out. With channels-redis (REDIS_URL set) any process can publish.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

FLEET_GROUP = "fleet"


def job_group(job_id: int) -> str:
    return f"job.{int(job_id)}"


def agent_group(job_id: int, learner_index: int) -> str:
    return f"agent.job.{int(job_id)}.learner.{int(learner_index)}"


def token_group(key_hash: str) -> str:
    """Every agent socket opened with one pool token (`PoolToken.key_hash`, hex sha256)."""
    return f"agent.token.{key_hash[:64]}"


def user_group(user_pk: int) -> str:
    """Every dashboard socket of one user."""
    return f"user.{int(user_pk)}"


def unix(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


# -- async ---------------------------------------------------------------------------------------

async def agroup_send(group: str, event: dict) -> bool:
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        await layer.group_send(group, event)
        return True
    except Exception:
        log.warning("channel layer send to %s failed", group, exc_info=True)
        return False


async def apublish_job(job_id: int, msg: dict) -> bool:
    return await agroup_send(job_group(job_id), {"type": "telemetry.forward", "message": msg})


async def apublish_fleet(msg: dict) -> bool:
    return await agroup_send(FLEET_GROUP, {"type": "telemetry.forward", "message": msg})


def control_message(job_id: int, learner_index: int, payload: dict) -> dict:
    msg: dict[str, Any] = {"type": "control", **payload}
    msg["type"] = "control"
    msg["job"] = int(job_id)
    msg["learner"] = int(learner_index)
    return msg


async def asend_control(job_id: int, learner_index: int, payload: dict) -> bool:
    msg = control_message(job_id, learner_index, payload)
    return await agroup_send(agent_group(job_id, learner_index), {"type": "agent.control", "message": msg})


# -- sync ----------------------------------------------------------------------------------------

_background: set[asyncio.Task] = set()


async def _await(coro) -> bool:
    return await coro


def _run(coro) -> bool:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        # Called from inside an event loop thread (async_to_sync would refuse): fire and forget,
        # keeping a reference until done (the loop only holds weak ones).
        task = loop.create_task(coro)
        _background.add(task)
        task.add_done_callback(_background.discard)
        return True
    try:
        return async_to_sync(_await)(coro)
    except Exception:
        log.warning("telemetry publish failed", exc_info=True)
        return False


def publish_job(job_id: int, msg: dict) -> bool:
    """Send `msg` (a dict with a "type") to every browser watching job `job_id`."""
    return _run(apublish_job(job_id, msg))


def publish_fleet(msg: dict) -> bool:
    """Send `msg` to every browser on the fleet page."""
    return _run(apublish_fleet(msg))


async def aclose_token_sockets(key_hashes) -> bool:
    ok = True
    for h in key_hashes:
        ok = await agroup_send(token_group(h), {"type": "agent.revoked"}) and ok
    return ok


async def acheck_user_access(user_pks) -> bool:
    ok = True
    for pk in user_pks:
        ok = await agroup_send(user_group(pk), {"type": "access.check"}) and ok
    return ok


def close_token_sockets(key_hashes) -> bool:
    """Close the agent sockets of revoked pool tokens (by `PoolToken.key_hash`), at once.
    Call it after the revocation is committed (sockets also find out by themselves within
    `TELEMETRY_TOKEN_CHECK_S`)."""
    hashes = [h for h in key_hashes if h]
    return _run(aclose_token_sockets(hashes)) if hashes else True


def check_user_access(user_pks) -> bool:
    """Ask the dashboard sockets of these users to check their access again now (logout,
    team change, deactivation)."""
    pks = sorted({int(pk) for pk in user_pks if pk is not None})
    return _run(acheck_user_access(pks)) if pks else True


def send_control(job_id: int, learner_index: int, payload: dict) -> bool:
    """Deliver a control message (e.g. {"action": "resize", "work_size": 12}) to the agent
    connection(s) serving that learner; it arrives as {"type": "control", "job", "learner", ...}."""
    return _run(asend_control(job_id, learner_index, payload))


# -- row -> message helpers (shared by the writer and other apps) ---------------------------------

LEARNER_FIELDS = (
    "id", "job_id", "index", "incarnation", "state", "pool_id", "pool__slug", "node_id",
    "node__worker_name", "work_size", "wire_dtype", "tokens", "tokens_contributed", "inner_steps",
    "tokens_per_s", "loss", "staleness", "rejected_contributions", "last_heartbeat",
)


def learner_message(row: dict, extra: dict | None = None) -> dict:
    """A `values(*LEARNER_FIELDS)` row -> {"type": "learner", ...} for dashboards."""
    msg = {
        "type": "learner",
        "id": row["id"],
        "job": row["job_id"],
        "index": row["index"],
        "incarnation": row["incarnation"],
        "state": row["state"],
        "pool": row.get("pool__slug"),
        "node": row.get("node__worker_name"),
        "work_size": row["work_size"],
        "wire_dtype": row["wire_dtype"],
        "tokens": row["tokens"],
        "tokens_contributed": row["tokens_contributed"],
        "inner_steps": row["inner_steps"],
        "tokens_per_s": row["tokens_per_s"],
        "loss": row["loss"],
        "staleness": row["staleness"],
        "rejected_contributions": row["rejected_contributions"],
        "last_heartbeat": unix(row["last_heartbeat"]),
    }
    if extra:
        msg.update(extra)
    return msg


JOB_FIELDS = (
    "id", "status", "status_reason", "outer_steps", "tokens_computed", "tokens_contributed",
    "tokens_lost", "bytes_sent", "initial_val_loss", "final_val_loss", "energy_j", "cost",
    "started_at", "finished_at",
)


def job_message(row: dict) -> dict:
    msg = {"type": "job", **{k: row[k] for k in JOB_FIELDS if k not in ("started_at", "finished_at")}}
    msg["started_at"] = unix(row["started_at"])
    msg["finished_at"] = unix(row["finished_at"])
    return msg


NODE_FIELDS = ("id", "worker_name", "hostname", "pool__slug", "state", "last_seen", "measured_tokens_per_s")


def node_message(row: dict) -> dict:
    return {
        "type": "node",
        "id": row["id"],
        "worker": row["worker_name"],
        "hostname": row["hostname"],
        "pool": row["pool__slug"],
        "state": row["state"],
        "last_seen": unix(row["last_seen"]),
        "measured_tokens_per_s": row["measured_tokens_per_s"],
    }
