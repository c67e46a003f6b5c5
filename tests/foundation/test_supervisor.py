"""The demo's process supervisor: prefixed output, chaos kill + restart, clean stop of whole groups."""

from __future__ import annotations

import io
import os
import sys
import threading
import time

from apps.inventory.management.commands.demo import Command, Supervisor

# A child that prints, starts a grandchild (like a prefork pool) and runs until stopped.
CHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('hello from', sys.argv[1], 'grandchild', g.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for its parent to reap it counts as dead
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def dies(pid: int, timeout: float = 10) -> bool:
    """True once `pid` is gone (a SIGKILLed process may take a moment on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def wait_line(out: io.StringIO, needle: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in out.getvalue().splitlines():
            if needle in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in output:\n{out.getvalue()}")


def grandchild(out: io.StringIO, name: str, nth: int = 1) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [ln for ln in out.getvalue().splitlines() if ln.startswith(f"{name:<12}| hello from")]
        if len(lines) >= nth:
            return int(lines[nth - 1].split()[-1])
        time.sleep(0.05)
    raise AssertionError(out.getvalue())


def test_prefixed_output_chaos_and_clean_stop():
    out = io.StringIO()
    sup = Supervisor(out)
    env = dict(os.environ)
    a = sup.add("pool-a", [sys.executable, "-c", CHILD, "a"], env)
    b = sup.add("pool-b", [sys.executable, "-c", CHILD, "b"], env)
    try:
        sup.start(a)
        sup.start(b)
        ga, gb = grandchild(out, "pool-a"), grandchild(out, "pool-b")
        assert alive(ga) and alive(gb)

        # --chaos: kill b's whole group after a moment, start it again later.
        stop = threading.Event()
        opts = {"chaos": True, "chaos_pool": "pool-b", "chaos_after": 0.2, "chaos_restart": 0.5, "run_for": 0}
        cmd = Command()
        result = {}
        t = threading.Thread(target=lambda: result.update(code=cmd._watch(sup, stop, opts)))
        t.start()
        wait_line(out, "chaos       | starting worker pool-b again")
        gb2 = grandchild(out, "pool-b", nth=2)
        assert dies(gb) and alive(gb2) and alive(ga)  # the old group is gone, a is untouched
        assert sup.crashed() is None
        stop.set()
        t.join(10)
        assert result["code"] == 0
    finally:
        sup.stop_all(grace_s=2)
    for pid in (ga, gb2, a.popen.pid, b.popen.pid):
        assert dies(pid), pid


def test_an_unexpected_exit_stops_the_demo():
    out = io.StringIO()
    sup = Supervisor(out)
    ok = sup.add("ok", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ))
    bad = sup.add("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], dict(os.environ))
    try:
        sup.start(ok)
        sup.start(bad)
        code = Command()._watch(sup, threading.Event(), {"chaos": False, "run_for": 0})
    finally:
        sup.stop_all(grace_s=1)
    assert code == 1
    assert "bad         | boom" in out.getvalue()
    assert "bad         | exited with code 3; stopping the demo" in out.getvalue()
    assert dies(ok.popen.pid)


def test_say_prefix():
    plain, tty = io.StringIO(), io.StringIO()
    Supervisor(plain).say("web", "listening\n", "36")
    Supervisor(tty, colour=True).say("web", "listening\n", "36")
    assert plain.getvalue() == "web         | listening\n"
    assert tty.getvalue() == "\x1b[36mweb         |\x1b[0m listening\n"


def test_stop_clears_the_group_of_a_child_that_already_died():
    """A worker whose main process died before the stop (a crash) leaves its pool children in
    its process group; stopping the demo must not leave them running."""
    out = io.StringIO()
    sup = Supervisor(out)
    a = sup.add("pool-a", [sys.executable, "-c", CHILD, "a"], dict(os.environ))
    sup.start(a)
    ga = grandchild(out, "pool-a")
    os.kill(a.popen.pid, 9)  # only the main process: its grandchild lives on in the group
    a.popen.wait(10)
    assert alive(ga)
    sup.stop_all(grace_s=1)
    assert dies(ga), ga
