"""An in-memory `SyncerHost`: what a database would hold, in plain Python objects.

The simulator runs `SyncerLoop` against it (with a virtual clock), and the protocol tests use
it to check exactly-once delivery, fencing and resume without Postgres. The commit transaction
is a lease check and an append; everything else is bookkeeping a test can read back.
"""
from __future__ import annotations

from typing import Any

import torch

from . import keys
from .syncer_host import Beat, Commit, LearnerView, LeaseLost, Resume


class MemoryWorld:
    """The lease, the learners' views, the committed outer steps, refusals, checkpoints."""

    def __init__(self, learners: int = 2, job: str = "mem", incarnation: int = 1):
        self.job = job
        self.lease_epoch = 1
        self.resume: Resume | None = None
        self.learners = {i: LearnerView(incarnation=incarnation) for i in range(learners)}
        self.rows: list[Commit] = []
        self.refusals: list[tuple[str, str]] = []
        self.tokens = 0
        self.status = "running"
        self.checkpoints: list[tuple[str, int]] = []
        self.final_loss: float | None = None

    def host(self, epoch: int) -> MemoryHost:
        """A host for a syncer of lease `epoch` (taking the lease from any older one)."""
        self.lease_epoch = epoch
        return MemoryHost(self, epoch)

    def restart_learner(self, i: int, incarnation: int, resume_at: int | None) -> None:
        """Learner i restarted as `incarnation`, resuming fragment 0 at token `resume_at`."""
        point = None if resume_at is None else {"frag_pos": {"0": resume_at}}
        self.learners[i] = LearnerView(incarnation=incarnation, resume_point=point)

    def learner_done(self, i: int) -> None:
        self.learners[i] = LearnerView(self.learners[i].incarnation, live=False, finished=True)

    def pause(self) -> None:
        self.status = "paused"

    def ended(self) -> tuple[list[tuple[str, int]], bool]:
        """(checkpoints written, whether the job was completed with a final loss)."""
        return self.checkpoints, self.final_loss is not None

    def reasons(self) -> list[str]:
        return [reason for _key, reason in self.refusals]

    def tokens_contributed(self) -> int:
        return self.tokens


class MemoryHost:
    """SyncerHost over a MemoryWorld. Subclass and override `committed` / `refused` to watch
    the loop (the simulator schedules downloads and counts wasted work there)."""

    def __init__(self, world: MemoryWorld, epoch: int):
        self.world, self.epoch = world, epoch

    def _check(self) -> None:
        if self.world.lease_epoch != self.epoch:
            raise LeaseLost(f"epoch {self.epoch} superseded")

    def beat(self) -> Beat:
        self._check()
        return Beat(status=self.world.status, learners=dict(self.world.learners),
                    stop=self.world.status == "paused")

    def resume_point(self) -> Resume | None:
        return self.world.resume

    def commit(self, c: Commit) -> None:
        self._check()
        self.world.resume = Resume(c.commits, c.state_key, dict(c.head), dict(c.head_epochs))
        self.world.rows.append(c)
        self.world.tokens += c.tokens

    def committed(self, c: Commit, outer_steps: int, metrics_due: bool) -> None:
        pass

    def refused(self, ref: keys.ContribRef, reason: str) -> None:
        self.world.refusals.append((ref.key, reason))

    def outer_steps(self) -> int:
        return len(self.world.rows)

    def others_finished(self) -> bool:
        return True

    def evaluate(self, state: dict[str, torch.Tensor], step: int) -> float:
        """A stand-in loss (the sum of squares): the protocol tests only check it was asked for."""
        return float(sum(float(t.square().sum()) for t in state.values()))

    def checkpoint(self, kind: str, state: dict[str, torch.Tensor], outer_steps: int,
                   versions: dict[str, int]) -> None:
        self.world.checkpoints.append((kind, outer_steps))

    def stopped(self, status: str) -> None:
        pass

    def finished(self, summary: dict[str, Any], loss: float | None) -> None:
        self.world.final_loss = loss
