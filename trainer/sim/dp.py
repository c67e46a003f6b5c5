"""The data-parallel baselines on the simulated fleet: lock-step `ddp` (any failure restarts the
job from its last checkpoint) and `elastic-ddp` (a failed replica is dropped and rejoins later).

Every replica computes one batch per step and the gradients are all-reduced (ring, bf16,
overlapped with compute: step = max(compute, comm)). The simulator charges the time of replayed
work after a restart; the math is deterministic, so it does not recompute it.
"""

from __future__ import annotations

import math

import torch

from trainer.config import TrainConfig
from trainer.sim.state import SimRun, SimSpec


class _DPMath:
    """Data-parallel training of the proxy: one model, AdamW, the mean gradient of the live
    replicas' batches (replica r reads learner r's token stream)."""

    def __init__(self, cfg: TrainConfig, corpus, learners: int) -> None:
        from trainer.data import TokenStream
        from trainer.models import build_model
        from trainer.optimizers import make_optimizer

        self.cfg = cfg
        self.model = build_model(cfg.model, cfg.seq_len, cfg.seed, vocab_size=corpus.vocab_size)
        self.model.train()
        self.opt = make_optimizer(self.model, cfg, torch.device("cpu"))
        self.streams = [
            TokenStream(corpus, r, learners, cfg.batch_size, cfg.seq_len, cfg.seed) for r in range(learners)
        ]
        self.steps = 0

    def step(self, live: list[int]) -> None:
        from trainer.learner import inner_lr

        lr = inner_lr(self.cfg, self.steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        for r in live:
            x, y = self.streams[r].next_batch()
            (self.model.loss(x, y) / len(live)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


def _allreduce_time(run: SimRun, live: list[int]) -> tuple[float, float]:
    """Ring all-reduce of the declared gradient among live replicas: (seconds, bytes per link)."""
    m = len(live)
    if m <= 1:
        return 0.0, 0.0
    grad = run.spec.model.params * run.spec.model.grad_bytes_per_param
    per_link = 2 * (m - 1) / m * grad
    links = [run.links[run.islands[i].pool.slug] for i in live]
    bw = min(link.bytes_per_s for link in links)
    lat = max(link.latency for link in links)
    # islands sharing a pool link share its bandwidth
    share = max(
        sum(1 for i in live if run.islands[i].pool.slug == s)
        for s in {run.islands[i].pool.slug for i in live}
    )
    return per_link * share / bw + 2 * (m - 1) * lat, per_link


def _account(run: SimRun, i: int, kind: str, dt: float) -> None:
    if dt <= 0:
        return
    led = run.ledgers[i]
    setattr(led, kind, getattr(led, kind) + dt)


class _DPSim:
    """One data-parallel run: a loop of global steps, each one completing or cut by a failure."""

    def __init__(self, spec: SimSpec, corpus, elastic: bool) -> None:
        self.run = SimRun(spec, "elastic-ddp" if elastic else "ddp", corpus)
        self.spec = spec
        self.elastic = elastic
        self.rec = spec.recovery
        self.M = spec.learners
        self.math = _DPMath(spec.train, corpus, self.M)
        self.live = list(range(self.M))
        self.rejoin_at: dict[int, float] = {}
        self.progress = 0  # lock-step: steps since start that are safe or in flight
        self.ckpt_progress = 0
        self.ckpt_every = None
        self.restarts = 0
        self.step_times = [isl.step_time(spec.model) for isl in self.run.islands]
        if not elastic:
            ideal = max(self.step_times)
            self.ckpt_every = max(1, round(self.rec.checkpoint_interval_s / ideal))
        self.pending_steps = 0  # lock-step: learner-steps since the last checkpoint (lost on restart)

    def execute(self) -> dict:
        run = self.run
        run.maybe_eval(self.math.state)
        while not run.finished():
            t = run.t
            if self.elastic:
                t = self._rejoin(t)
                if not self.live:
                    self._wait_for_rejoin(t)
                    continue
            self._global_step(t)
        if not self.elastic:
            for led in run.ledgers:
                led.commit()
        extra = {"restarts": self.restarts} if not self.elastic else {}
        return run.result(extra)

    def _account_all(self, live_kind: str, dt: float) -> None:
        """Charge `dt` to every replica: `live_kind` to the live ones, downtime to the others."""
        for i in range(self.M):
            _account(self.run, i, live_kind if i in self.live else "down", dt)

    # -- elastic membership ----------------------------------------------------------------
    def _rejoin(self, t: float) -> float:
        """Replicas whose re-dispatch is done rejoin: everyone stalls for a reconfiguration."""
        run = self.run
        back = [i for i, ta in self.rejoin_at.items() if ta <= t]
        if not back:
            return t
        for i in back:
            del self.rejoin_at[i]
            self.live.append(i)
        self.live.sort()
        run.stall.set(t, True)
        self._account_all("idle", self.rec.reconfig_s)
        run.t = t = t + self.rec.reconfig_s
        run.stall.set(t, False)
        return t

    def _wait_for_rejoin(self, t: float) -> None:
        """No replica is live: the job is down until the first one rejoins."""
        run = self.run
        nxt = min(self.rejoin_at.values())
        run.stall.set(t, True)
        for i in range(self.M):
            _account(run, i, "down", nxt - t)
        run.t = nxt
        run.stall.set(nxt, False)

    # -- one global step -------------------------------------------------------------------
    def _global_step(self, t: float) -> None:
        run = self.run
        live = self.live
        speeds = {i: run.sched.speed(i, t) for i in live}
        compute = {i: self.step_times[i] / speeds[i] for i in live}
        comm, per_link = _allreduce_time(run, live)
        dur = max(max(compute.values()), comm)
        watch = live if self.elastic else list(range(self.M))
        f_time, f_isl = min(((run.sched.next_failure(i, t), i) for i in watch), default=(math.inf, -1))
        if f_time < t + dur:
            self._fail(t, f_time, f_isl, compute)
        else:
            self._complete(t, dur, compute, per_link)

    def _fail(self, t: float, f_time: float, f_isl: int, compute: dict[int, float]) -> None:
        """A replica fails during the step: the step is lost, then drop it or restart the job."""
        run = self.run
        run.failures += 1
        run.marks.append({"t": f_time, "kind": "failure", "learner": f_isl})
        el = f_time - t
        for i in self.live:
            _account(run, i, "wasted", min(el, compute[i]))
            _account(run, i, "idle", max(0.0, el - compute[i]))
        for i in range(self.M):
            if i not in self.live:
                _account(run, i, "down", el)
        run.stall.set(f_time, True)
        if self.elastic:
            self._drop(f_time, f_isl)
        else:
            self._restart(f_time)
        run.stall.set(run.t, False)

    def _drop(self, f_time: float, f_isl: int) -> None:
        """Elastic: the others go on after the heartbeat timeout and a reconfiguration."""
        self.live.remove(f_isl)
        self.rejoin_at[f_isl] = f_time + self.rec.D
        self._account_all("idle", self.rec.S)
        self.run.t = f_time + self.rec.S

    def _restart(self, f_time: float) -> None:
        """Lock-step: the whole job restarts from its last checkpoint; the work since is lost."""
        run = self.run
        self.restarts += 1
        for i in range(self.M):
            run.ledgers[i].lose()
            _account(run, i, "down", self.rec.R)
        lost = self.progress - self.ckpt_progress
        self.progress = self.ckpt_progress
        run.steps_done -= self.pending_steps
        self.pending_steps = 0
        run.rewind()
        run.marks.append({"t": f_time, "kind": "rollback", "steps": lost})
        run.t = f_time + self.rec.R

    def _complete(self, t: float, dur: float, compute: dict[int, float], per_link: float) -> None:
        """The step completes: charge it, count its traffic, train the proxy, checkpoint."""
        run = self.run
        live = self.live
        for i in live:
            _account(run, i, "pending", compute[i])
            _account(run, i, "idle", dur - compute[i])
        for i in range(self.M):
            if i not in live:
                _account(run, i, "down", dur)
        for i in live:
            link = run.links[run.islands[i].pool.slug]
            link.bytes["up"] += per_link
            link.bytes["down"] += per_link
        run.t = t + dur
        self.progress += 1
        if self.progress > self.math.steps:  # replayed steps after a restart were computed before
            self.math.step(live)
        run.steps_done += len(live)
        if self.elastic:
            for i in live:
                run.ledgers[i].commit()
        else:
            self._checkpoint_progress()
        run.maybe_eval(self.math.state)

    def _checkpoint_progress(self) -> None:
        """Lock-step: the step's work is pending until the periodic checkpoint commits it."""
        self.pending_steps += len(self.live)
        if self.progress % self.ckpt_every == 0:
            self.ckpt_progress = self.progress
            self.pending_steps = 0
            for led in self.run.ledgers:
                led.commit()


def run_dp(spec: SimSpec, corpus, elastic: bool) -> dict:
    """Run `ddp` (elastic False) or `elastic-ddp` (elastic True); returns the result row."""
    return _DPSim(spec, corpus, elastic).execute()
