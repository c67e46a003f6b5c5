"""DiLoCo (synchronous) and Decoupled DiLoCo on the simulated fleet: event-driven, with the real
Learner and Syncer, the engine's wire format and the rebalancing policy.

`run_diloco` drives `_DilocoSim`: a virtual-time event queue whose events (an inner step ends,
a contribution or a global fragment arrives, a merge deadline, a failure, a recovery, a rebalance)
each have one handler method. The simulator only decides when things happen; what happens is
the engine's code.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from trainer.config import TrainConfig
from trainer.fragments import make_fragments
from trainer.learner import Learner
from trainer.models import build_model
from trainer.protocol import Contribution, GlobalFragment
from trainer.sim.fleet import WIRE_BYTES_PER_PARAM
from trainer.sim.moves import rebalance_moves, redispatch_moves, relocate, resize
from trainer.sim.state import SimRun, SimSpec
from trainer.syncer import Syncer


class _Queue:
    """Events ordered by virtual time, then by the order they were pushed."""

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


def _declared_fragment_params(declared: float, model, cfg: TrainConfig) -> list[float]:
    """Declared parameters per fragment: the proxy's fragment shares applied to the declared size."""
    frags = make_fragments(model, cfg.fragments, cfg.fragment_mode)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(sizes.values())
    return [declared * sum(sizes[n] for n in f) / total for f in frags]


def _snapshot(learner) -> dict:
    """A learner checkpoint in memory (`state_dict` copies every tensor, the optimizer's too)."""
    return learner.state_dict()


class _DilocoSim:
    """One DiLoCo run: the event queue, the learner slots and the syncer they share."""

    def __init__(self, spec: SimSpec, corpus, mode: str) -> None:
        self.spec = spec
        self.corpus = corpus
        self.sync = mode == "diloco"
        self.rebalance = mode == "decoupled+rebalance"
        self.M = M = spec.learners
        cfg = spec.train
        if self.sync:
            cfg = cfg.replace(fragments=1, quorum=M)
        self.cfg = cfg
        self.run = run = SimRun(spec, mode, corpus)
        self.rec = spec.recovery
        self.clock = VirtualClock()
        model0 = build_model(cfg.model, cfg.seq_len, cfg.seed, vocab_size=corpus.vocab_size)
        self.syncer = Syncer(cfg, model0, self.clock, job=spec.name)
        self.comp = cfg.compression
        self.P = cfg.fragments
        self.frag_params = _declared_fragment_params(spec.model.params, model0, cfg)
        self.slots = [_L(self.new_learner(i, 0)) for i in range(M)]
        self.expected = [self.slots[0].learner.expected_shapes(p) for p in range(self.P)]
        self.q = _Queue()
        self.merges = 0
        self.refused: dict[str, int] = {}
        self.scheduled_checks: set[tuple[int, float]] = set()
        self.step_time = [isl.step_time(spec.model) for isl in run.islands]
        self.max_link_bps = max(link.bytes_per_s for link in run.links.values())
        self.downloading: set[tuple[int, int]] = set()  # (learner, fragment) with a download in flight
        self._handlers = {
            "step": self._on_step,
            "contrib": self._on_contrib,
            "check": self._on_check,
            "global": self._on_global,
            "fail": self._on_fail,
            "kill": self._on_kill,
            "poolfail": self._on_poolfail,
            "up": self._on_up,
            "rebalance": self._on_rebalance,
        }

    def new_learner(self, i: int, inc: int) -> Learner:
        return Learner(
            self.cfg, i, incarnation=inc, corpus=self.corpus, job=self.spec.name, num_learners=self.M
        )

    # -- the run ---------------------------------------------------------------------------
    def execute(self) -> dict:
        self._start()
        run, q = self.run, self.q
        last_t = 0.0
        while q and not run.finished():
            t, _, kind, d = q.pop()
            self.clock.t = run.t = t
            if t < last_t:
                raise RuntimeError("event queue went back in time")
            last_t = t
            self._handlers[kind](t, d)
        return self._finish()

    def _start(self) -> None:
        """Every learner starts at t=0; rebalances, kills and pool failures are scheduled."""
        spec, run, q = self.spec, self.run, self.q
        for i in range(self.M):
            self.checkpoint(self.slots[i])
            self.start_step(i, 0.0)
            self.arm_failure(i, 0.0)
        if self.rebalance:
            fastest = min(self.step_time)
            q.push(fastest * (spec.rebalance_every or self.cfg.inner_steps), "rebalance")
        for i, tk in spec.kill.items():
            q.push(tk, "kill", i=i)
        for slug in run.pools:
            f = run.sched.next_pool_failure(slug, 0.0)
            if f < math.inf:
                q.push(f, "poolfail", slug=slug)
        run.maybe_eval(self.syncer.global_state)

    def _finish(self) -> dict:
        """Close the ledgers at the end, evaluate if the budget was never reached, report."""
        run, syncer, slots = self.run, self.syncer, self.slots
        stuck = not self.q and not run.finished()  # nothing left to happen, budget not reached: deadlock
        if stuck:
            run.limited = True
            run.marks.append({"t": run.t, "kind": "stuck"})
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
            run.record(run.evaluate_state(syncer.global_state()))
        return run.result(
            {
                "merges": self.merges,
                "refused": {**self.refused, **syncer.rejections},
                "versions": dict(syncer.versions),
                "stuck": stuck,
                "skipped_sends": sum(s.learner.skipped_sends for s in slots),
            }
        )

    # -- scheduling helpers ----------------------------------------------------------------
    def start_step(self, i: int, t: float) -> None:
        s = self.slots[i]
        s.step_start = t
        dur = self.step_time[i] / self.run.sched.speed(i, t)
        self.q.push(t + dur, "step", i=i, inc=s.incarnation)

    def arm_failure(self, i: int, t: float) -> None:
        f = self.run.sched.next_failure(i, t)
        if f < math.inf:
            self.q.push(f, "fail", i=i, inc=self.slots[i].incarnation)

    def update_stall(self, t: float) -> None:
        ups = [s for s in self.slots if s.up]
        self.syncer.set_expected_learners(max(1, len(ups)))
        stalled = not ups or (self.sync and all(s.waiting for s in ups) and len(ups) < self.M)
        self.run.stall.set(t, stalled)

    def checkpoint(self, s: _L) -> None:
        s.ckpt = _snapshot(s.learner)
        s.ckpt_steps = s.learner.inner_steps
        s.steps_since_ckpt = 0

    def wait_or_step(self, i: int, t: float) -> bool:
        """Sync DiLoCo waits for the merged round after sending; returns whether it waits."""
        s = self.slots[i]
        if self.sync and s.learner.outstanding(0):
            s.waiting, s.wait_since = True, t
            return True
        self.start_step(i, t)
        return False

    # -- the wire --------------------------------------------------------------------------
    def fetch(self, j: int, p: int, t: float) -> None:
        """Learner j pulls the newest version of fragment p (one download per fragment at a time,
        as a learner polling the blob store for the latest key does)."""
        s, syncer = self.slots[j], self.syncer
        if not s.up or (j, p) in self.downloading or syncer.versions[p] <= s.learner.adopted_versions[p]:
            return
        # the compressed updates since the version the learner holds while they cost less than
        # the whole fragment (as the runtime's learners fetch them), else the whole fragment
        chain = syncer.global_updates(p, s.learner.adopted_versions[p]) or []
        whole_bytes = self.frag_params[p] * WIRE_BYTES_PER_PARAM["none"]
        chain_bytes = len(chain) * self.frag_params[p] * WIRE_BYTES_PER_PARAM[self.cfg.global_compression]
        if chain and chain_bytes < whole_bytes:
            blobs, nbytes = chain, chain_bytes
        else:
            blobs, nbytes = [syncer.global_fragment(p).to_bytes("none")], whole_bytes
        arr = self.run.links[self.run.islands[j].pool.slug].send(t, nbytes, "down")
        self.downloading.add((j, p))
        self.q.push(arr, "global", i=j, inc=s.incarnation, blobs=blobs, fragment=p)

    def send_fragment_down(self, g, t: float) -> None:
        for j in range(len(self.slots)):
            self.fetch(j, g.fragment, t)

    def send_contribution(self, i: int, c, t: float) -> None:
        blob = c.to_bytes(self.comp)
        nbytes = self.frag_params[c.fragment] * WIRE_BYTES_PER_PARAM[self.comp]
        arr = self.run.links[self.run.islands[i].pool.slug].send(t, nbytes, "up")
        self.q.push(arr, "contrib", i=i, blob=blob, fragment=c.fragment)

    def try_merge(self, t: float) -> None:
        syncer = self.syncer
        for p in syncer.due(t):
            # the syncer times its merge on the wall clock; in virtual time a merge is instant, and
            # its sync time is the fragment's transfer over the fastest link (keeps runs deterministic)
            before = syncer.xi_sync.value
            res = syncer.merge(p)
            syncer.xi_sync.value = before
            wire_bytes = self.frag_params[p] * WIRE_BYTES_PER_PARAM[self.comp]
            syncer.observe(transfer_time=wire_bytes / self.max_link_bps)
            self.merges += 1
            self.send_fragment_down(res.global_fragment, t)
        for p in range(self.P):
            d = syncer.deadline(p)
            if d is not None and d > t and (p, d) not in self.scheduled_checks:
                self.scheduled_checks.add((p, d))
                self.q.push(d, "check", p=p)

    # -- failures and recovery -------------------------------------------------------------
    def go_down(self, i: int, t: float, why: str) -> None:
        s = self.slots[i]
        run = self.run
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
        self.syncer.fence(i, s.incarnation)  # whatever the old incarnation still has in flight is refused
        run.failures += why != "move"
        run.marks.append({"t": t, "kind": why, "learner": i})

    def _restore(self, i: int, s: _L, resend: bool) -> Learner:
        """The re-dispatched learner, loaded from its slot's checkpoint."""
        ck = s.ckpt
        if resend:
            # lock-step, round not merged: the payload this checkpoint sent was fenced out with the
            # old incarnation, so the new incarnation sends the progress it holds again at once
            lrn = self.new_learner(i, s.incarnation)
            lrn.load_state_dict(ck)
            return lrn
        # Restore as the incarnation that wrote the checkpoint, so outstanding sends are known;
        # adopting the newest globals then mixes only the progress made since those sends (no
        # re-application of progress the syncer already merged); then take the new incarnation.
        lrn = self.new_learner(i, int(ck["incarnation"]))
        lrn.load_state_dict(ck)
        for p in range(self.P):  # the re-dispatched learner loads the newest globals
            g = self.syncer.global_fragment(p)
            if g.version > lrn.adopted_versions[p]:
                lrn.adopt(g)
        lrn.incarnation = s.incarnation
        return lrn

    def come_up(self, i: int, t: float) -> None:
        s = self.slots[i]
        self.run.ledgers[i].down += t - s.down_since
        self.syncer.fence(i, s.incarnation)
        resend = self.sync and int(s.ckpt["adopted_versions"][0]) == self.syncer.versions[0]
        lrn = self._restore(i, s, resend)
        s.learner = lrn
        s.up = True
        s.steps_since_ckpt = 0
        self.run.marks.append({"t": t, "kind": "recovered", "learner": i})
        if resend:
            for c in lrn.flush():
                self.send_contribution(i, c, t)
        self.wait_or_step(i, t)
        self.arm_failure(i, t)

    # -- event handlers --------------------------------------------------------------------
    def _on_step(self, t: float, d: dict) -> None:
        """An inner step ends: send what is due (and checkpoint), then the next step or wait."""
        run = self.run
        i = d["i"]
        s = self.slots[i]
        if d["inc"] != s.incarnation or not s.up:
            return
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
            self.send_contribution(i, c, t)
        if due:
            run.ledgers[i].commit()
            self.checkpoint(s)
        if self.wait_or_step(i, t):
            self.update_stall(t)
        run.maybe_eval(self.syncer.global_state)

    def _on_contrib(self, t: float, d: dict) -> None:
        """A contribution reaches the syncer: decoded, validated, submitted; merge what is due."""
        c = Contribution.from_bytes(d["blob"], self.expected[d["fragment"]])
        res = self.syncer.submit(c)
        if not res.accepted:
            reason = res.reason.split(":", 1)[0]
            self.refused[reason] = self.refused.get(reason, 0) + 1
            if reason == "stale":
                # the work behind a stale contribution never reaches the model: waste (a fenced
                # one is re-sent by the new incarnation, whose checkpoint still holds that progress)
                led = self.run.ledgers[d["i"]]
                lost = min(led.useful, c.inner_steps * self.step_time[d["i"]] / self.P)
                led.useful -= lost
                led.wasted += lost
        self.try_merge(t)

    def _on_check(self, t: float, d: dict) -> None:
        """A fragment's merge deadline (grace window) passes."""
        self.scheduled_checks.discard((d["p"], t))
        self.try_merge(t)

    def _on_global(self, t: float, d: dict) -> None:
        """A global fragment (or its chain of updates) reaches a learner, which adopts it."""
        i, p = d["i"], d["fragment"]
        s = self.slots[i]
        self.downloading.discard((i, p))
        if d["inc"] != s.incarnation or not s.up:
            self.fetch(i, p, t)  # a download for an older incarnation: start afresh
            return
        gs = [GlobalFragment.from_bytes(b, self.expected[p]) for b in d["blobs"]]
        applies = not gs[0].is_update or gs[0].base_version == s.learner.adopted_versions[p]
        if applies and (s.learner.adopt_updates(gs) if gs[0].is_update else s.learner.adopt(gs[0])):
            # checkpoint after adopting too, so a restart does not re-apply merged progress
            self.run.ledgers[i].commit()
            self.checkpoint(s)
        self.fetch(i, p, t)  # a newer version was merged meanwhile
        if s.waiting and not s.learner.outstanding(0):
            self.run.ledgers[i].idle += t - s.wait_since
            s.waiting = False
            self.start_step(i, t)
            self.update_stall(t)

    def _on_fail(self, t: float, d: dict) -> None:
        """A learner island fails; it is re-dispatched after the recovery time D."""
        i = d["i"]
        s = self.slots[i]
        if d["inc"] != s.incarnation or not s.up:
            return
        self.go_down(i, t, "failure")
        self.q.push(t + self.rec.D, "up", i=i, inc=s.incarnation)
        self.update_stall(t)

    def _on_kill(self, t: float, d: dict) -> None:
        """A learner dies for good (what-if)."""
        i = d["i"]
        if self.slots[i].up:
            self.go_down(i, t, "failure")  # never re-dispatched
        self.slots[i].incarnation += 1  # and nothing scheduled for it fires any more
        self.update_stall(t)

    def _on_poolfail(self, t: float, d: dict) -> None:
        """A whole pool fails: its learners go down, and come back when it does, or sooner
        elsewhere when the rebalancer re-dispatches them to free slots in other pools."""
        run, slots = self.run, self.slots
        slug = d["slug"]
        until = run.sched.pool_down_until(slug, t) or t
        run.marks.append({"t": t, "kind": "pool failure", "pool": slug})
        downs = [i for i, isl in enumerate(run.islands) if isl.pool.slug == slug and slots[i].up]
        for i in downs:
            self.go_down(i, t, "failure")
        moved = set()
        if self.rebalance and downs:
            for m in redispatch_moves(run, slug, downs, t):
                if run.pools[m.to_pool].spare_slots >= 1:
                    relocate(run, m.learner, m.to_pool, self.step_time, m.reason, t)
                    moved.add(m.learner)
        for i in downs:
            up_at = t + self.rec.D if i in moved else max(t + self.rec.D, until)
            self.q.push(up_at, "up", i=i, inc=slots[i].incarnation)
        self.q.push(run.sched.next_pool_failure(slug, t), "poolfail", slug=slug)
        self.update_stall(t)

    def _on_up(self, t: float, d: dict) -> None:
        """A re-dispatched learner comes back."""
        i = d["i"]
        if d["inc"] != self.slots[i].incarnation or self.slots[i].up:
            return
        self.come_up(i, t)
        self.update_stall(t)

    def _on_rebalance(self, t: float, d: dict) -> None:
        """DyLU work sizes from measured throughput, then moves to better pools with free slots."""
        run, slots = self.run, self.slots
        tput = resize(run, slots, t, self.cfg.inner_steps)
        for m in rebalance_moves(run, slots, t, tput):
            i = m.learner
            s = slots[i]
            if not s.up or run.pools[m.to_pool].spare_slots < 1:
                continue
            # checkpoint now (nothing is lost), move, come back after the re-dispatch time
            s.ckpt = _snapshot(s.learner)
            run.ledgers[i].commit()
            s.steps_since_ckpt = 0
            self.go_down(i, t, "move")
            relocate(run, i, m.to_pool, self.step_time, m.reason, t)
            self.q.push(t + self.spec.recovery.redispatch_s, "up", i=i, inc=s.incarnation)
        every = self.spec.rebalance_every or self.cfg.inner_steps
        self.q.push(t + min(self.step_time) * every, "rebalance")
        self.update_stall(t)


def run_diloco(spec: SimSpec, corpus, mode: str) -> dict:
    """mode: 'diloco' (sync), 'decoupled', 'decoupled+rebalance'."""
    return _DilocoSim(spec, corpus, mode).execute()
