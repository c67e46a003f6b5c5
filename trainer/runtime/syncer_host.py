"""The syncer host protocol: what `SyncerLoop` asks of the world outside the blob store.

The Django implementation is `apps.coordinator.syncer.DjangoSyncerHost` (lease row, commit
transaction, events, metrics); the protocol tests have an in-memory one. The messages are plain
dataclasses, so a host needs neither the engine nor a database.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import keys


class LeaseLost(RuntimeError):
    """This syncer's lease was taken over by a newer epoch: stop at once, commit nothing."""


@dataclass(frozen=True)
class LearnerView:
    """What the syncer needs to know of one learner."""
    incarnation: int
    resume_point: dict | None = None  # {"frag_pos": {fragment: end}} of the current incarnation
    live: bool = True                 # running, starting or pending
    finished: bool = False            # done or removed


@dataclass
class Beat:
    """The host's answer to a heartbeat."""
    status: str                      # the job's status, in the host's words
    learners: dict[int, LearnerView]
    stop: bool = False               # paused or over: leave without finishing
    may_finish: bool = True          # False while pausing: do not finish the job


@dataclass
class Resume:
    """The last committed point: the loop restores the snapshot it names."""
    commits: int
    state_key: str
    head: dict[int, int]
    head_epochs: dict[int, int]


@dataclass
class Commit:
    """One outer step, as the host's commit transaction records it."""
    fragment: int
    version: int
    contributors: list[dict]
    merged_norm: float
    duration_s: float
    blob_key: str
    blob_bytes: int
    commits: int
    state_key: str
    head: dict[int, int]
    head_epochs: dict[int, int]
    counters: dict[str, int]
    tokens: int                       # token-equivalents of the whole model (tokens / fragments)
    learner_tokens: list[tuple[int, int]] = field(default_factory=list)  # (learner, tokens) per blob


class SyncerHost(Protocol):
    def beat(self) -> Beat:
        """Stamp liveness; the learners' incarnations and resume points. Raises LeaseLost."""
    def resume_point(self) -> Resume | None: ...
    def commit(self, c: Commit) -> None:
        """The commit point, atomic; raises LeaseLost when the lease moved on."""
    def committed(self, c: Commit, outer_steps: int, metrics_due: bool) -> None:
        """After the head is written: live updates (and job metrics when due)."""
    def refused(self, ref: keys.ContribRef, reason: str) -> None: ...
    def outer_steps(self) -> int:
        """Outer steps of the whole job (all shards)."""
    def others_finished(self) -> bool: ...
    def evaluate(self, state: dict[str, torch.Tensor], step: int) -> float:
        """Validation loss of `state`, recorded at token count `step`."""
    def checkpoint(self, kind: str, state: dict[str, torch.Tensor], outer_steps: int,
                   versions: dict[str, int]) -> None: ...
    def stopped(self, status: str) -> None: ...
    def finished(self, summary: dict[str, Any], loss: float | None) -> None:
        """The shard merged everything (loss None), or the leader ends the job with `loss`."""
