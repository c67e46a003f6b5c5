"""What a simulated run is given and what it keeps: the scenario (`SimSpec`) and the state and
report every strategy driver shares (`SimRun`: fleet, links, ledgers, evaluation, result row)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch

from trainer.config import TrainConfig
from trainer.sim.failures import FailureModel, FailureSchedule, RecoveryModel
from trainer.sim.fleet import DeclaredModel, Island, Ledger, Link, PoolProfile, energy_j


@dataclass
class SimSpec:
    """A scenario: fleet, declared model, proxy training config, failure and recovery models."""

    name: str
    pools: list[PoolProfile]
    placement: list[str]  # pool slug of each learner island
    chips: list[int]  # chips of each learner island
    model: DeclaredModel
    train: TrainConfig  # proxy training (H, P, K, compression, steps per learner...)
    failures: FailureModel = field(default_factory=lambda: FailureModel(enabled=False))
    recovery: RecoveryModel = field(default_factory=RecoveryModel)
    seed: int = 0
    eval_points: int = 6
    target_loss: float | None = None
    max_overrun: float = 1.0  # train past the budget (x budget) until the target loss
    rebalance_every: int | None = None  # inner steps of the fastest learner between rebalances (None: H)
    min_move_gain: float = 0.2
    wall_limit_s: float | None = None  # safety stop (reported), never expected to trigger
    max_time_s: float | None = None  # virtual-time stop (reported): a strategy that cannot progress
    kill: dict[int, float] = field(default_factory=dict)  # learner -> time it dies for good (what-if, tests)

    @property
    def learners(self) -> int:
        return len(self.placement)


class Stall:
    """Accumulates global downtime: intervals during which the job as a whole is stalled."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since: float | None = None

    def set(self, t: float, stalled: bool) -> None:
        if stalled and self._since is None:
            self._since = t
        elif not stalled and self._since is not None:
            self.total += t - self._since
            self._since = None

    def close(self, t: float) -> None:
        self.set(t, False)


class SimRun:
    """State shared by every strategy driver."""

    def __init__(self, spec: SimSpec, strategy: str, corpus) -> None:
        from trainer.models import build_model

        torch.set_num_threads(1)
        self.spec = spec
        self.strategy = strategy
        self.corpus = corpus
        self.pools = {p.slug: copy.copy(p) for p in spec.pools}
        self.islands = [Island(i, self.pools[slug], spec.chips[i]) for i, slug in enumerate(spec.placement)]
        self.links = {p.slug: Link(p.slug, p.link_gbps, p.latency_ms) for p in self.pools.values()}
        self.ledgers = [Ledger() for _ in self.islands]
        self.sched = FailureSchedule(
            spec.failures,
            spec.chips,
            [p.slug for p in self.pools.values() if p.whole_pool_failures],
            spec.seed,
        )
        self.stall = Stall()
        self.curve: list[dict] = []
        self.marks: list[dict] = []  # failures, recoveries, moves (virtual time)
        self.moves: list[dict] = []
        self.failures = 0
        self.t = 0.0
        cfg = spec.train
        self.proxy_tokens_per_step = cfg.batch_size * cfg.seq_len
        self.budget_steps = cfg.steps * spec.learners  # learner-steps of the token budget
        self.steps_done = 0  # committed learner-steps (not lost)
        self.final_loss: float | None = None
        self.final_t: float | None = None
        self.target_t: float | None = None
        self._eval_model = build_model(cfg.model, cfg.seq_len, cfg.seed, vocab_size=corpus.vocab_size)
        self._k = 1
        self._next_eval = self._milestone(1)
        self._loss_cache: dict[int, float] = {}
        self.wall0 = time.monotonic()
        self.limited = False

    # -- evaluation ------------------------------------------------------------------------
    def evaluate_state(self, state: dict[str, torch.Tensor]) -> float:
        from trainer.data import evaluate

        self._eval_model.load_state_dict(state, strict=False)
        cfg = self.spec.train
        return evaluate(
            self._eval_model,
            self.corpus,
            cfg.eval_batch_size or cfg.batch_size,
            cfg.seq_len,
            batches=cfg.eval_batches,
        )

    def _milestone(self, k: int) -> int:
        return max(1, math.ceil(k * self.budget_steps / max(1, self.spec.eval_points)))

    def maybe_eval(self, state_fn) -> None:
        """Evaluate when the committed steps cross the next of `eval_points` equal milestones."""
        while self.steps_done >= self._next_eval:
            key = self._next_eval
            if key not in self._loss_cache:
                self._loss_cache[key] = self.evaluate_state(state_fn())
            self.record(self._loss_cache[key])
            self._k += 1
            self._next_eval = self._milestone(self._k)

    def rewind(self) -> None:
        """Lock-step rollback: forget evaluation points beyond the restored progress (they are
        re-recorded, at their new times, when the replay crosses them again; the model state at
        a milestone is deterministic, so its cached loss is reused)."""
        tokens = self.steps_done * self.spec.model.tokens_per_step
        self.curve = [c for c in self.curve if c["tokens"] <= tokens]
        while self._k > 1 and self._milestone(self._k - 1) > self.steps_done:
            self._k -= 1
        self._next_eval = self._milestone(self._k)
        if self.target_t is not None and (
            not self.curve
            or self.curve[-1]["t"] < self.target_t
            and self.curve[-1]["val_loss"] > (self.spec.target_loss or 0)
        ):
            self.target_t = None

    def record(self, loss: float) -> None:
        tokens = self.steps_done * self.spec.model.tokens_per_step
        self.curve.append({"t": self.t, "tokens": tokens, "val_loss": loss})
        if self.final_loss is None and self.steps_done >= self.budget_steps:
            self.final_loss, self.final_t = loss, self.t
        tgt = self.spec.target_loss
        if tgt is not None and self.target_t is None and loss <= tgt:
            self.target_t = self._interpolate_target(tgt)

    def _interpolate_target(self, tgt: float) -> float:
        if len(self.curve) < 2:
            return self.curve[-1]["t"]
        a, b = self.curve[-2], self.curve[-1]
        if a["val_loss"] <= b["val_loss"]:
            return b["t"]
        f = (a["val_loss"] - tgt) / (a["val_loss"] - b["val_loss"])
        return a["t"] + f * (b["t"] - a["t"])

    def finished(self) -> bool:
        if self.spec.wall_limit_s and time.monotonic() - self.wall0 > self.spec.wall_limit_s:
            self.limited = True
            return True
        if self.spec.max_time_s and self.t > self.spec.max_time_s:
            self.limited = True
            return True
        if self.steps_done < self.budget_steps or self.final_loss is None:
            return False
        if self.spec.target_loss is None or self.target_t is not None:
            return True
        return self.steps_done >= self.budget_steps * self.spec.max_overrun

    # -- result ----------------------------------------------------------------------------
    def result(self, extra: dict | None = None) -> dict:
        T = max(self.final_t if self.final_t is not None else self.t, 1e-9)
        T_all = max(self.t, 1e-9)
        self.stall.close(self.t)
        busy = sum(led.busy for led in self.ledgers)
        total = sum(led.busy + led.idle + led.down for led in self.ledgers) or 1e-9
        useful = sum(led.useful + led.pending for led in self.ledgers)
        by_class: dict[str, list[float]] = {}
        for isl, led in zip(self.islands, self.ledgers, strict=True):
            acc = by_class.setdefault(isl.acc.slug, [0.0, 0.0])
            acc[0] += led.busy
            acc[1] += led.busy + led.idle + led.down
        energy = sum(energy_j(isl, led) for isl, led in zip(self.islands, self.ledgers, strict=True))
        tokens = self.steps_done * self.spec.model.tokens_per_step
        link_bytes = {slug: link.bytes["up"] + link.bytes["down"] for slug, link in self.links.items()}
        bytes_up = sum(link.bytes["up"] for link in self.links.values())
        by_pool: dict[str, list[float]] = {}
        for slug, led in zip(self.spec.placement, self.ledgers, strict=True):
            acc = by_pool.setdefault(slug, [0.0, 0.0])
            acc[0] += led.busy
            acc[1] += led.busy + led.idle + led.down
        wasted = sum(led.wasted for led in self.ledgers)
        out = {
            "strategy": self.strategy,
            "goodput": useful / total,
            "uptime": 1.0 - self.stall.total / T_all,
            "global_downtime_s": self.stall.total,
            "time_to_target_s": self.target_t,
            "final_val_loss": self.final_loss,
            "utilisation": busy / total,
            "utilisation_by_class": {k: v[0] / v[1] if v[1] else 0.0 for k, v in sorted(by_class.items())},
            "utilisation_by_pool": {k: v[0] / v[1] if v[1] else 0.0 for k, v in sorted(by_pool.items())},
            "tokens": tokens,
            "proxy_tokens": self.steps_done * self.proxy_tokens_per_step,
            "time_s": T,
            "energy_j": energy,
            "j_per_token": energy / tokens if tokens else None,
            "bytes_sent": sum(link_bytes.values()),
            "bytes_by_link": link_bytes,
            "bytes_up": bytes_up,
            "bytes_per_token": sum(link_bytes.values()) / tokens if tokens else None,
            "bytes_up_per_token": bytes_up / tokens if tokens else None,
            "failures": self.failures,
            "lost_per_failure_s": wasted / len(self.ledgers) / self.failures if self.failures else None,
            "moves": self.moves,
            "curve": self.curve,
            "marks": self.marks,
            "wall_s": time.monotonic() - self.wall0,
            "wall_limited": self.limited,
        }
        if extra:
            out.update(extra)
        return out
