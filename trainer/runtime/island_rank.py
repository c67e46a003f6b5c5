"""Start and stop the follower ranks of learner islands; `python -m trainer.runtime.island_rank` is one.

The leader (rank 0: the Celery task of the learner, or the engine CLI) hosts the rendezvous:
a `torch.distributed.TCPStore` on 127.0.0.1 at a port the kernel picks (no race for a free
port), then starts every follower as `python -m trainer.runtime.island_rank` with that port.
A follower joins the process group, builds the same engine Learner and follows its leader's
commands (trainer.island.IslandLearner.follow) until told to stop, then exits 0.

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
from collections.abc import Sequence
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

    @property
    def world(self) -> int:
        return 1 + sum(len(ranks) - 1 for _, ranks in self.islands)


@dataclass
class Followers:
    """The follower processes of the islands this process leads."""

    spec: IslandSpec
    procs: list[subprocess.Popen] = field(default_factory=list)
    store: object = None  # the rendezvous store: kept alive as long as the group

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

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


def start(spec: IslandSpec) -> Followers:
    """Host the rendezvous, start the followers, join as rank 0 (returns once all have joined)."""
    import torch.distributed as dist

    from trainer.island import init_rank, teardown, timeout

    teardown()  # a group an earlier task of this process failed to leave
    store = dist.TCPStore("127.0.0.1", 0, spec.world, is_master=True, timeout=timeout(spec.timeout_s),
                          wait_for_workers=False)
    followers = Followers(spec, store=store)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    payload = json.dumps({**spec.__dict__, "islands": [[i, r] for i, r in spec.islands]})
    for rank in range(1, spec.world):
        cmd = [sys.executable, "-m", "trainer.runtime.island_rank", "--rank", str(rank),
               "--port", str(store.port), "--spec", payload]
        followers.procs.append(subprocess.Popen(cmd, env=env))
    try:
        init_rank(0, spec.world, store=store, device=spec.device, timeout_s=spec.timeout_s)
    except Exception:
        followers.kill()
        raise
    return followers


def _island_of(spec: IslandSpec, rank: int) -> tuple[int, int]:
    for n, (_index, ranks) in enumerate(spec.islands):
        if rank in ranks:
            return n, ranks.index(rank)
    raise ValueError(f"rank {rank} is in no island")


def run_follower(spec: IslandSpec, rank: int, port: int) -> int:
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
    init_rank(rank, spec.world, port=port, device=config.device, timeout_s=spec.timeout_s)
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
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spec", required=True, help="IslandSpec as JSON")
    a = parser.parse_args(argv)
    raw = json.loads(a.spec)
    raw["islands"] = [(int(i), [int(r) for r in ranks]) for i, ranks in raw["islands"]]
    spec = IslandSpec(**raw)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s island rank {a.rank}: %(message)s")
    try:
        steps = run_follower(spec, a.rank, a.port)
    except Exception as exc:  # the leader or a peer went away, or a collective timed out
        log.error("island rank %s failed: %s", a.rank, exc)
        return 1
    log.info("island rank %s: %d steps, stopped by its leader", a.rank, steps)
    return 0


if __name__ == "__main__":
    from trainer.island import exit_process

    exit_process(main())
