"""Network namespaces, veth links, bridges and `tc tbf` shaping: the wires of the sites harness.

Every address lives inside namespaces this module made; nothing is routed to the host and no
namespace has a default route, so no packet leaves them. The host reaches a namespace only by
a thread entering it (`entered`): sockets opened there stay there after the thread leaves.

Interfaces are created directly inside their namespaces (`ip link add ... netns A peer ...
netns B`), so two harnesses running at once never collide on names in the host namespace.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


class NetnsError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip args...`; a failure raises with ip's own message."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if check and out.returncode:
        raise NetnsError(f"tc {' '.join(args)} in {ns}: {out.stderr.strip()}")
    return out


def available() -> str | None:
    """None when namespaces, veth and tbf can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"{tool} (iproute2) is not installed"
    probe = f"dlprobe{os.getpid()}"
    try:
        add(probe)
        ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        tc(probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit", "burst", "32kb",
           "latency", "50ms")
    except NetnsError as exc:
        return f"cannot make a namespace with a shaped veth: {exc}"
    finally:
        delete(probe)
    return None


def add(name: str) -> None:
    ip("netns", "add", name)
    ip("-n", name, "link", "set", "lo", "up")


def delete(name: str) -> None:
    ip("netns", "delete", name, check=False)


def names(prefix: str = "") -> list[str]:
    if not NETNS_DIR.exists():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def bridge(ns: str, name: str = "br0") -> None:
    ip("-n", ns, "link", "add", name, "type", "bridge")
    ip("-n", ns, "link", "set", name, "up")


def veth(ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
    """A cable between two namespaces, both ends up."""
    ip("link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
    ip("-n", ns_a, "link", "set", if_a, "up")
    ip("-n", ns_b, "link", "set", if_b, "up")


def attach(ns: str, iface: str, bridge_name: str = "br0") -> None:
    ip("-n", ns, "link", "set", iface, "master", bridge_name)


def address(ns: str, iface: str, cidr: str) -> None:
    ip("-n", ns, "addr", "add", cidr, "dev", iface)


def set_up(ns: str, iface: str, up: bool) -> None:
    """Take a link down (a partition: frames are dropped, TCP waits) or bring it back."""
    ip("-n", ns, "link", "set", iface, "up" if up else "down")


def shape(ns: str, iface: str, mbit: float | None) -> None:
    """Egress of `iface` at `mbit` Mbit/s through a token bucket (None: unshaped).

    The bucket holds 10 ms of traffic (at least 32 KiB): enough for a timer of 100-1000 Hz to
    reach the rate, small enough that bursts do not hide it.
    """
    if mbit is None:
        tc(ns, "qdisc", "del", "dev", iface, "root", check=False)
        return
    burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.01))
    tc(ns, "qdisc", "replace", "dev", iface, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
       "latency", "200ms")


def counters(ns: str, iface: str) -> dict[str, int]:
    """The interface's own byte and packet counters (what crossed the wire, headers included)."""
    out = ip("-n", ns, "-s", "-j", "link", "show", "dev", iface)
    stats = json.loads(out.stdout)[0]["stats64"]
    return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
            "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the body with this thread in namespace `ns` (network namespaces are per thread).

    Sockets opened inside keep living in `ns` after the thread returns to its own namespace,
    so the host can hold a database connection or an HTTP client into a site.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)
