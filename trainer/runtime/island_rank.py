"""Start and stop the follower ranks of learner islands; `python -m trainer.runtime.island_rank` is one.

The leader (rank 0: the Celery task of the learner, or the engine CLI) hosts the rendezvous:
a `torch.distributed.TCPStore` at a port the kernel picks (no race for a free port), then
starts every follower of its node as `python -m trainer.runtime.island_rank` with that port.
A follower joins the process group, builds the same engine Learner and follows its leader's
commands (trainer.island.IslandLearner.follow) until told to stop, then exits 0.

An island over several nodes (`IslandSpec.nodes` > 1: W / nodes ranks on each, rank 0's node
first) is started the same way on every node: the leader's `announce` callback hands the store's
port to whoever starts the other nodes' ranks (the platform: a task on each node's queue), and
each of those runs `start_node`, whose ranks reach the store at the leader's node address. The
TCPStore listens on every interface; gloo/nccl pick theirs from the environment
(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), which every follower inherits.

Why not torch.distributed.run (elastic)? It would make every rank a child of an agent and
restart failed ranks in place; here rank 0 must stay the process that holds the learner's
fencing, heartbeats and accounting (the task, or the CLI), and a failed rank must fail the
whole learner so that the watchdog re-places it whole. The pieces used are PyTorch's own
(TCPStore rendezvous, init_process_group); only the process start is a plain subprocess.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class IslandSpec:
    """What a follower needs to build its learner's replica."""

    config: dict                       # TrainConfig.to_dict()
    islands: list[tuple[int, list[int]]]  # (learner index, global ranks with the leader first)
    num_learners: int | None = None    # data shards of the job (None: config.learners)
    job: str = "local"
    incarnation: int = 0
    roots: list[str] | None = None     # data roots the corpus must lie in (the platform's)
    parallelism: str = "ddp"
    timeout_s: float = 120.0
    device: str = "cpu"
    nodes: int = 1                     # nodes one island spans (one island only when > 1)

    @property
    def world(self) -> int:
        return 1 + sum(len(ranks) - 1 for _, ranks in self.islands)

    @property
    def per_node(self) -> int:
        """Ranks on each node: the whole world on one node, else W / nodes."""
        return self.world // max(1, self.nodes)

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks node `node` runs (node 0: the leader's, rank 0 first)."""
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def payload(self) -> str:
        """The spec as the JSON a follower's command line carries."""
        return json.dumps({**self.__dict__, "islands": [[i, r] for i, r in self.islands]})

    @classmethod
    def from_payload(cls, text: str) -> IslandSpec:
        raw = json.loads(text)
        raw["islands"] = [(int(i), [int(r) for r in ranks]) for i, ranks in raw["islands"]]
        return cls(**raw)


@dataclass
class Followers:
    """The follower processes of the islands this process leads."""

    spec: IslandSpec
    procs: list[subprocess.Popen] = field(default_factory=list)
    store: object = None  # the rendezvous store: kept alive as long as the group

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def failed(self) -> list[int]:
        """Pids of followers that exited with an error."""
        return [p.pid for p in self.procs if p.poll() not in (None, 0)]

    def close(self, grace: float = 10.0) -> None:
        """Wait for the followers (told to stop) or, after `grace` seconds, kill them."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def kill(self) -> None:
        """A failed island: no follower outlives it."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("follower %s did not exit after SIGKILL", p.pid)


def _spawn(spec: IslandSpec, ranks: list[int], host: str, port: int, parent: bool = False) -> list:
    """Start follower ranks as fresh interpreters; the environment (GLOO_SOCKET_IFNAME too) passes
    through. `parent`: each dies with this process (a remote node's ranks outlive no task)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    payload = spec.payload()
    procs = []
    for rank in ranks:
        cmd = [sys.executable, "-m", "trainer.runtime.island_rank", "--rank", str(rank), "--host", host,
               "--port", str(port), "--spec", payload, *(["--parent", str(os.getpid())] if parent else [])]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def start(spec: IslandSpec, announce: Callable[[int], None] | None = None) -> Followers:
    """Host the rendezvous, start this node's followers, hand the port to `announce` (which starts
    the other nodes' ranks: `start_node` there), join as rank 0; returns once all have joined."""
    import torch.distributed as dist

    from trainer.island import init_rank, teardown, timeout

    teardown()  # a group an earlier task of this process failed to leave
    # the host is what clients dial; the server listens on every interface (other nodes reach it)
    store = dist.TCPStore("127.0.0.1", 0, spec.world, is_master=True, timeout=timeout(spec.timeout_s),
                          wait_for_workers=False)
    followers = Followers(spec, store=store)
    followers.procs.extend(_spawn(spec, spec.node_ranks(0)[1:], "127.0.0.1", store.port))
    try:
        if announce is not None and spec.nodes > 1:
            announce(store.port)
        init_rank(0, spec.world, store=store, device=spec.device, timeout_s=spec.timeout_s)
    except Exception:
        followers.kill()
        raise
    return followers


def start_node(spec: IslandSpec, node: int, host: str, port: int) -> Followers:
    """Start the ranks of node `node` (> 0) of an island whose leader's store is at host:port. They
    exit on their own: stopped by the leader, or failing on a collective's error or timeout (the
    leader or a peer gone, a partition), or with this process."""
    if not 0 < node < spec.nodes:
        raise ValueError(f"node {node} of an island over {spec.nodes} nodes: the leader's node starts itself")
    return Followers(spec, procs=_spawn(spec, spec.node_ranks(node), host, port, parent=True))


def _island_of(spec: IslandSpec, rank: int) -> tuple[int, int]:
    """(island, local rank: the device index on its node) of a global rank."""
    for n, (_index, ranks) in enumerate(spec.islands):
        if rank in ranks:
            local = ranks.index(rank)
            return n, (local % spec.per_node if spec.nodes > 1 else local)
    raise ValueError(f"rank {rank} is in no island")


def run_follower(spec: IslandSpec, rank: int, port: int, host: str = "127.0.0.1") -> int:
    """One follower rank: join, build the replica, follow; the steps it made."""
    import torch

    from trainer.config import TrainConfig
    from trainer.data import Corpus
    from trainer.island import init_rank, island_device, make_groups, teardown
    from trainer.island_kind import follower

    n, local = _island_of(spec, rank)
    index, ranks = spec.islands[n]
    config = TrainConfig.from_dict(spec.config)
    config = config.replace(device=island_device(config.device, local))
    if config.threads:
        torch.set_num_threads(config.threads)
    init_rank(rank, spec.world, port=port, host=host, device=config.device, timeout_s=spec.timeout_s)
    try:
        groups = make_groups([r for _, r in spec.islands])
        corpus = Corpus.load(config.dataset, cache_dir=config.cache_dir, tokenizer=config.tokenizer,
                             val_fraction=config.val_fraction, roots=spec.roots)
        learner = follower(config, index, ranks, groups[n], corpus, num_learners=spec.num_learners,
                           job=spec.job, incarnation=spec.incarnation, parallelism=spec.parallelism,
                           timeout_s=spec.timeout_s)
        return learner.follow()
    finally:
        teardown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.runtime.island_rank", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address of the leader's node (its store)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spec", required=True, help="IslandSpec as JSON")
    parser.add_argument("--parent", type=int, help="exit when this process (the starter) exits")
    a = parser.parse_args(argv)
    spec = IslandSpec.from_payload(a.spec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s island rank {a.rank}: %(message)s")
    if a.parent is not None and not die_with_parent(a.parent):
        log.error("island rank %s: its starter %s is gone", a.rank, a.parent)
        return 1
    try:
        steps = run_follower(spec, a.rank, a.port, a.host)
    except Exception as exc:  # the leader or a peer went away, or a collective timed out
        log.error("island rank %s failed: %s", a.rank, exc)
        return 1
    log.info("island rank %s: %d steps, stopped by its leader", a.rank, steps)
    return 0


def die_with_parent(parent: int) -> bool:
    """Ask the kernel for SIGKILL when the parent exits (Linux; elsewhere a no-op); False when the
    parent is already gone (it died before the request could take effect)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.debug("prctl unavailable: a follower outlives its starter until a collective fails")
    return os.getppid() == parent


if __name__ == "__main__":
    from trainer.island import exit_process

    exit_process(main())
