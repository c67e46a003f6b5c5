"""The platform's processes, defined once: the Procfile, docker/compose.yaml, `manage.py demo`
and the test `Stack` all start these command lines (tests check the Procfile and compose).

    web          gunicorn running uvicorn workers over the whole ASGI app (HTTP and /ws/ on one
                 port); how many workers: diloco_platform.gunicorn_conf (one without Redis)
    coordinator  celery worker -Q coordinator (threads pool): short housekeeping only (placement,
                 dispatch, watchdog, rebalance, fleet ticks), never a long-running task
    syncer       celery worker -Q syncer (threads pool): one thread per syncer shard of a running
                 job; --concurrency ${SYNCER_SLOTS:-8}, the capacity placement admits jobs against
    <pool>       celery worker -Q pool.<slug>, one per pool, env DILOCO_POOL (+ DILOCO_POOL_TOKEN)
    beat         celery beat (watchdog and rebalancer ticks)

Django-free, so `python -m diloco_platform.processes` can print the Procfile without settings.
`spawn` is the one way these start as children (own session, so a kill takes the whole group).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASGI_APP = "diloco_platform.asgi:application"
GUNICORN_CONF = "python:diloco_platform.gunicorn_conf"
# Threads of the syncer worker = settings.SYNCER_SLOTS (one per syncer shard of a running job).
SYNCER_SLOTS_DEFAULT = 8
SYNCER_SLOTS = f"${{SYNCER_SLOTS:-{SYNCER_SLOTS_DEFAULT}}}"  # left to the shell (Procfile, compose)
# The pools of apps/inventory/demo_fleet.yaml and their slots: what the Procfile runs.
DEMO_POOLS: dict[str, int] = {"cpu-new": 2, "cpu-mid": 1, "cpu-old": 1}


@dataclass(frozen=True)
class ProcessSpec:
    """One process: its name, argv and the variables it adds to the inherited environment."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The Procfile form: `env K=V ... argv`, with ${VAR} tokens left for the shell."""
        words = [f"{k}={v}" for k, v in self.env.items()]
        words = (["env", *words] if words else []) + list(self.argv)
        return " ".join(w if "${" in w else shlex.quote(w) for w in words)


def _program(name: str, python: str | None) -> list[str]:
    """`name` as a bare program (Procfile, compose) or as `<python> -m name` (child processes)."""
    return [python, "-m", name] if python else [name]


def web(port: int | str = "${PORT:-8000}", *, host: str = "127.0.0.1", python: str | None = None,
        name: str = "web") -> ProcessSpec:
    """HTTP and websockets on host:port; gunicorn_conf picks the worker class and count."""
    return ProcessSpec(name, (*_program("gunicorn", python), "-c", GUNICORN_CONF,
                              "-b", f"{host}:{port}", ASGI_APP))


def _celery(python: str | None) -> list[str]:
    return [*_program("celery", python), "-A", "diloco_platform"]


def coordinator(*, name: str = "coordinator", node: str | None = None, python: str | None = None,
                extra: Sequence[str] = ()) -> ProcessSpec:
    """The coordinator queue: placement, dispatch, watchdog, rebalance (short tasks; threads).
    Syncers run on their own queue (`syncer`), so a job never holds these threads."""
    return ProcessSpec(name, (*_celery(python), "worker", "-Q", "coordinator", "-n", node or f"{name}@%h",
                              "-P", "threads", "--concurrency", "8", "--prefetch-multiplier", "1",
                              *extra, "-l", "INFO"))


def syncer(slots: int | str = SYNCER_SLOTS, *, name: str = "syncer", node: str | None = None,
           python: str | None = None, extra: Sequence[str] = ()) -> ProcessSpec:
    """The syncer queue: one long-running thread per syncer shard of a running job. `slots` must be
    settings.SYNCER_SLOTS (the Procfile and compose read the same variable), the number of
    shards the coordinator's placement admits at once; a job that does not fit waits queued."""
    return ProcessSpec(name, (*_celery(python), "worker", "-Q", "syncer", "-n", node or f"{name}@%h",
                              "-P", "threads", "--concurrency", str(slots), "--prefetch-multiplier", "1",
                              *extra, "-l", "INFO"))


def pool_worker(slug: str, slots: int, *, name: str | None = None, node: str | None = None,
                token: str | None = None, redis: bool = True, python: str | None = None,
                extra: Sequence[str] = ()) -> ProcessSpec:
    """One worker node of pool `slug`: `slots` learners at a time, one task fetched at a time."""
    env = {"DILOCO_POOL": slug, **({"DILOCO_POOL_TOKEN": token} if token else {})}
    prefetch = ["--disable-prefetch"] if redis else []  # a Redis transport option
    return ProcessSpec(name or slug, (
        *_celery(python), "worker", "-Q", f"pool.{slug}", "-n", node or f"{slug}@%h",
        "--concurrency", str(max(1, slots)), "--prefetch-multiplier", "1", *prefetch, "-O", "fair",
        *extra, "-l", "INFO"), env)


def beat(*, schedule: str | None = None, pidfile: str = "", python: str | None = None) -> ProcessSpec:
    """Periodic ticks; `pidfile=""` keeps beat from refusing to start over a stale pid file."""
    sched = ["-s", schedule] if schedule else []
    return ProcessSpec("beat", (*_celery(python), "beat", "-l", "INFO", f"--pidfile={pidfile}", *sched))


def platform(pools: Mapping[str, int] = DEMO_POOLS, *, port: int | str = "${PORT:-8000}",
             host: str = "127.0.0.1", python: str | None = None, tokens: Mapping[str, str] | None = None,
             redis: bool = True, schedule: str | None = None) -> list[ProcessSpec]:
    """The whole process set: web, coordinator, syncer, one worker per pool, beat."""
    tokens = tokens or {}
    return [
        web(port, host=host, python=python),
        coordinator(python=python),
        syncer(python=python),
        *(pool_worker(slug, slots, token=tokens.get(slug), redis=redis, python=python)
          for slug, slots in pools.items()),
        beat(schedule=schedule, python=python),
    ]


PROCFILE_HEADER = """\
# The embedded stack, one line per process (honcho start / any Procfile runner).
# Generated from diloco_platform/processes.py (python -m diloco_platform.processes > Procfile);
# `manage.py demo` and the test Stack start the same command lines.
"""


def procfile(specs: Sequence[ProcessSpec] | None = None) -> str:
    """The Procfile text for `specs` (default: the demo fleet's process set)."""
    specs = platform() if specs is None else specs
    return PROCFILE_HEADER + "".join(f"{s.name.replace('-', '_')}: {s.shell()}\n" for s in specs)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if its parent dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(spec: ProcessSpec, env: Mapping[str, str], *, stdout=None, cwd: Path | str = ROOT,
          die_with_parent: bool = False) -> subprocess.Popen:
    """Start `spec` in its own session (a group kill reaches its pool children), stdin closed,
    with `env` plus the spec's own variables; stderr joins stdout."""
    linux = sys.platform.startswith("linux")
    return subprocess.Popen(
        list(spec.argv), cwd=cwd, env={**env, **spec.env}, stdin=subprocess.DEVNULL, stdout=stdout,
        stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_die_with_parent if die_with_parent and linux else None,  # noqa: PLW1509
    )


def signal_group(popen: subprocess.Popen | None, sig: int) -> None:
    """Send `sig` to the process group of `popen` (quietly, if it is gone)."""
    if popen is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


if __name__ == "__main__":
    sys.stdout.write(procfile())
