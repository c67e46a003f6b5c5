"""One strategy on a simulated fleet: the real engine on a virtual clock.

The learners, the syncer, the fragment schedule, the wire format (every contribution and
every global fragment is encoded with the engine's compression and decoded and validated on
arrival), the DyLU work sizes and the placement/move policy are the production code. The
simulator only decides *when* things happen: an inner step of learner i takes
`island.step_time / straggler speed` virtual seconds, a payload takes its declared bytes
over the pool's link (FIFO per direction), failures come from `FailureSchedule`, and the
platform recovers as `RecoveryModel` says.

Strategies (same fleet, failure schedule, data and token budget):
- `ddp`: synchronous data parallel. Every replica computes one batch per step, gradients
  are all-reduced (ring, bf16, overlapped with compute: step = max(compute, comm)). Any
  failure stops everyone: heartbeat timeout + job restart from the last checkpoint (work
  since then is replayed: the simulator charges its time; the math is deterministic, so it
  does not recompute it).
- `elastic-ddp`: a failed replica is dropped after the heartbeat timeout plus a
  reconfiguration; the others go on with a smaller batch; it rejoins (another
  reconfiguration) after re-dispatch.
- `diloco`: synchronous DiLoCo: the real Learner/Syncer with one fragment and quorum M; each
  learner waits for the merged global weights before its next round.
- `decoupled`: Decoupled DiLoCo: P fragments, quorum K < M, learners never wait.
- `decoupled+rebalance`: the same plus live rebalancing every cycle: DyLU work sizes from
  measured throughput (`rebalance.resize_work`) and moves to better pools with free slots
  (`rebalance.plan_moves`).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from trainer.config import TrainConfig
from trainer.sim.failures import FailureModel, FailureSchedule, RecoveryModel
from trainer.sim.fleet import WIRE_BYTES_PER_PARAM, DeclaredModel, Island, Ledger, Link, PoolProfile, energy_j

STRATEGIES = ("ddp", "elastic-ddp", "diloco", "decoupled", "decoupled+rebalance")


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


class _Stall:
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


class _Run:
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
        self.stall = _Stall()
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


# ------------------------------------------------------------------------------------------
# Data parallel (lock-step and elastic)
# ------------------------------------------------------------------------------------------


class _DPMath:
    """Data-parallel training of the proxy: one model, AdamW, the mean gradient of the live
    replicas' batches (replica r reads learner r's token stream)."""

    def __init__(self, cfg: TrainConfig, corpus, learners: int) -> None:
        from trainer.data import TokenStream
        from trainer.learner import make_optimizer
        from trainer.models import build_model

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


def _allreduce_time(run: _Run, live: list[int]) -> tuple[float, float]:
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


def run_dp(spec: SimSpec, corpus, elastic: bool) -> dict:
    run = _Run(spec, "elastic-ddp" if elastic else "ddp", corpus)
    rec = spec.recovery
    M = spec.learners
    math_ = _DPMath(spec.train, corpus, M)
    live = list(range(M))
    rejoin_at: dict[int, float] = {}
    progress = 0  # lock-step: steps since start that are safe or in flight
    ckpt_progress = 0
    ckpt_every = None
    restarts = 0
    step_times = [isl.step_time(spec.model) for isl in run.islands]
    if not elastic:
        ideal = max(step_times)
        ckpt_every = max(1, round(rec.checkpoint_interval_s / ideal))
    pending_steps = 0  # lock-step: learner-steps since the last checkpoint (lost on restart)
    run.maybe_eval(math_.state)
    while not run.finished():
        t = run.t
        if elastic:
            back = [i for i, ta in rejoin_at.items() if ta <= t]
            if back:
                # rejoin: everyone stalls for a reconfiguration
                for i in back:
                    del rejoin_at[i]
                    live.append(i)
                live.sort()
                run.stall.set(t, True)
                for i in range(M):
                    _account(run, i, "idle" if i in live else "down", rec.reconfig_s)
                run.t = t = t + rec.reconfig_s
                run.stall.set(t, False)
            if not live:
                nxt = min(rejoin_at.values())
                run.stall.set(t, True)
                for i in range(M):
                    _account(run, i, "down", nxt - t)
                run.t = nxt
                run.stall.set(nxt, False)
                continue
        speeds = {i: run.sched.speed(i, t) for i in live}
        compute = {i: step_times[i] / speeds[i] for i in live}
        comm, per_link = _allreduce_time(run, live)
        dur = max(max(compute.values()), comm)
        watch = live if elastic else list(range(M))
        f_time, f_isl = min(((run.sched.next_failure(i, t), i) for i in watch), default=(math.inf, -1))
        if f_time < t + dur:
            run.failures += 1
            run.marks.append({"t": f_time, "kind": "failure", "learner": f_isl})
            el = f_time - t
            for i in live:
                _account(run, i, "wasted", min(el, compute[i]))
                _account(run, i, "idle", max(0.0, el - compute[i]))
            for i in range(M):
                if i not in live:
                    _account(run, i, "down", el)
            run.stall.set(f_time, True)
            if elastic:
                live.remove(f_isl)
                rejoin_at[f_isl] = f_time + rec.D
                for i in range(M):
                    _account(run, i, "idle" if i in live else "down", rec.S)
                run.t = f_time + rec.S
            else:
                restarts += 1
                for i in range(M):
                    run.ledgers[i].lose()
                    _account(run, i, "down", rec.R)
                lost = progress - ckpt_progress
                progress = ckpt_progress
                run.steps_done -= pending_steps
                pending_steps = 0
                run.rewind()
                run.marks.append({"t": f_time, "kind": "rollback", "steps": lost})
                run.t = f_time + rec.R
            run.stall.set(run.t, False)
            continue
        # the step completes
        for i in live:
            _account(run, i, "pending", compute[i])
            _account(run, i, "idle", dur - compute[i])
        for i in range(M):
            if i not in live:
                _account(run, i, "down", dur)
        for i in live:
            link = run.links[run.islands[i].pool.slug]
            link.bytes["up"] += per_link
            link.bytes["down"] += per_link
        run.t = t + dur
        progress += 1
        if progress > math_.steps:  # replayed steps after a restart were computed before
            math_.step(live)
        run.steps_done += len(live)
        if elastic:
            for i in live:
                run.ledgers[i].commit()
        else:
            pending_steps += len(live)
            if progress % ckpt_every == 0:
                ckpt_progress = progress
                pending_steps = 0
                for led in run.ledgers:
                    led.commit()
        run.maybe_eval(math_.state)
    if not elastic:
        for led in run.ledgers:
            led.commit()
    extra = {"restarts": restarts} if not elastic else {}
    return run.result(extra)


def _account(run: _Run, i: int, kind: str, dt: float) -> None:
    if dt <= 0:
        return
    led = run.ledgers[i]
    setattr(led, kind, getattr(led, kind) + dt)


# ------------------------------------------------------------------------------------------
# DiLoCo (synchronous) and Decoupled DiLoCo: event-driven, real Learner and Syncer
# ------------------------------------------------------------------------------------------


class _Queue:
    def __init__(self) -> None:
        self._h: list = []
        self._seq = itertools.count()

    def push(self, t: float, kind: str, **data) -> None:
        heapq.heappush(self._h, (t, next(self._seq), kind, data))

    def pop(self):
        return heapq.heappop(self._h)

    def __bool__(self) -> bool:
        return bool(self._h)


class VirtualClock:
    """The syncer's clock: virtual seconds, moved by the event loop."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@dataclass
class _L:
    """Simulator-side state of one learner slot."""

    learner: object
    up: bool = True
    incarnation: int = 0
    waiting: bool = False  # sync DiLoCo: waiting for the merged round
    step_start: float = 0.0
    ckpt: dict | None = None
    ckpt_steps: int = 0  # learner.inner_steps at the checkpoint
    steps_since_ckpt: int = 0
    window_steps: int = 0  # for measured throughput
    window_busy: float = 0.0
    down_since: float = 0.0
    wait_since: float = 0.0


def run_diloco(spec: SimSpec, corpus, mode: str) -> dict:
    """mode: 'diloco' (sync), 'decoupled', 'decoupled+rebalance'."""
    from trainer.learner import Learner
    from trainer.models import build_model
    from trainer.protocol import Contribution, GlobalFragment
    from trainer.rebalance import LearnerStatus, plan_moves, resize_work
    from trainer.syncer import Syncer

    sync = mode == "diloco"
    rebalance = mode == "decoupled+rebalance"
    M = spec.learners
    cfg = spec.train
    if sync:
        cfg = cfg.replace(fragments=1, quorum=M)
    run = _Run(spec, mode, corpus)
    rec = spec.recovery
    clock = VirtualClock()
    model0 = build_model(cfg.model, cfg.seq_len, cfg.seed, vocab_size=corpus.vocab_size)
    syncer = Syncer(cfg, model0, clock, job=spec.name)
    comp = cfg.compression
    P = cfg.fragments
    frag_params = _declared_fragment_params(spec.model.params, model0, cfg)

    def new_learner(i: int, inc: int):
        return Learner(cfg, i, incarnation=inc, corpus=corpus, job=spec.name, num_learners=M)

    slots = [_L(new_learner(i, 0)) for i in range(M)]
    expected = [slots[0].learner.expected_shapes(p) for p in range(P)]
    q = _Queue()
    merges = 0
    refused: dict[str, int] = {}
    scheduled_checks: set[tuple[int, float]] = set()
    step_time = [isl.step_time(spec.model) for isl in run.islands]
    max_link_bps = max(link.bytes_per_s for link in run.links.values())

    def start_step(i: int, t: float) -> None:
        s = slots[i]
        s.step_start = t
        dur = step_time[i] / run.sched.speed(i, t)
        q.push(t + dur, "step", i=i, inc=s.incarnation)

    def arm_failure(i: int, t: float) -> None:
        f = run.sched.next_failure(i, t)
        if f < math.inf:
            q.push(f, "fail", i=i, inc=slots[i].incarnation)

    def update_stall(t: float) -> None:
        ups = [s for s in slots if s.up]
        syncer.set_expected_learners(max(1, len(ups)))
        stalled = not ups or (sync and all(s.waiting for s in ups) and len(ups) < M)
        run.stall.set(t, stalled)

    def checkpoint(s: _L) -> None:
        s.ckpt = _snapshot(s.learner)
        s.ckpt_steps = s.learner.inner_steps
        s.steps_since_ckpt = 0

    downloading: set[tuple[int, int]] = set()  # (learner, fragment) with a download in flight

    def fetch(j: int, p: int, t: float) -> None:
        """Learner j pulls the newest version of fragment p (one download per fragment at a time,
        as a learner polling the blob store for the latest key does)."""
        s = slots[j]
        if not s.up or (j, p) in downloading or syncer.versions[p] <= s.learner.adopted_versions[p]:
            return
        # the compressed updates since the version the learner holds while they cost less than
        # the whole fragment (as the runtime's learners fetch them), else the whole fragment
        chain = syncer.global_updates(p, s.learner.adopted_versions[p]) or []
        whole_bytes = frag_params[p] * WIRE_BYTES_PER_PARAM["none"]
        chain_bytes = len(chain) * frag_params[p] * WIRE_BYTES_PER_PARAM[cfg.global_compression]
        if chain and chain_bytes < whole_bytes:
            blobs, nbytes = chain, chain_bytes
        else:
            blobs, nbytes = [syncer.global_fragment(p).to_bytes("none")], whole_bytes
        arr = run.links[run.islands[j].pool.slug].send(t, nbytes, "down")
        downloading.add((j, p))
        q.push(arr, "global", i=j, inc=s.incarnation, blobs=blobs, fragment=p)

    def send_fragment_down(g, t: float) -> None:
        for j in range(len(slots)):
            fetch(j, g.fragment, t)

    def try_merge(t: float) -> None:
        nonlocal merges
        for p in syncer.due(t):
            # the syncer times its merge on the wall clock; in virtual time a merge is instant, and
            # its sync time is the fragment's transfer over the fastest link (keeps runs deterministic)
            before = syncer.xi_sync.value
            res = syncer.merge(p)
            syncer.xi_sync.value = before
            syncer.observe(transfer_time=frag_params[p] * WIRE_BYTES_PER_PARAM[comp] / max_link_bps)
            merges += 1
            send_fragment_down(res.global_fragment, t)
        for p in range(P):
            d = syncer.deadline(p)
            if d is not None and d > t and (p, d) not in scheduled_checks:
                scheduled_checks.add((p, d))
                q.push(d, "check", p=p)

    for i in range(M):
        checkpoint(slots[i])
        start_step(i, 0.0)
        arm_failure(i, 0.0)
    if rebalance:
        fastest = min(step_time)
        q.push(fastest * (spec.rebalance_every or cfg.inner_steps), "rebalance")
    for i, tk in spec.kill.items():
        q.push(tk, "kill", i=i)
    for slug in run.pools:
        f = run.sched.next_pool_failure(slug, 0.0)
        if f < math.inf:
            q.push(f, "poolfail", slug=slug)

    def global_state():
        return syncer.global_state()

    run.maybe_eval(global_state)
    last_t = 0.0

    def go_down(i: int, t: float, why: str) -> None:
        s = slots[i]
        led = run.ledgers[i]
        if s.waiting:
            led.idle += t - s.wait_since
            s.waiting = False
        else:
            led.wasted += t - s.step_start  # the step in progress
        led.lose()  # work since the last checkpoint
        run.steps_done -= s.steps_since_ckpt
        s.up = False
        s.down_since = t
        s.incarnation += 1
        syncer.fence(i, s.incarnation)  # whatever the old incarnation still has in flight is refused
        run.failures += why != "move"
        run.marks.append({"t": t, "kind": why, "learner": i})

    def send_contribution(i: int, c, t: float) -> None:
        blob = c.to_bytes(comp)
        nbytes = frag_params[c.fragment] * WIRE_BYTES_PER_PARAM[comp]
        arr = run.links[run.islands[i].pool.slug].send(t, nbytes, "up")
        q.push(arr, "contrib", i=i, blob=blob, fragment=c.fragment)

    def come_up(i: int, t: float) -> None:
        s = slots[i]
        run.ledgers[i].down += t - s.down_since
        syncer.fence(i, s.incarnation)
        ck = s.ckpt
        resend = sync and int(ck["adopted_versions"][0]) == syncer.versions[0]
        if resend:
            # lock-step, round not merged: the payload this checkpoint sent was fenced out with the
            # old incarnation, so the new incarnation sends the progress it holds again at once
            lrn = new_learner(i, s.incarnation)
            lrn.load_state_dict(ck)
        else:
            # Restore as the incarnation that wrote the checkpoint, so outstanding sends are known;
            # adopting the newest globals then mixes only the progress made since those sends (no
            # re-application of progress the syncer already merged); then take the new incarnation.
            lrn = new_learner(i, int(ck["incarnation"]))
            lrn.load_state_dict(ck)
            for p in range(P):  # the re-dispatched learner loads the newest globals
                g = syncer.global_fragment(p)
                if g.version > lrn.adopted_versions[p]:
                    lrn.adopt(g)
            lrn.incarnation = s.incarnation
        s.learner = lrn
        s.up = True
        s.steps_since_ckpt = 0
        run.marks.append({"t": t, "kind": "recovered", "learner": i})
        if resend:
            for c in lrn.flush():
                send_contribution(i, c, t)
        if sync and lrn.outstanding(0):
            s.waiting, s.wait_since = True, t
        else:
            start_step(i, t)
        arm_failure(i, t)

    while q and not run.finished():
        t, _, kind, d = q.pop()
        clock.t = run.t = t
        if t < last_t:
            raise RuntimeError("event queue went back in time")
        last_t = t
        if kind == "step":
            i = d["i"]
            s = slots[i]
            if d["inc"] != s.incarnation or not s.up:
                continue
            lrn = s.learner
            lrn.step()
            busy = t - s.step_start
            run.ledgers[i].pending += busy
            s.window_steps += 1
            s.window_busy += busy
            s.steps_since_ckpt += 1
            run.steps_done += 1
            due = lrn.due_contributions()
            for c in due:
                send_contribution(i, c, t)
            if due:
                run.ledgers[i].commit()
                checkpoint(s)
            if sync and lrn.outstanding(0):
                s.waiting, s.wait_since = True, t
                update_stall(t)
            else:
                start_step(i, t)
            run.maybe_eval(global_state)
        elif kind == "contrib":
            c = Contribution.from_bytes(d["blob"], expected[d["fragment"]])
            res = syncer.submit(c)
            if not res.accepted:
                kind_ = res.reason.split(":", 1)[0]
                refused[kind_] = refused.get(kind_, 0) + 1
            if not res.accepted and kind_ == "stale":
                # the work behind a stale contribution never reaches the model: waste (a fenced
                # one is re-sent by the new incarnation, whose checkpoint still holds that progress)
                lost = min(run.ledgers[d["i"]].useful, c.inner_steps * step_time[d["i"]] / P)
                run.ledgers[d["i"]].useful -= lost
                run.ledgers[d["i"]].wasted += lost
            try_merge(t)
        elif kind == "check":
            scheduled_checks.discard((d["p"], t))
            try_merge(t)
        elif kind == "global":
            s = slots[d["i"]]
            downloading.discard((d["i"], d["fragment"]))
            if d["inc"] != s.incarnation or not s.up:
                fetch(d["i"], d["fragment"], t)  # a download for an older incarnation: start afresh
                continue
            gs = [GlobalFragment.from_bytes(b, expected[d["fragment"]]) for b in d["blobs"]]
            applies = not gs[0].is_update or gs[0].base_version == s.learner.adopted_versions[d["fragment"]]
            if applies and (s.learner.adopt_updates(gs) if gs[0].is_update else s.learner.adopt(gs[0])):
                # checkpoint after adopting too, so a restart does not re-apply merged progress
                run.ledgers[d["i"]].commit()
                checkpoint(s)
            fetch(d["i"], d["fragment"], t)  # a newer version was merged meanwhile
            if s.waiting and not s.learner.outstanding(0):
                run.ledgers[d["i"]].idle += t - s.wait_since
                s.waiting = False
                start_step(d["i"], t)
                update_stall(t)
        elif kind == "fail":
            i = d["i"]
            s = slots[i]
            if d["inc"] != s.incarnation or not s.up:
                continue
            go_down(i, t, "failure")
            q.push(t + rec.D, "up", i=i, inc=s.incarnation)
            update_stall(t)
        elif kind == "kill":
            i = d["i"]
            if slots[i].up:
                go_down(i, t, "failure")  # never re-dispatched
            slots[i].incarnation += 1  # and nothing scheduled for it fires any more
            update_stall(t)
        elif kind == "poolfail":
            slug = d["slug"]
            until = run.sched.pool_down_until(slug, t) or t
            run.marks.append({"t": t, "kind": "pool failure", "pool": slug})
            downs = [i for i, isl in enumerate(run.islands) if isl.pool.slug == slug and slots[i].up]
            for i in downs:
                go_down(i, t, "failure")
            moved = set()
            if rebalance and downs:
                # the rebalancer re-dispatches the pool's learners to free slots elsewhere
                infos, chips = _pool_infos(run, t)
                for pi in infos:
                    if pi.slug == slug:
                        pi.state = "disabled"
                lost = [LearnerStatus(i, slug, devices=run.islands[i].chips, alive=False) for i in downs]
                for m in plan_moves(
                    lost,
                    infos,
                    "time",
                    model_flops_per_token=spec.model.flops_per_token,
                    devices_per_learner=chips,
                    model_memory_gib=0.0,
                ):
                    if run.pools[m.to_pool].spare_slots >= 1:
                        _relocate(run, m.learner, m.to_pool, step_time, m.reason, t)
                        moved.add(m.learner)
            for i in downs:
                up_at = t + rec.D if i in moved else max(t + rec.D, until)
                q.push(up_at, "up", i=i, inc=slots[i].incarnation)
            q.push(run.sched.next_pool_failure(slug, t), "poolfail", slug=slug)
            update_stall(t)
        elif kind == "up":
            i = d["i"]
            if d["inc"] != slots[i].incarnation or slots[i].up:
                continue
            come_up(i, t)
            update_stall(t)
        elif kind == "rebalance":
            _rebalance(
                run, slots, t, step_time, resize_work, plan_moves, LearnerStatus, q, go_down, spec, cfg
            )
            q.push(t + min(step_time) * (spec.rebalance_every or cfg.inner_steps), "rebalance")
            update_stall(t)
    stuck = not q and not run.finished()  # nothing left to happen and the budget is not reached: deadlock
    if stuck:
        run.limited = True
        run.marks.append({"t": run.t, "kind": "stuck"})
    # close the ledgers at the end
    t = run.t
    for i, s in enumerate(slots):
        if s.up and not s.waiting:
            run.ledgers[i].pending += max(0.0, t - s.step_start)
        elif s.up:
            run.ledgers[i].idle += t - s.wait_since
        else:
            run.ledgers[i].down += t - s.down_since
        run.ledgers[i].commit()
    if run.final_loss is None:
        run.record(run.evaluate_state(global_state()))
    return run.result(
        {
            "merges": merges,
            "refused": {**refused, **syncer.rejections},
            "versions": dict(syncer.versions),
            "stuck": stuck,
            "skipped_sends": sum(s.learner.skipped_sends for s in slots),
        }
    )


def _declared_fragment_params(declared: float, model, cfg: TrainConfig) -> list[float]:
    """Declared parameters per fragment: the proxy's fragment shares applied to the declared size."""
    from trainer.fragments import make_fragments

    frags = make_fragments(model, cfg.fragments, cfg.fragment_mode)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(sizes.values())
    return [declared * sum(sizes[n] for n in f) / total for f in frags]


def _snapshot(learner) -> dict:
    """A learner checkpoint in memory (`state_dict` copies every tensor, the optimizer's too)."""
    return learner.state_dict()


def _pool_infos(run, t: float) -> tuple[list, dict[str, int]]:
    """PoolInfo for the policy: free devices = spare learner slots x chips of a learner island."""
    from trainer.placement import PoolInfo

    pools, chips = [], {}
    for p in run.pools.values():
        a = p.acc
        n = max((isl.chips for isl in run.islands if isl.pool.slug == p.slug), default=max(run.spec.chips))
        chips[p.slug] = n
        pools.append(
            PoolInfo(
                p.slug,
                a.slug,
                a.peak_bf16_tflops,
                a.memory_gib,
                a.tdp_watts,
                a.cost_per_device_hour,
                p.spare_slots * n,
                p.link_gbps,
                p.latency_ms,
                speed_factor=p.speed_factor,
                mfu=a.mfu,
                state="disabled" if run.sched.pool_down_until(p.slug, t) else "active",
            )
        )
    return pools, chips


def _relocate(run, i: int, to: str, step_time: list, reason: str, t: float) -> None:
    old, new = run.islands[i].pool, run.pools[to]
    new.spare_slots -= 1
    run.pools[old.slug].spare_slots += 1
    run.islands[i] = Island(i, new, run.islands[i].chips)
    step_time[i] = run.islands[i].step_time(run.spec.model)
    run.moves.append({"t": t, "learner": i, "from": old.slug, "to": to, "reason": reason})


def _rebalance(
    run, slots, t, step_time, resize_work, plan_moves, LearnerStatus, q, go_down, spec, cfg
) -> None:
    """DyLU work sizes from measured throughput, then moves to better pools with free slots."""
    tput = {}
    for i, s in enumerate(slots):
        if s.up and s.window_steps:
            tput[i] = s.window_steps * spec.model.tokens_per_step / s.window_busy
        s.window_steps, s.window_busy = 0, 0.0
    if tput:
        sizes = resize_work(tput, cfg.inner_steps)
        for i, h in sizes.items():
            if slots[i].learner.work_size != h:
                slots[i].learner.set_work_size(h)
                run.marks.append({"t": t, "kind": "work size", "learner": i, "H": h})
    pools, chips = _pool_infos(run, t)
    status = [
        LearnerStatus(
            i, run.islands[i].pool.slug, tokens_per_s=tput.get(i), devices=run.islands[i].chips, alive=True
        )
        for i, s in enumerate(slots)
        if s.up
    ]
    if not status:
        return
    moves = plan_moves(
        status,
        pools,
        "time",
        model_flops_per_token=spec.model.flops_per_token,
        min_gain=spec.min_move_gain,
        devices_per_learner=chips,
        model_memory_gib=0.0,
    )
    for m in moves:
        i = m.learner
        s = slots[i]
        if not s.up:
            continue
        if run.pools[m.to_pool].spare_slots < 1:
            continue
        # checkpoint now (nothing is lost), move, come back after the re-dispatch time
        s.ckpt = _snapshot(s.learner)
        run.ledgers[i].commit()
        s.steps_since_ckpt = 0
        go_down(i, t, "move")
        _relocate(run, i, m.to_pool, step_time, m.reason, t)
        q.push(t + spec.recovery.redispatch_s, "up", i=i, inc=s.incarnation)


def run_strategy(spec: SimSpec, strategy: str, corpus=None) -> dict:
    """Run one strategy of `spec`; returns the result row (see `_Run.result`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if corpus is None:
        from trainer.learner import load_corpus

        corpus = load_corpus(spec.train)
    if strategy in ("ddp", "elastic-ddp"):
        return run_dp(spec, corpus, elastic=strategy == "elastic-ddp")
    return run_diloco(spec, corpus, strategy)
