"""The in-process driver: M learners and a syncer in one process, deterministic.

`run_local(config, strategy)` runs one of four strategies on the same engine objects the
runtime uses and returns the JSON report.

  single     one model, one AdamW (a standalone `Learner`).
  ddp        synchronous data parallel: M replicas, each reading its own stream, gradients
             averaged every step. Replicas of a synchronous job are identical, so this runs as
             one model on the M batches side by side (the mean loss over the M equal batches
             has exactly the averaged gradient). bytes_sent counts a ring all-reduce of fp32
             gradients: 2 (M - 1) / M of the model per replica per step.
  diloco     synchronous DiLoCo: `Learner`s + `Syncer` with quorum M (everyone, every H steps).
  decoupled  `Learner`s + `Syncer` with quorum K, grace window, staleness rule.

diloco and decoupled run as a discrete-event loop on a `ManualClock`: learner m takes
1 / speed_m virtual seconds per inner step (all 1 by default: lock-step); events at the same
instant are handled in learner order, and the syncer's merge rule is checked before the clock
moves on. Every contribution and every global fragment goes through its wire format
(`to_bytes` / `from_bytes`, with the configured compression for contributions; global
fragments travel as compressed updates with `global_compression`, else whole in fp32), so
compression acts on training exactly as in the runtime.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainer.clock import ManualClock
from trainer.config import STRATEGIES, TrainConfig
from trainer.data import Corpus, TokenStream, evaluate
from trainer.learner import Learner, inner_lr, load_corpus
from trainer.models import autocast, build_model, param_count, pick_device, set_flush_denormal
from trainer.optimizers import make_optimizer
from trainer.protocol import Contribution, GlobalFragment
from trainer.syncer import Syncer

Progress = Callable[[dict], None]


def _eval_batch_size(config: TrainConfig) -> int:
    return config.eval_batch_size or max(8, config.batch_size)


class _Evaluator:
    def __init__(self, config: TrainConfig, corpus: Corpus) -> None:
        self.config = config
        self.corpus = corpus
        self.device = pick_device(config.device)
        self.model = build_model(config.model, config.seq_len, config.seed, vocab_size=corpus.vocab_size)
        self.model.to(self.device)

    @torch.no_grad()
    def __call__(self, weights: dict[str, torch.Tensor] | torch.nn.Module) -> float:
        if isinstance(weights, torch.nn.Module):
            model = weights
        else:
            for n, p in self.model.named_parameters():
                p.copy_(weights[n])
            model = self.model
        return evaluate(
            model,
            self.corpus,
            _eval_batch_size(self.config),
            self.config.seq_len,
            batches=self.config.eval_batches,
            device=self.device,
        )


def _report(
    config: TrainConfig,
    strategy: str,
    params: int,
    initial: float,
    final: float,
    tokens: int,
    outer_steps: int,
    bytes_sent: int,
    t0: float,
    curve: list,
    **extra: Any,
) -> dict:
    return {
        "strategy": strategy,
        "model": config.model,
        "params": params,
        "learners": config.learners,
        "initial_val_loss": initial,
        "final_val_loss": final,
        "tokens": tokens,
        "outer_steps": outer_steps,
        "bytes_sent": bytes_sent,
        "wall_s": time.perf_counter() - t0,
        "val_curve": curve,
        "config": config.to_dict(),
        **extra,
    }


def run_single(config: TrainConfig, corpus: Corpus, progress: Progress | None = None) -> dict:
    t0 = time.perf_counter()
    ev = _Evaluator(config, corpus)
    learner = Learner(config, 0, corpus=corpus, num_learners=1, standalone=True)
    initial = ev(learner.model)
    curve = [[0, initial]]
    rounds = 0
    timer = StepTimer()
    while not learner.done:
        with timer():
            learner.step()
        if learner.inner_steps % config.inner_steps == 0 or learner.done:
            rounds += 1
            if rounds % config.eval_every == 0 or learner.done:
                curve.append([learner.tokens, ev(learner.model)])
            _emit(
                progress,
                strategy="single",
                round=rounds,
                tokens=learner.tokens,
                loss=learner.last_loss,
                val_loss=curve[-1][1],
            )
    final = curve[-1][1] if curve[-1][0] == learner.tokens else ev(learner.model)
    return _report(
        config,
        "single",
        param_count(learner.model),
        initial,
        final,
        learner.tokens,
        0,
        0,
        t0,
        curve,
        inner_steps=learner.inner_steps,
        **timer.means(learner.inner_steps),
    )


def run_ddp(config: TrainConfig, corpus: Corpus, progress: Progress | None = None) -> dict:
    t0 = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    ev = _Evaluator(config, corpus)
    device = pick_device(config.device)
    set_flush_denormal(device, config.flush_denormal)
    model = build_model(config.model, config.seq_len, config.seed, vocab_size=corpus.vocab_size).to(device)
    model.train()
    opt = make_optimizer(model, config, device)
    M = config.learners
    streams = [TokenStream(corpus, m, M, config.batch_size, config.seq_len, config.seed) for m in range(M)]
    n_params = param_count(model)
    per_step_bytes = int(2 * (M - 1) * 4 * n_params)
    initial = ev(model)
    curve = [[0, initial]]
    tokens = steps = rounds = 0
    bytes_sent = 0
    budget = config.max_tokens
    timer = StepTimer()
    while steps < config.steps and not (budget and tokens >= budget):
        with timer():
            for g in opt.param_groups:
                g["lr"] = inner_lr(config, steps)
            batches = [s.next_batch() for s in streams]
            x = torch.cat([b[0] for b in batches]).to(device)
            y = torch.cat([b[1] for b in batches]).to(device)
            with autocast(device, config.bf16):
                loss = model.loss(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps += 1
        tokens += x.numel()
        bytes_sent += per_step_bytes
        if steps % config.inner_steps == 0 or steps == config.steps:
            rounds += 1
            if rounds % config.eval_every == 0 or steps == config.steps:
                curve.append([tokens, ev(model)])
            _emit(
                progress,
                strategy="ddp",
                round=rounds,
                tokens=tokens,
                loss=float(loss.detach()),
                val_loss=curve[-1][1],
                bytes_sent=bytes_sent,
            )
    final = curve[-1][1] if curve[-1][0] == tokens else ev(model)
    return _report(
        config, "ddp", n_params, initial, final, tokens, steps, bytes_sent, t0, curve, inner_steps=steps,
        **timer.means(steps),
    )


class StepTimer:
    """Seconds spent in inner steps, wall clock and this thread's CPU time (the learners run on
    the calling thread, one torch thread each by default; CPU time stays meaningful on a machine
    that other work slows down), reported by mean over every step: a median would hide the
    cycle's syncing steps."""

    def __init__(self, wall_s: float = 0.0, cpu_s: float = 0.0) -> None:
        self.wall_s, self.cpu_s = wall_s, cpu_s

    @contextmanager
    def __call__(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall_s += time.perf_counter() - wall
            self.cpu_s += time.thread_time() - cpu

    def means(self, steps: int) -> dict[str, float | None]:
        return {"step_time_s_mean": self.wall_s / steps if steps else None,
                "step_cpu_s_mean": self.cpu_s / steps if steps else None}


def _emit(progress: Progress | None, **event: Any) -> None:
    if progress is not None:
        progress(event)


class LocalRun:
    """diloco / decoupled in one process: learners, syncer and a virtual clock.

    `state_dict()` / `load_state_dict()` checkpoint the whole run (every learner, the syncer,
    the clock and the report so far); `trainer.runtime.codec.pack` turns it into bytes.
    """

    def __init__(
        self,
        config: TrainConfig,
        strategy: str = "decoupled",
        corpus: Corpus | None = None,
        speeds: list[float] | None = None,
        progress: Progress | None = None,
        job: str = "local",
    ) -> None:
        if strategy not in ("diloco", "decoupled"):
            raise ValueError("LocalRun runs 'diloco' or 'decoupled'")
        self.strategy = strategy
        self.config = config
        self.corpus = corpus if corpus is not None else load_corpus(config)
        M = config.learners
        self.speeds = list(speeds) if speeds else [1.0] * M
        if len(self.speeds) != M or any(not (s > 0 and math.isfinite(s)) for s in self.speeds):
            raise ValueError(f"speeds: need {M} positive numbers")
        self.progress = progress
        self.job = job
        sync_config = config.replace(quorum=M) if strategy == "diloco" else config
        self.clock = ManualClock()
        self.learners = [Learner(config, m, corpus=self.corpus, job=job) for m in range(M)]
        self.syncer = Syncer(sync_config, self.learners[0].model, self.clock, job=job)
        self.evaluator = _Evaluator(config, self.corpus)
        self.next_t = [1.0 / s for s in self.speeds]
        self.bytes_up = 0
        self.bytes_down = 0
        self.contributions = 0
        self.rejected: list[str] = []
        self.compression_errors: list[float] = []
        self.curve: list[list[float]] = []
        self.merges = 0
        self.finish_merges = 0  # the finish's merges (after the budget), reported apart from outer steps
        self.step_timer = StepTimer()  # learners' adoptions and inner steps (contributions included)
        self.wall_before = 0.0
        self._published: dict[int, bytes] = {}
        self._expected = [self.syncer.expected_shapes(p) for p in range(len(self.syncer.fragments))]
        self.initial_val_loss: float | None = None
        self._evaluated_at = 0  # merges done when the global was last evaluated

    @property
    def tokens(self) -> int:
        return sum(learner.tokens for learner in self.learners)

    @property
    def P(self) -> int:
        return len(self.syncer.fragments)

    def _global_blob(self, p: int) -> bytes:
        blob = self._published.get(p)  # dropped at every merge of p
        if blob is None:
            blob = self.syncer.global_fragment(p).to_bytes("none")
            self._published[p] = blob
        return blob

    def _deliver(self, learner: Learner) -> None:
        for p in range(self.P):
            if self.syncer.versions[p] > learner.adopted_versions[p]:
                # the compressed updates since the version it holds, while they cost less than
                # the whole fp32 fragment; else the whole fragment
                chain = self.syncer.global_updates(p, learner.adopted_versions[p])
                whole = self._global_blob(p)
                if chain is not None and sum(map(len, chain)) < len(whole):
                    self.bytes_down += sum(map(len, chain))
                    learner.adopt_updates(
                        [GlobalFragment.from_bytes(b, expected=self._expected[p]) for b in chain])
                else:
                    self.bytes_down += len(whole)
                    learner.adopt(GlobalFragment.from_bytes(whole, expected=self._expected[p]))

    def _send(self, contributions: list[Contribution]) -> None:
        for c in contributions:
            blob = c.to_bytes(self.config.compression)
            self.bytes_up += len(blob)
            self.contributions += 1
            received = Contribution.from_bytes(blob, expected=self._expected[c.fragment])
            if self.config.compression != "none":
                num = sum(float((received.tensors[n] - t).pow(2).sum()) for n, t in c.tensors.items())
                den = sum(float(t.pow(2).sum()) for t in c.tensors.values())
                self.compression_errors.append(math.sqrt(num / den) if den > 0 else 0.0)
            result = self.syncer.submit(received)
            if not result.accepted:
                self.rejected.append(result.reason)
                if not result.reason.startswith("duplicate"):
                    self.learners[c.learner].refused(c.fragment)

    def _merge(self, p: int, force: bool = False, finish: bool = False) -> None:
        result = self.syncer.merge(p, force=force)
        self.merges += 1
        self.finish_merges += finish
        self._published.pop(p, None)
        if not finish and (self.merges - self.finish_merges) % self.P == 0:
            outer = (self.merges - self.finish_merges) // self.P
            done = all(learner.done for learner in self.learners)
            if outer % self.config.eval_every == 0 or done:
                self.curve.append([self.tokens, self.evaluator(self.syncer.params)])
                self._evaluated_at = self.merges
            _emit(
                self.progress,
                strategy=self.strategy,
                outer_step=outer,
                fragment=p,
                version=result.version,
                contributors=len(result.contributors),
                tokens=self.tokens,
                loss=sum(learner.last_loss for learner in self.learners) / len(self.learners),
                val_loss=self.curve[-1][1] if self.curve else None,
                bytes_sent=self.bytes_up + self.bytes_down,
                merged_norm=result.merged_norm,
                time=self.clock.now(),
            )

    def _merge_due(self) -> None:
        for p in self.syncer.due():
            self._merge(p)

    def run(self, until_steps: int | None = None) -> dict:
        """Run to the end (or until every learner has done `until_steps` inner steps)."""
        t0 = time.perf_counter()
        if self.initial_val_loss is None:
            self.initial_val_loss = self.evaluator(self.syncer.params)
            self.curve.append([0, self.initial_val_loss])

        def active(m: int) -> bool:
            learner = self.learners[m]
            return not learner.done and (until_steps is None or learner.inner_steps < until_steps)

        while True:
            live = [m for m in range(len(self.learners)) if active(m)]
            if not live:
                break
            t_next = min(self.next_t[m] for m in live)
            deadlines = [d for p in range(self.P) if (d := self.syncer.deadline(p)) is not None]
            if deadlines and min(deadlines) < t_next:
                self.clock.set(max(self.clock.now(), min(deadlines)))
                self._merge_due()
                continue
            self.clock.set(t_next)
            for m in live:
                if self.next_t[m] == t_next:
                    learner = self.learners[m]
                    with self.step_timer():
                        self._deliver(learner)
                        learner.step()
                    self._send(learner.due_contributions())
                    self.next_t[m] += 1.0 / self.speeds[m]
            self._merge_due()
        if until_steps is None:
            self._finish()
        self.wall_before += time.perf_counter() - t0
        return self.report()

    def _finish(self) -> None:
        """Merge what is pending, let every learner adopt and send its unsent progress, merge again;
        then evaluate the global these last merges made (they add no tokens, so the last point of
        the curve can be at the same tokens: its loss is then replaced, not kept from before them)."""
        for _ in range(2):
            for p in range(self.P):
                if self.syncer.pending_count(p):
                    self._merge(p, force=True, finish=True)
            for learner in self.learners:
                self._deliver(learner)
            for learner in self.learners:
                self._send(learner.flush())
        if not self.curve or self.curve[-1][0] != self.tokens:
            self.curve.append([self.tokens, self.evaluator(self.syncer.params)])
        elif self._evaluated_at != self.merges:
            self.curve[-1][1] = self.evaluator(self.syncer.params)
        self._evaluated_at = self.merges

    def report(self) -> dict:
        t0 = time.perf_counter() - self.wall_before
        errors = self.compression_errors
        return _report(
            self.config,
            self.strategy,
            sum(t.numel() for t in self.syncer.params.values()),
            self.initial_val_loss,
            self.curve[-1][1],
            self.tokens,
            round((self.merges - self.finish_merges) / self.P),
            self.bytes_up + self.bytes_down,
            t0,
            self.curve,
            merges=self.merges,
            finish_merges=self.finish_merges,
            contributions=self.contributions,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            rejected=len(self.rejected),
            rejections=dict(self.syncer.rejections),
            compression=self.config.compression,
            global_compression=self.config.global_compression,
            compression_error_mean=sum(errors) / len(errors) if errors else 0.0,
            compression_error_max=max(errors) if errors else 0.0,
            virtual_time_s=self.clock.now(),
            speeds=self.speeds,
            inner_steps=[learner.inner_steps for learner in self.learners],
            **self.step_timer.means(sum(learner.inner_steps for learner in self.learners)),
        )

    def state_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "clock": self.clock.now(),
            "next_t": list(self.next_t),
            "learners": [learner.state_dict() for learner in self.learners],
            "syncer": self.syncer.state_dict(),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "contributions": self.contributions,
            "rejected": list(self.rejected),
            "compression_errors": list(self.compression_errors),
            "curve": [list(x) for x in self.curve],
            "merges": self.merges,
            "finish_merges": self.finish_merges,
            "initial_val_loss": self.initial_val_loss,
            "wall_before": self.wall_before,
            "step_time_s": [self.step_timer.wall_s, self.step_timer.cpu_s],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["strategy"] != self.strategy:
            raise ValueError(f"checkpoint of a {state['strategy']} run")
        self.clock.set(state["clock"])
        self.next_t = [float(t) for t in state["next_t"]]
        for learner, s in zip(self.learners, state["learners"], strict=True):
            learner.load_state_dict(s)
        self.syncer.load_state_dict(state["syncer"])
        self.bytes_up, self.bytes_down = int(state["bytes_up"]), int(state["bytes_down"])
        self.contributions = int(state["contributions"])
        self.rejected = list(state["rejected"])
        self.compression_errors = list(state["compression_errors"])
        self.curve = [list(x) for x in state["curve"]]
        self.merges = int(state["merges"])
        self.finish_merges = int(state.get("finish_merges", 0))
        self.initial_val_loss = state["initial_val_loss"]
        self._evaluated_at = -1  # unknown: the finish evaluates the global it leaves
        self.wall_before = float(state["wall_before"])
        self.step_timer = StepTimer(*map(float, state.get("step_time_s", (0.0, 0.0))))
        self._published = {}


def run_local(
    config: TrainConfig,
    strategy: str = "decoupled",
    progress: Progress | None = None,
    corpus: Corpus | None = None,
    speeds: list[float] | None = None,
) -> dict:
    """Run one strategy in this process and return the JSON report."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    corpus = corpus if corpus is not None else load_corpus(config)
    if strategy == "single":
        return run_single(config, corpus, progress)
    if strategy == "ddp":
        return run_ddp(config, corpus, progress)
    return LocalRun(config, strategy, corpus=corpus, speeds=speeds, progress=progress).run()
