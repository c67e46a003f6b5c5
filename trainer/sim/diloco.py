"""DiLoCo (synchronous) and Decoupled DiLoCo on the simulated fleet: the runtime's protocol loops
(`LearnerLoop`, `SyncerLoop`) stepped on a virtual clock, over the in-memory blob store.

`run_diloco` drives `_DilocoSim`: a virtual-time event queue whose events (an inner step ends,
an upload lands in the store, a global fragment reaches a learner, a merge deadline, a failure,
a recovery, a rebalance) each have one handler method. Each learner slot runs a `LearnerLoop`
(one `tick()` per inner step) whose store is a `LearnerWire` (uploads and downloads cross the
pool's link model); the syncer is a `SyncerLoop` with an in-memory host, ticked whenever an
upload lands or a merge deadline passes. So contributions, checkpoints, resume points, fencing
(the loop's token-range rule) and the ledger are the production protocol; the simulator only
decides when things happen, and injects failures and recoveries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.clock import ManualClock
from trainer.config import TrainConfig
from trainer.fragments import make_fragments
from trainer.learner import Learner
from trainer.models import build_model
from trainer.runtime import keys
from trainer.runtime.learner_loop import Control, LearnerLoop
from trainer.runtime.memory_host import MemoryHost, MemoryWorld
from trainer.runtime.syncer_host import Commit, LearnerView
from trainer.runtime.syncer_loop import SyncerLoop
from trainer.runtime.writer import InlineWriter
from trainer.sim.events import EventQueue
from trainer.sim.fleet import wire_bytes_per_param
from trainer.sim.moves import rebalance_moves, redispatch_moves, relocate, resize
from trainer.sim.state import SimRun, SimSpec
from trainer.sim.wire import LazyStore, LearnerWire, land
from trainer.syncer import Syncer

JOB = "sim"  # the job's name in blob keys
EPOCH = 1  # the syncer's lease epoch (it never restarts in the simulator)
NEVER = math.inf
NEVER_COMMITS = 2**62  # the syncer loop's evaluation/export interval: the simulator evaluates itself


@dataclass
class _L:
    """Simulator-side state of one learner slot."""

    loop: LearnerLoop
    up: bool = True
    incarnation: int = 0
    waiting: bool = False  # sync DiLoCo: waiting for the merged round
    step_start: float = 0.0
    steps_since_ckpt: int = 0
    window_steps: int = 0  # for measured throughput
    window_busy: float = 0.0
    down_since: float = 0.0
    wait_since: float = 0.0

    @property
    def learner(self) -> Learner:
        return self.loop.learner


def _declared_fragment_params(declared: float, model, cfg: TrainConfig) -> list[float]:
    """Declared parameters per fragment: the proxy's fragment shares applied to the declared size."""
    frags = make_fragments(model, cfg.fragments, cfg.fragment_mode)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(sizes.values())
    return [declared * sum(sizes[n] for n in f) / total for f in frags]


class _LearnerHost:
    """The learner's side of the platform: no control messages; its resume point goes where the
    syncer's host reads it (as the runtime's learner records it in the database)."""

    def __init__(self, world: MemoryWorld, index: int, incarnation: int) -> None:
        self.world, self.index, self.incarnation = world, index, incarnation

    def heartbeat(self, stats: dict) -> Control:
        return Control()

    def resumed(self, point: dict) -> None:
        old = self.world.learners[self.index]
        self.world.learners[self.index] = LearnerView(self.incarnation, dict(point), old.live, old.finished)

    def telemetry(self, msg: dict) -> None:
        pass


class _SimHost(MemoryHost):
    """The syncer's in-memory host, telling the simulator about commits and refusals."""

    def __init__(self, world: MemoryWorld, sim: _DilocoSim) -> None:
        super().__init__(world, EPOCH)
        self.sim = sim

    def committed(self, c: Commit, outer_steps: int, metrics_due: bool) -> None:
        self.sim.on_commit(c)

    def refused(self, ref: keys.ContribRef, reason: str) -> None:
        super().refused(ref, reason)
        self.sim.on_refused(ref, reason)


class _DilocoSim:
    """One DiLoCo run: the event queue, the learner slots and the syncer loop they share."""

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
        self.clock = ManualClock()
        model0 = build_model(cfg.model, cfg.seq_len, cfg.seed, vocab_size=corpus.vocab_size)
        self.comp = cfg.compression
        self.P = cfg.fragments
        self.frag_params = _declared_fragment_params(spec.model.params, model0, cfg)
        self.store = LazyStore()
        self.world = MemoryWorld(M, job=JOB, incarnation=0)
        self.sloop = SyncerLoop(
            Syncer(cfg, model0, self.clock, job=spec.name), self.store,
            _SimHost(self.world, self), job=JOB, epoch=EPOCH, eval_interval=NEVER_COMMITS,
            checkpoint_interval=NEVER_COMMITS, heartbeat_interval=0.0, clock=self.clock,
            metrics_interval=NEVER)
        self.syncer = self.sloop.syncer
        self.step_time = [isl.step_time(spec.model) for isl in run.islands]
        self.q = EventQueue()
        self.slots = [_L(self.new_loop(i, 0)) for i in range(M)]
        self.merges = 0
        self.refused: dict[str, int] = {}
        self.scheduled_checks: set[tuple[int, float]] = set()
        self.max_link_bps = max(link.bytes_per_s for link in run.links.values())
        self.downloading: set[tuple[int, int]] = set()  # (learner, fragment) with a download in flight
        self._xi_sync = self.syncer.xi_sync.value
        self._handlers = {
            "step": self._on_step,
            "land": self._on_land,
            "check": self._on_check,
            "global": self._on_global,
            "fail": self._on_fail,
            "kill": self._on_kill,
            "poolfail": self._on_poolfail,
            "up": self._on_up,
            "rebalance": self._on_rebalance,
        }

    def new_loop(self, i: int, inc: int) -> LearnerLoop:
        """Learner i's `LearnerLoop` as incarnation `inc`, on its wire, stepped by the simulator
        (no polling: downloads arrive as events; a checkpoint after every contribution)."""
        learner = Learner(self.cfg, i, incarnation=inc, corpus=self.corpus, job=self.spec.name,
                          num_learners=self.M)
        wire = LearnerWire(self.store, JOB, self.clock.now, lambda p, t: self.upload(i, p, t), self.land_at)
        return LearnerLoop(learner, wire, job=JOB, index=i, incarnation=inc,
                           host=_LearnerHost(self.world, i, inc), compression=self.comp,
                           heartbeat_interval=NEVER, poll_interval=NEVER, checkpoint_interval=0.0,
                           final_wait=0.0, clock=self.clock, writer=InlineWriter(wire))

    # -- the run ---------------------------------------------------------------------------
    def execute(self) -> dict:
        self._start()
        run, q = self.run, self.q
        last_t = 0.0
        while q and not run.finished():
            t, _, kind, d = q.pop()
            if t < last_t:
                raise RuntimeError("event queue went back in time")
            self.clock.set(t)
            run.t = last_t = t
            self._handlers[kind](t, d)
        return self._finish()

    def _start(self) -> None:
        """Every learner starts at t=0; rebalances, kills and pool failures are scheduled."""
        spec, run, q = self.spec, self.run, self.q
        self.sloop.start()
        for i in range(self.M):
            loop = self.slots[i].loop
            loop.resume()
            loop.begin()
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
        stalled = not ups or (self.sync and all(s.waiting for s in ups) and len(ups) < self.M)
        self.run.stall.set(t, stalled)

    def checkpoint(self, s: _L) -> None:
        """The learner loop writes a checkpoint (it lands behind its uploads in flight)."""
        s.loop.checkpoint()
        s.steps_since_ckpt = 0

    def set_view(self, i: int, live: bool) -> None:
        """What the syncer's host knows of learner i: a new incarnation has no resume point yet.
        Lock-step DiLoCo counts a lost learner as live (its round waits for it); the decoupled
        modes count only running learners (a lost one does not hold the merge rule up)."""
        self.world.learners[i] = LearnerView(self.slots[i].incarnation, None, live or self.sync)

    def wait_or_step(self, i: int, t: float) -> bool:
        """Sync DiLoCo waits for the merged round after sending; returns whether it waits."""
        s = self.slots[i]
        if self.sync and s.learner.outstanding(0):
            s.waiting, s.wait_since = True, t
            return True
        self.start_step(i, t)
        return False

    # -- the wire --------------------------------------------------------------------------
    def upload(self, i: int, p: int, t: float) -> float:
        """Arrival time of learner i's contribution for fragment p, sent up its pool's link now."""
        nbytes = self.frag_params[p] * wire_bytes_per_param(self.comp, self.cfg.compression_density)
        return self.run.links[self.run.islands[i].pool.slug].send(t, nbytes, "up")

    def land_at(self, t: float, key: str, blob) -> None:
        self.q.push(t, "land", key=key, blob=blob)

    def fetch(self, j: int, p: int, t: float) -> None:
        """Learner j pulls the newest version of fragment p (one download per fragment at a time,
        as a learner polling the blob store for the latest key does)."""
        s, syncer = self.slots[j], self.syncer
        have = s.learner.adopted_versions[p]
        if not s.up or (j, p) in self.downloading or syncer.versions[p] <= have:
            return
        # the compressed updates since the version the learner holds while they cost less than
        # the whole fragment (as the runtime's learners fetch them), else the whole fragment
        chain = syncer.global_updates(p, have) or []
        whole_bytes = self.frag_params[p] * wire_bytes_per_param("none")
        down = wire_bytes_per_param(self.cfg.global_compression, self.cfg.compression_density)
        chain_bytes = len(chain) * self.frag_params[p] * down
        nbytes = chain_bytes if chain and chain_bytes < whole_bytes else whole_bytes
        arr = self.run.links[self.run.islands[j].pool.slug].send(t, nbytes, "down")
        self.downloading.add((j, p))
        self.q.push(arr, "global", i=j, inc=s.incarnation, fragment=p, version=syncer.versions[p])

    def tick_syncer(self, t: float) -> None:
        """The syncer loop scans, admits, merges and commits; merge deadlines become events."""
        self._xi_sync = self.syncer.xi_sync.value
        self.sloop.tick()
        for p in range(self.P):
            d = self.syncer.deadline(p)
            if d is not None and d > t and (p, d) not in self.scheduled_checks:
                self.scheduled_checks.add((p, d))
                self.q.push(d, "check", p=p)

    def on_commit(self, c: Commit) -> None:
        """An outer step was committed: learners start downloading it. The engine times its merge
        on the wall clock; in virtual time a merge is instant and its sync time is the fragment's
        transfer over the fastest link (keeps runs deterministic)."""
        syncer = self.syncer
        syncer.xi_sync.value = self._xi_sync
        up = wire_bytes_per_param(self.comp, self.cfg.compression_density)
        syncer.observe(transfer_time=self.frag_params[c.fragment] * up / self.max_link_bps)
        self._xi_sync = syncer.xi_sync.value
        self.merges += 1
        for j in range(self.M):
            self.fetch(j, c.fragment, self.clock.now())

    def on_refused(self, ref: keys.ContribRef, reason: str) -> None:
        """The work behind a stale contribution never reaches the model: waste (a zombie's is
        counted as lost when its learner went down)."""
        kind = reason.split(":", 1)[0]
        self.refused[kind] = self.refused.get(kind, 0) + 1
        if kind == "stale":
            led = self.run.ledgers[ref.learner]
            steps = (ref.end - ref.start) / (self.cfg.batch_size * self.cfg.seq_len)
            lost = min(led.useful, steps * self.step_time[ref.learner] / self.P)
            led.useful -= lost
            led.wasted += lost

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
        s.incarnation += 1  # the watchdog's new incarnation: the old one's sends are fenced by range
        self.set_view(i, live=False)
        run.failures += why != "move"
        run.marks.append({"t": t, "kind": why, "learner": i})

    def come_up(self, i: int, t: float) -> None:
        """The re-dispatched learner resumes from its newest checkpoint in the store (as the
        incarnation that wrote it, so its sends are known), adopts the newest globals, and
        tells the syncer's host where it resumed."""
        s = self.slots[i]
        self.run.ledgers[i].down += t - s.down_since
        self.set_view(i, live=True)
        s.loop = loop = self.new_loop(i, s.incarnation)
        for p, v in self.sloop.head.items():  # it loads the newest globals as it starts
            loop.store.arrived(p, v, self.sloop.head_epochs.get(p, EPOCH))
        loop.resume()
        loop.begin()
        s.up = True
        s.steps_since_ckpt = 0
        self.run.marks.append({"t": t, "kind": "recovered", "learner": i})
        self.tick_syncer(t)  # its predecessor's sends up to the resume point count again
        self.wait_or_step(i, t)
        self.arm_failure(i, t)

    # -- event handlers --------------------------------------------------------------------
    def _on_step(self, t: float, d: dict) -> None:
        """An inner step ends: the loop sends what is due (and checkpoints); the next step or wait."""
        run = self.run
        i = d["i"]
        s = self.slots[i]
        if d["inc"] != s.incarnation or not s.up:
            return
        sent = s.loop.contributions
        s.loop.tick()
        busy = t - s.step_start
        run.ledgers[i].pending += busy
        s.window_steps += 1
        s.window_busy += busy
        s.steps_since_ckpt += 1
        run.steps_done += 1
        if s.loop.contributions > sent:
            run.ledgers[i].commit()
            s.steps_since_ckpt = 0  # the loop checkpointed right behind its contributions
        if self.wait_or_step(i, t):
            self.update_stall(t)
        run.maybe_eval(self.syncer.global_state)

    def _on_land(self, t: float, d: dict) -> None:
        """An upload lands in the store; a contribution wakes the syncer loop."""
        land(self.store, d["key"], d["blob"])
        if keys.parse_contrib_key(d["key"]) is not None:
            self.tick_syncer(t)

    def _on_check(self, t: float, d: dict) -> None:
        """A fragment's merge deadline (grace window) passes."""
        self.scheduled_checks.discard((d["p"], t))
        self.tick_syncer(t)

    def _on_global(self, t: float, d: dict) -> None:
        """A global fragment (or its chain of updates) reaches a learner, which adopts it."""
        i, p = d["i"], d["fragment"]
        s = self.slots[i]
        self.downloading.discard((i, p))
        if d["inc"] != s.incarnation or not s.up:
            self.fetch(i, p, t)  # a download for an older incarnation: start afresh
            return
        s.loop.store.arrived(p, d["version"], self.sloop.head_epochs.get(p, EPOCH))
        if s.loop.poll_globals():
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
            self.checkpoint(s)
            run.ledgers[i].commit()
            self.go_down(i, t, "move")
            relocate(run, i, m.to_pool, self.step_time, m.reason, t)
            self.q.push(t + self.spec.recovery.redispatch_s, "up", i=i, inc=s.incarnation)
        every = self.spec.rebalance_every or self.cfg.inner_steps
        self.q.push(t + min(self.step_time) * every, "rebalance")
        self.update_stall(t)


def run_diloco(spec: SimSpec, corpus, mode: str) -> dict:
    """mode: 'diloco' (sync), 'decoupled', 'decoupled+rebalance'."""
    return _DilocoSim(spec, corpus, mode).execute()
