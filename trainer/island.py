"""Learner islands: one learner on several devices (of one node, or of several), data-parallel inside.

A learner with `devices_per_learner` W > 1 runs as W processes in one torch.distributed
process group (`gloo` on CPU, `nccl` on CUDA). Every rank holds the same engine `Learner`;
its loss runs through DistributedDataParallel, so after each inner step's gradient all-reduce
the replicas hold the same weights, and each rank reads its own 1/W of every batch of the
learner's stream (the learner's tokens are counted once, as the whole batch's).

Rank 0 alone runs the protocol (`LearnerLoop`: contributions, adoption, heartbeats,
checkpoints). Before each inner step it sends the other ranks one small command: step, or
stop; followed by whatever changed its weights since the last step (an adopted global
fragment: the fragment's weights and base; a resumed checkpoint: the whole learner state,
as safetensors bytes, never pickle). So the pseudo-gradient is computed once, on rank 0,
and the followers never diverge. Collectives time out, so a dead rank fails the others
instead of hanging them; the platform then re-places the learner whole.

This module is the DDP island; `inner_parallelism: fsdp` (each rank a shard) is
trainer.island_fsdp.ShardedIsland, on the same start, commands and teardown.
`trainer.island_kind.make_island` picks.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import TrainConfig
from trainer.learner import Learner, StepResult

log = logging.getLogger(__name__)

PARALLELISMS = ("ddp", "fsdp")
_STOP, _STEP = 0, 1
DEFAULT_TIMEOUT_S = 120.0


def backend_for(device: torch.device) -> str:
    """nccl on CUDA devices, gloo everywhere else (CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def island_device(preference: str, local_rank: int) -> str:
    """The device of one rank: the rank's own CUDA device on a GPU node, else as asked."""
    if preference.startswith("cuda") or (preference == "auto" and torch.cuda.is_available()):
        return f"cuda:{local_rank}"
    return preference


def timeout(seconds: float | None) -> timedelta:
    return timedelta(seconds=seconds or DEFAULT_TIMEOUT_S)


class SliceStream:
    """Rank r of W reads rows [r B/W, (r+1) B/W) of each batch of the learner's stream.

    The cursor moves by the whole batch on every rank, so the ranks together read exactly
    the windows one process would, and a checkpoint's cursor means the same on all of them.
    """

    def __init__(self, stream, rank: int, world: int) -> None:
        if stream.batch_size % world:
            raise ValueError(f"batch_size {stream.batch_size} is not a multiple of {world} devices")
        self.stream, self.rank, self.world = stream, rank, world
        self.rows = stream.batch_size // world

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np

        s = self.stream
        first = s.cursor + self.rank * self.rows
        rows = []
        for i in range(self.rows):
            start = s._window_index(first + i) * s.seq_len
            rows.append(np.asarray(s.corpus.train[start:start + s.seq_len + 1], dtype=np.int64))
        s.cursor += s.batch_size
        arr = torch.from_numpy(np.stack(rows))
        return arr[:, :-1], arr[:, 1:]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


class _Loss(nn.Module):
    """The model's loss as a module's forward, so DDP's hooks see it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


class IslandLearner(Learner):
    """One rank of an island: the engine Learner, its loss through DDP over `group`
    (trainer.island_fsdp.ShardedIsland is the FSDP2 one; trainer.island_kind.make_island picks).

    `ranks` lists the island's global ranks, its leader first. The leader is driven by a
    LearnerLoop like any learner; a follower runs `follow()` until the leader says stop.
    """

    parallelism = "ddp"

    def __init__(self, config: TrainConfig, index: int, *, ranks: list[int], group=None,
                 parallelism: str = "ddp", timeout_s: float | None = None, **kwargs) -> None:
        if parallelism != self.parallelism:
            raise ValueError(f"inner_parallelism {parallelism!r}: use make_island (this class runs "
                             f"{self.parallelism})")
        super().__init__(config, index, **kwargs)
        self.ranks = list(ranks)
        self.group = group
        self.world = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.leader = self.ranks[0]
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        self.comm = self.device if backend_for(self.device) == "nccl" else torch.device("cpu")
        self.stream = SliceStream(self.stream, self.rank, self.world)
        self.data_ranks = self.world
        self._wrap()
        self._full = True  # the whole state goes out before the first step
        self._dirty: set[int] = set()
        self.closed = False

    def _wrap(self) -> None:
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's weights at construction: every replica starts equal
        self.ddp = DistributedDataParallel(_Loss(self.model), device_ids=ids, process_group=self.group,
                                           forward_sync_buffers=False)
        self.forward_loss = self.ddp

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _contribute(self, p: int) -> None:
        if self.is_leader:  # only the leader contributes: the pseudo-gradient is computed once
            super()._contribute(p)

    # ---------------------------------------------------------------- leader: what changed
    @torch.no_grad()
    def adopt(self, g) -> bool:
        changed = super().adopt(g)
        if changed:
            self._dirty.add(g.fragment)
        return changed

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._full = True

    # ---------------------------------------------------------------- collectives
    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, self.leader, group=self.group)
        return t

    def _command(self, op: int) -> tuple[int, int, list[int]]:
        """Leader: send (op, full-state bytes, dirty fragments); follower: receive them."""
        if self.is_leader:
            blob = self._state_bytes() if (self._full and op == _STEP) else b""
            frags = sorted(self._dirty) if op == _STEP else []
            head = torch.tensor([op, len(blob), len(frags)], dtype=torch.int64, device=self.comm)
        else:
            head = torch.zeros(3, dtype=torch.int64, device=self.comm)
        op, nbytes, nfrag = (int(v) for v in self._bcast(head).tolist())
        if nbytes:
            if self.is_leader:
                buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.comm)
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.comm)
            self._bcast(buf)
            if not self.is_leader:
                self._load_bytes(bytes(buf.cpu().numpy().tobytes()))
        if nfrag:
            ids = torch.tensor(frags if self.is_leader else [0] * nfrag, dtype=torch.int64, device=self.comm)
            frags = [int(p) for p in self._bcast(ids).tolist()]
        else:
            frags = []
        for p in frags:
            self._sync_fragment(p)
        self._full, self._dirty = False, set()
        return op, nbytes, frags

    def _state_bytes(self) -> bytes:
        from trainer.runtime import codec

        return codec.pack(self.state_dict())

    def _load_bytes(self, blob: bytes) -> None:
        from trainer.runtime import codec

        state = codec.unpack(blob)
        mine = self.incarnation
        self.incarnation = int(state.get("incarnation", mine))  # load as the writer: keep its sends
        try:
            Learner.load_state_dict(self, state)
        finally:
            self.incarnation = mine

    @torch.no_grad()
    def _sync_fragment(self, p: int) -> None:
        """The leader's weights and base of fragment p, on every rank (one flat broadcast)."""
        names = self.fragments[p]
        tensors = [self.params[n].data for n in names] + [self.base[p][n] for n in names]
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors]).to(self.comm)
        self._bcast(flat)
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t).to(t.device, t.dtype))
            off += n

    # ---------------------------------------------------------------- steps
    def step(self) -> StepResult:
        if self.is_leader:
            self._command(_STEP)
        res = super().step()
        loss = torch.tensor([res.loss], dtype=torch.float64, device=self.comm)
        dist.all_reduce(loss, group=self.group)
        self.last_loss = float(loss.item()) / self.world
        return StepResult(loss=self.last_loss, tokens=res.tokens, step=res.step)

    def follow(self) -> int:
        """A follower's life: step when the leader steps, until it says stop; returns the steps."""
        steps = 0
        while True:
            op, _, _ = self._command(_STEP)
            if op == _STOP:
                return steps
            self.step()
            steps += 1

    def stop_followers(self) -> None:
        """Leader: tell the followers the learner is over (they exit)."""
        if self.is_leader and not self.closed:
            self.closed = True
            self._command(_STOP)


def init_rank(rank: int, world: int, *, port: int | None = None, store=None, device: str = "cpu",
              timeout_s: float | None = None, host: str = "127.0.0.1") -> None:
    """Join the world: rank 0 passes the TCPStore it hosts, the others its host and port (the
    leader's node address; 127.0.0.1 on the leader's own node)."""
    backend = backend_for(torch.device(device))
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    if store is None:
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout(timeout_s))
    if not dist.is_initialized():
        # The default group's name (its keys' prefix in the store) is torch's group counter, which
        # only a successful destroy_process_group resets. A pool process that led an island which
        # then failed (teardown's destroy can raise after an abort) would join the next one as
        # group "1" while fresh follower processes wait under "0": both sides time out. Every
        # rank of a new world starts from a clean counter.
        dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout(timeout_s))


def island_layout(learners: int, devices: int) -> list[list[int]]:
    """Global ranks of each learner's island when one process leads them all (the engine CLI):
    rank 0 leads every island, island m's followers are 1 + m (W-1) ... (m+1) (W-1)."""
    return [[0] + [1 + m * (devices - 1) + j for j in range(devices - 1)] for m in range(learners)]


def make_groups(layout: list[list[int]]) -> list:
    """One process group per island (every rank of the world must call this, in this order);
    a single island spanning the world uses the default group."""
    world = dist.get_world_size()
    if len(layout) == 1 and len(layout[0]) == world:
        return [None]
    return [dist.new_group(ranks) for ranks in layout]


def teardown() -> None:
    """Leave the world (after a failure too: a broken group must not keep the process).

    Every group is aborted first: after a peer died, a gloo work thread can stay blocked on the
    dead connection, and the group's destructor (run when DDP's reducer is freed, after
    destroy_process_group) joins that thread forever: the test process or a worker's pool slot
    hung in 1 of 3 runs here. Abort, then keep each group alive so that destructor never runs."""
    global _left_a_world
    if not dist.is_initialized():
        return
    _left_a_world = True
    for pg in list(dist.distributed_c10d._world.pg_map):  # the default group and the islands' own
        try:
            pg.abort()
        except Exception:  # a backend without abort, or one already down
            log.debug("abort of a process group failed", exc_info=True)
        # Abort alone is not enough: the destructor can still block on a lock the stuck thread
        # holds. Keep one reference to each group for the life of the process, so its C++
        # destructor never runs (a small, bounded leak per island start; the process lives on).
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    try:
        dist.destroy_process_group()
    except Exception:
        log.debug("destroy_process_group failed", exc_info=True)


_left_a_world = False


def exit_process(code: int | None) -> None:
    """End a command-line process that may have led or followed an island.

    The groups teardown() keeps alive still own gloo threads; at interpreter exit the C++ static
    destructors can meet one of those threads still joinable and call std::terminate, so a rank
    that finished cleanly exited with SIGABRT (-6) in about 1 of 8 runs here. Such a process
    flushes what it wrote and leaves with os._exit, skipping those destructors; any other exits
    the usual way."""
    if not _left_a_world:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(int(code or 0))


class RankStats:
    """Per-rank device figures that rank 0 reads itself, without a collective: on CUDA each rank's
    device utilisation and power (the driver's), on CPU the share of a core each rank's process
    used since the last read (from /proc). Names fit the telemetry's metric names."""

    def __init__(self, follower_pids: list[int], device: torch.device | None = None) -> None:
        import os

        self.pids = [os.getpid(), *follower_pids]
        self.device = device if device is not None else torch.device("cpu")
        self._last: dict[int, tuple[float, float]] = {}

    @staticmethod
    def _cpu_seconds(pid: int) -> float | None:
        import os

        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def read(self) -> dict[str, float]:
        import time

        from trainer.runtime.learner_loop import device_readings

        out: dict[str, float] = {}
        now = time.monotonic()
        for r, pid in enumerate(self.pids):
            if self.device.type == "cuda":
                util, power = device_readings(torch.device("cuda", r))
                if util is not None:
                    out[f"rank{r}_util"] = util
                if power is not None:
                    out[f"rank{r}_power_w"] = power
                continue
            cpu = self._cpu_seconds(pid)
            if cpu is None:
                continue
            prev = self._last.get(r)
            self._last[r] = (now, cpu)
            if prev is not None and now > prev[0]:
                out[f"rank{r}_cpu"] = max(0.0, (cpu - prev[1]) / (now - prev[0]))
        return out
