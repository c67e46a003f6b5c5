"""Node self-registration: a Celery worker started for a pool registers itself as a Node.

Start a pool worker with the pool's slug in the environment and its queue on the command
line:

    DILOCO_POOL=iad-h100 DILOCO_POOL_TOKEN=pt_... \\
        celery -A diloco_platform worker -Q pool.iad-h100 -n iad-h100@%h --prefetch-multiplier 1

When the worker is ready it creates or updates its Node (hostname, worker name, devices
detected, agent version, pid), then a daemon thread refreshes `last_seen` every
HEARTBEAT_INTERVAL_S. On a clean shutdown the Node is marked offline; a killed worker
simply stops heartbeating and the runtime's watchdog marks it lost.

Workers without DILOCO_POOL (the coordinator worker, beat) are left alone. A worker whose
DILOCO_POOL names an unknown pool, whose token does not belong to the pool, or that does
not consume the pool's queue is refused registration (and says why in its log).

The handlers are connected when the inventory app is ready (apps.InventoryConfig.ready).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import threading
from importlib import metadata
from typing import Any

from celery import signals
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

logger = logging.getLogger("diloco.node")

try:
    AGENT_VERSION = f"diloco-agent/{metadata.version('diloco-platform')}"
except metadata.PackageNotFoundError:  # running from a plain checkout
    AGENT_VERSION = "diloco-agent/0.1.0"


def detect_devices() -> list[dict[str, Any]]:
    """The accelerators this host has: NVIDIA GPUs through nvidia-smi, else the CPU.

    nvidia-smi (not torch.cuda) so that the worker's parent process never initialises
    CUDA before it forks its pool processes.
    """
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("nvidia-smi failed (%s); reporting the CPU only", exc)
        else:
            gpus = []
            for line in out.strip().splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) < 4:
                    continue
                index, name, mem_mib, uuid = parts[:4]
                try:
                    mem_gib = round(float(mem_mib) / 1024, 1)
                except ValueError:
                    mem_gib = None
                gpus.append(
                    {
                        "kind": "cuda",
                        "index": int(index) if index.isdigit() else index,
                        "name": name,
                        "memory_gib": mem_gib,
                        "uuid": uuid,
                    }
                )
            if gpus:
                return gpus
    import platform

    return [
        {
            "kind": "cpu",
            "name": platform.processor() or platform.machine() or "cpu",
            "cores": os.cpu_count() or 1,
        }
    ]


def pool_slug() -> str:
    return os.environ.get("DILOCO_POOL", "").strip()


def node_address() -> str | None:
    """Where this node's peers reach it: DILOCO_NODE_ADDRESS, else the local address of a route
    to the broker's host (a UDP connect sends nothing), else None. Rank 0 of a learner island over
    several nodes hosts its rendezvous there."""
    explicit = os.environ.get("DILOCO_NODE_ADDRESS", "").strip()
    if explicit:
        try:  # an IP address, or a name resolved once here
            return socket.getaddrinfo(explicit, None, type=socket.SOCK_STREAM)[0][4][0]
        except OSError:
            logger.error("DILOCO_NODE_ADDRESS=%s does not resolve; registering no address", explicit)
            return None
    from urllib.parse import urlsplit

    host = urlsplit(str(getattr(settings, "CELERY_BROKER_URL", "") or "")).hostname or ""
    if not host or host == "localhost":
        return "127.0.0.1" if host else None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


class NodeAgent:
    """Registers one worker as a Node and keeps its heartbeat going."""

    def __init__(
        self,
        worker_name: str,
        queues: list[str],
        slug: str,
        token: str | None = None,
        interval_s: float | None = None,
        slots: int = 1,
    ):
        self.worker_name = worker_name
        self.slots = max(1, int(slots))  # worker processes: the learner slots of a CPU node
        self.queues = queues
        self.slug = slug
        self.token = token
        self.interval_s = interval_s if interval_s is not None else settings.HEARTBEAT_INTERVAL_S
        self.node_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self) -> int | None:
        """Create/update the Node; return its id, or None when refused (logged)."""
        from .credentials import pool_token_valid  # a pool's own role cannot read the tokens
        from .models import Node, Pool

        queue = f"pool.{self.slug}"
        if queue not in self.queues:
            logger.error(
                "DILOCO_POOL=%s but this worker does not consume %s (it consumes %s): "
                "not registering; start it with -Q %s",
                self.slug,
                queue,
                ", ".join(self.queues),
                queue,
            )
            return None
        pool = Pool.objects.filter(slug=self.slug).first()
        if pool is None:
            logger.error("DILOCO_POOL=%s: no such pool in the inventory; not registering", self.slug)
            return None
        if self.token is not None and not pool_token_valid(self.token, self.slug):
            logger.error("DILOCO_POOL_TOKEN is not a valid token of pool %s; not registering", self.slug)
            return None
        if pool.state != Pool.State.ACTIVE:
            logger.warning("pool %s is %s: registering, but it gets no new work", self.slug, pool.state)
        devices = detect_devices()
        now = timezone.now()
        node, created = Node.objects.update_or_create(
            worker_name=self.worker_name,
            defaults={
                "pool": pool,
                "hostname": socket.gethostname(),
                "devices": devices,
                "device_count": sum(1 for d in devices if d["kind"] != "cpu") or self.slots,
                "agent_version": AGENT_VERSION,
                "pid": os.getpid(),
                "address": node_address(),
                "state": Node.State.ONLINE,
                "registered_at": now,
                "last_seen": now,
            },
        )
        self.node_id = node.pk
        logger.info(
            "%s node %s in pool %s (%s)",
            "registered" if created else "re-registered",
            self.worker_name,
            self.slug,
            ", ".join(str(d.get("name")) for d in devices),
        )
        return node.pk

    def beat(self) -> None:
        """One heartbeat: refresh last_seen; a node the watchdog marked lost comes back online.

        A node an operator drained or took offline stays so (until its worker restarts).
        """
        from .models import Node

        n = Node.objects.filter(pk=self.node_id).update(last_seen=timezone.now())
        if n == 0:  # deleted by an operator: register again
            self.register()
            return
        Node.objects.filter(pk=self.node_id, state=Node.State.LOST).update(state=Node.State.ONLINE)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    close_old_connections()
                    self.beat()
                except Exception:  # a database hiccup must not kill the heartbeat
                    logger.exception("heartbeat of %s failed", self.worker_name)
                    connection.close()
        finally:
            connection.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"heartbeat:{self.worker_name}", daemon=True)
        self._thread.start()

    def stop(self, mark_offline: bool = True) -> None:
        from .models import Node

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(2.0, self.interval_s * 2))
        if mark_offline and self.node_id is not None:
            close_old_connections()
            Node.objects.filter(pk=self.node_id).update(state=Node.State.OFFLINE, last_seen=timezone.now())
            logger.info("node %s offline", self.worker_name)


_agent: NodeAgent | None = None


def current_agent() -> NodeAgent | None:
    return _agent


def node_for_worker(hostname: str | None):
    """The Node of the worker that runs a task (`task.request.hostname`), or None."""
    from .models import Node

    if not hostname:
        return None
    return Node.objects.select_related("pool").filter(worker_name=hostname).first()


def worker_slots(worker) -> int:
    """Tasks a Celery worker runs at once: 1 for the solo pool, else its concurrency. `worker` is the
    WorkController, or the Consumer that worker_ready sends (which holds it as `controller`)."""
    worker = getattr(worker, "controller", None) or worker
    pool_cls = getattr(worker, "pool_cls", None)
    if pool_cls is not None and getattr(pool_cls, "__module__", "").endswith(".solo"):
        return 1
    try:
        return max(1, int(getattr(worker, "concurrency", 1) or 1))
    except (TypeError, ValueError):
        return 1


@signals.worker_ready.connect(dispatch_uid="diloco.inventory.worker_ready")
def on_worker_ready(sender=None, **kwargs) -> None:
    global _agent
    slug = pool_slug()
    if not slug:
        return
    try:
        queues = sorted(sender.app.amqp.queues.consume_from)
    except AttributeError:
        queues = [q.name for q in getattr(sender.task_consumer, "queues", [])]
    agent = NodeAgent(
        sender.hostname,
        queues,
        slug,
        token=os.environ.get("DILOCO_POOL_TOKEN") or None,
        slots=worker_slots(sender),
    )
    try:
        if agent.register() is None:
            return
    finally:
        connection.close()  # the heartbeat thread opens its own
    agent.start()
    _agent = agent


@signals.celeryd_after_setup.connect(dispatch_uid="diloco.inventory.node_queue")
def on_worker_setup(sender=None, instance=None, **kwargs) -> None:
    """A pool worker also consumes its own node's queue (`pool.<slug>.node.<worker name>`), where
    the ranks of learner islands over several nodes are sent (the start command stays the same)."""
    slug = pool_slug()
    if not slug or instance is None:
        return
    from kombu import Exchange, Queue

    from diloco_platform.celery import node_queue

    name = node_queue(slug, sender)  # its own exchange, as -Q queues: not bound on the default one
    instance.app.amqp.queues.select_add(Queue(name, Exchange(name), name))


@signals.celeryd_after_setup.connect(dispatch_uid="diloco.inventory.no_declare")
def on_pool_worker_setup(sender=None, instance=None, **kwargs) -> None:
    """A pool worker sends to the coordinator queue (reconcile_job) without declaring it: its broker
    user may not rewrite the coordinator's bindings (apps.inventory.credentials); the coordinator's
    own workers declare that queue. Not consumed here: only how sends resolve it."""
    if not pool_slug() or instance is None:
        return
    from kombu import Exchange, Queue

    queues = instance.app.amqp.queues
    name = instance.app.conf.task_default_queue
    queues[name] = Queue(name, Exchange(name), name, no_declare=True)


@signals.worker_shutdown.connect(dispatch_uid="diloco.inventory.worker_shutdown")
def on_worker_shutdown(sender=None, **kwargs) -> None:
    global _agent
    if _agent is None:
        return
    try:
        _agent.stop(mark_offline=True)
    except Exception:
        logger.exception("could not mark node %s offline", _agent.worker_name)
    finally:
        _agent = None
