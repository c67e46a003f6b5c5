"""The syncer's side of the protocol (`SyncerLoop`), run against two hosts: an in-memory one with
no database, and the Django host on Postgres. Real engine objects, small tensors, a manual clock;
contributions are written into the store by hand as learners write them."""
from __future__ import annotations

import pytest
import torch

from trainer.clock import ManualClock
from trainer.config import TrainConfig
from trainer.protocol import Contribution
from trainer.runtime import keys
from trainer.runtime.memory_host import MemoryWorld as _MemoryWorld
from trainer.runtime.syncer_loop import LeaseLost, SyncerLoop
from trainer.syncer import Syncer
from trainer.transport import MemoryStore

SHAPES = {"a.weight": (4, 3), "b.bias": (5,)}
NEVER = 10**9  # evaluation / checkpoint interval: not part of these cases


class Crash(BaseException):
    """The syncer process died here (a BaseException: no `except Exception` in the loop survives it)."""


def _who(contributor: dict) -> tuple[int, int, int]:
    """(learner, incarnation, first token) of one contributor record of an outer step."""
    return contributor["learner"], contributor["incarnation"], contributor["ranges"][0][0]


# ---------------------------------------------------------------------------------- in memory
class MemoryWorld(_MemoryWorld):
    """The in-memory world of trainer.runtime.memory_host, with the protocol tests' view of it."""

    def steps(self) -> list[tuple[int, list]]:
        return [(r.version, sorted(_who(c) for c in r.contributors)) for r in self.rows]


# ---------------------------------------------------------------------------------- Django
class DjangoWorld:
    """The same questions asked of the database the Django host writes."""

    def __init__(self, owner, settings, tmp_path, learners: int = 2):
        from apps.coordinator.models import LearnerRuntime, SyncerLease
        from apps.jobs import state as st
        from apps.jobs.models import Job, Learner

        from .conftest import TINY

        settings.BLOB_STORE_URL = f"file://{tmp_path / 'blobs'}"  # exports only; the loop gets its own
        self.job_row = Job.objects.create(owner=owner, name="protocol", status=st.RUNNING,
                                          spec={**TINY, "learners": learners, "quorum": 2, "fragments": 1})
        self.job = self.job_row.pk
        for i in range(learners):
            LearnerRuntime.objects.create(learner=Learner.objects.create(
                job=self.job_row, index=i, incarnation=1, state=Learner.State.RUNNING))
        SyncerLease.objects.create(job=self.job_row, epoch=1)

    def host(self, epoch: int):
        from apps.coordinator.models import SyncerLease
        from apps.coordinator.syncer import DjangoSyncerHost

        SyncerLease.objects.filter(job_id=self.job).update(epoch=epoch)  # what the watchdog does
        return DjangoSyncerHost(self.job, epoch, "w")

    def restart_learner(self, i: int, incarnation: int, resume_at: int | None) -> None:
        from apps.coordinator.models import LearnerRuntime
        from apps.jobs.models import Learner

        Learner.objects.filter(job_id=self.job, index=i).update(incarnation=incarnation)
        point = None if resume_at is None else {"tokens": resume_at, "frag_pos": {"0": resume_at}}
        LearnerRuntime.objects.filter(learner__job_id=self.job, learner__index=i).update(resume_point=point)

    def learner_done(self, i: int) -> None:
        from apps.jobs.models import Learner

        Learner.objects.filter(job_id=self.job, index=i).update(state=Learner.State.DONE)

    def pause(self) -> None:
        from apps.jobs import state as st
        from apps.jobs.models import Job

        Job.objects.filter(pk=self.job).update(status=st.PAUSED)

    def ended(self) -> tuple[list[tuple[str, int]], bool]:
        from apps.jobs import state as st
        from apps.jobs.models import Checkpoint, Job

        job = Job.objects.get(pk=self.job)
        done = job.status == st.COMPLETED and job.final_val_loss is not None
        return list(Checkpoint.objects.filter(job_id=self.job).values_list("kind", "version")), done

    def steps(self) -> list[tuple[int, list]]:
        from apps.jobs.models import OuterStep

        return [(s.version, sorted(_who(c) for c in s.contributors))
                for s in OuterStep.objects.filter(job_id=self.job).order_by("id")]

    def reasons(self) -> list[str]:
        from apps.jobs.models import Event

        return [e.payload["reason"] for e in Event.objects.filter(job_id=self.job, kind=Event.Kind.REJECTED)
                .order_by("id")]

    def tokens_contributed(self) -> int:
        from apps.jobs.models import Job

        return Job.objects.get(pk=self.job).tokens_contributed


@pytest.fixture(params=["memory", pytest.param("django", marks=pytest.mark.django_db)])
def world(request):
    if request.param == "memory":
        return MemoryWorld()  # plain pytest: no database is set up for these
    return DjangoWorld(request.getfixturevalue("owner"), request.getfixturevalue("settings"),
                       request.getfixturevalue("tmp_path"))


# ---------------------------------------------------------------------------------- the harness
class FaultyStore(MemoryStore):
    """A MemoryStore that dies before the n-th operation `fail(op, key)` picks."""

    def __init__(self):
        super().__init__()
        self.fail = None

    def _maybe(self, op: str, key: str) -> None:
        if self.fail is not None and self.fail(op, key):
            self.fail = None
            raise Crash(f"{op} {key}")

    def put(self, key: str, data: bytes) -> None:
        self._maybe("put", key)
        super().put(key, data)

    def delete(self, key: str) -> None:
        self._maybe("delete", key)
        super().delete(key)


def engine(job, max_staleness: int = 4) -> Syncer:
    cfg = TrainConfig(learners=2, quorum=2, inner_steps=4, fragments=1, outer_lr=0.7, outer_momentum=0.9,
                      max_staleness=max_staleness)
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return Syncer(cfg, init, ManualClock(), job=str(job))


def loop(world, store, epoch: int = 1, **kw) -> SyncerLoop:
    lp = SyncerLoop(engine(world.job, **kw), store, world.host(epoch), job=world.job, epoch=epoch,
                    eval_interval=NEVER, checkpoint_interval=NEVER, heartbeat_interval=0.0,
                    clock=ManualClock())
    lp.start()
    return lp


def put(world, store, learner: int, incarnation: int, start: int, end: int, base: int = 0) -> str:
    """A learner's contribution for tokens [start, end): its pseudo-gradient depends on them only."""
    g = torch.Generator().manual_seed(1000 * learner + start)
    tensors = {n: torch.randn(s, generator=g) * 1e-2 for n, s in SHAPES.items()}
    c = Contribution(job=str(world.job), learner=learner, incarnation=incarnation, fragment=0,
                     base_version=base, tokens=end - start, inner_steps=4, tensors=tensors)
    key = keys.contrib_key(world.job, learner, incarnation, 0, base, start, end)
    store.put(key, c.to_bytes())
    return key


def round_of(world, store, r: int) -> None:
    """Round r: both learners send tokens [100 r, 100 r + 100) on base version r."""
    for i in range(2):
        put(world, store, i, 1, 100 * r, 100 * r + 100, base=r)


def contribs(store) -> list[str]:
    return [k for k in store.list("jobs/") if "/contrib/" in k]


# ---------------------------------------------------------------------------------- cases
def test_each_contribution_is_applied_exactly_once(world):
    store = FaultyStore()
    lp = loop(world, store)
    round_of(world, store, 0)
    assert lp.tick() is None
    assert world.steps() == [(1, [(0, 1, 0), (1, 1, 0)])]
    assert not contribs(store)  # merged blobs are deleted after the commit point
    late = put(world, store, 0, 1, 0, 100, base=0)  # a slow writer puts the same send again
    overlap = put(world, store, 1, 1, 50, 150, base=1)  # overlaps a range already applied
    lp.tick()
    assert len(world.steps()) == 1 and lp.counters["duplicates_refused"] == 1
    assert not store.exists(overlap) and world.reasons() == ["duplicate"]
    assert store.exists(late)  # a key this loop has seen is not read again
    restarted = loop(world, store, epoch=2)  # ... and a restarted one refuses it from the ledger
    restarted.tick()
    assert not store.exists(late) and world.reasons() == ["duplicate", "duplicate"]
    assert len(world.steps()) == 1
    assert restarted.ledger.covered(0, 0) == 100 and restarted.ledger.covered(1, 0) == 100
    assert world.tokens_contributed() == 200


def test_a_zombie_incarnation_is_fenced_and_its_predecessors_earlier_work_kept(world):
    store = FaultyStore()
    lp = loop(world, store)
    kept = put(world, store, 0, 1, 0, 100)  # sent before the crash, before the successor's resume point
    zombie = put(world, store, 1, 1, 0, 100)  # sent after the checkpoint the successor resumed from
    world.restart_learner(1, 2, resume_at=40)
    world.restart_learner(0, 2, resume_at=None)  # successor has not said where it resumes yet
    lp.tick()
    assert lp.counters["zombies_refused"] == 1 and not store.exists(zombie)
    assert store.exists(kept) and kept not in lp.pending  # waits for the resume point
    put(world, store, 1, 9, 40, 120)  # an incarnation newer than the host knows: waits too
    world.restart_learner(0, 2, resume_at=100)
    put(world, store, 0, 2, 100, 160)
    put(world, store, 1, 2, 40, 120)
    lp.tick()
    assert world.steps() == [(1, [(0, 1, 0), (0, 2, 100), (1, 2, 40)])]
    assert lp.ledger.covered(0, 0) == 160 and lp.ledger.covered(1, 0) == 80
    assert world.reasons() == ["zombie"]
    assert contribs(store) == [keys.contrib_key(world.job, 1, 9, 0, 0, 40, 120)]


def test_a_restart_takes_pending_work_back_out_until_the_resume_point_says_it_counts(world):
    """Moved from the engine's fencing test (the engine no longer fences): contributions already
    pending in the round when their learner restarts. Past the successor's resume point they
    are refused as zombies; while the resume point is unknown they leave the round and come
    back once it is known and covers them."""
    store = FaultyStore()
    lp = loop(world, store)  # quorum 2: one learner's contribution stays pending
    zombie = put(world, store, 0, 1, 0, 100)
    lp.tick()
    assert zombie in lp.pending and lp.syncer.pending_count(0) == 1
    world.restart_learner(0, 2, resume_at=40)  # the successor recomputes tokens 40..100
    lp.tick()
    assert lp.syncer.pending_count(0) == 0 and not store.exists(zombie)
    assert world.reasons() == ["zombie"] and lp.counters["zombies_refused"] == 1
    kept = put(world, store, 1, 1, 0, 100)
    lp.tick()
    assert kept in lp.pending
    world.restart_learner(1, 2, resume_at=None)  # restarted, resume point not known yet
    lp.tick()
    assert lp.syncer.pending_count(0) == 0 and store.exists(kept)  # out of the round, not refused
    world.restart_learner(1, 2, resume_at=100)
    put(world, store, 0, 2, 40, 140)
    lp.tick()
    assert world.steps() == [(1, [(0, 2, 40), (1, 1, 0)])]
    assert world.reasons() == ["zombie"]


def test_stale_future_and_invalid_contributions_are_refused(world):
    store = FaultyStore()
    lp = loop(world, store, max_staleness=1)
    for r in range(2):
        round_of(world, store, r)
        lp.tick()
    assert [v for v, _ in world.steps()] == [1, 2]
    put(world, store, 0, 1, 200, 300, base=0)  # two versions behind, max_staleness 1
    put(world, store, 1, 1, 200, 300, base=7)  # a base version the syncer never wrote
    store.put(keys.contrib_key(world.job, 1, 1, 0, 2, 300, 400), b"not a contribution")
    lp.tick()
    reasons = world.reasons()
    assert len(reasons) == 3 and len(world.steps()) == 2
    assert sorted(r.split(":")[0] for r in reasons) == ["future", "invalid", "stale"]
    assert lp.counters["rejected"] == 3 and lp.counters["tokens_rejected"] == 300
    assert not contribs(store)


def test_a_syncer_of_an_old_epoch_commits_nothing(world):
    store = FaultyStore()
    old = loop(world, store)
    round_of(world, store, 0)
    old.tick()
    new = loop(world, store, epoch=2)  # the watchdog gave the lease to a new syncer
    round_of(world, store, 1)
    with pytest.raises(LeaseLost):
        old.tick()
    assert new.tick() is None and [v for v, _ in world.steps()] == [1, 2]


def test_the_tail_merges_short_of_quorum_and_the_job_finishes_once_every_learner_is_done(world):
    store = FaultyStore()
    lp = loop(world, store)
    world.learner_done(1)  # quorum is 2, one learner is left
    put(world, store, 0, 1, 0, 100)
    assert lp.tick() is None and world.steps() == [(1, [(0, 1, 0)])]
    put(world, store, 0, 1, 100, 150, base=1)
    world.learner_done(0)
    assert lp.tick() == "completed"
    assert world.steps() == [(1, [(0, 1, 0)]), (2, [(0, 1, 100)])]  # the last send merged before the end
    assert world.ended() == ([("final", 2)], True)


def test_a_paused_job_stops_the_loop_without_finishing(world):
    store = FaultyStore()
    lp = loop(world, store)
    world.pause()
    put(world, store, 0, 1, 0, 100)
    assert lp.tick() == "stopped: job paused"
    assert world.steps() == [] and store.exists(keys.contrib_key(world.job, 0, 1, 0, 0, 0, 100))
    assert world.ended() == ([], False)


# (op, key part) before which the syncer dies during the second commit, in commit order
CRASH_POINTS = [
    ("put", "/global/"), ("put", "/syncer/"), ("commit", ""), ("committed", ""), ("put", "/head"),
    ("delete", "/contrib/l000"), ("delete", "/contrib/l001"), ("delete", "/syncer/"),
]


@pytest.mark.parametrize("point", CRASH_POINTS,
                         ids=["-".join(filter(None, p)).replace("/", "") for p in CRASH_POINTS])
def test_resume_after_a_crash_between_any_two_steps_of_a_commit(world, point):
    def run(crash: bool):
        store = FaultyStore()
        lp = loop(world, store)
        round_of(world, store, 0)
        lp.tick()
        round_of(world, store, 1)
        if crash:
            arm(lp, store, point)
            with pytest.raises(Crash):
                lp.tick()
            lp = loop(world, store, epoch=2)  # a new syncer from the last committed snapshot
            lp.tick()
        else:
            lp.tick()
        round_of(world, store, 2)
        lp.tick()
        return lp, store

    reference, _ = run(crash=False)
    want_steps = world.steps()
    want_tokens = world.tokens_contributed()
    reset(world)
    lp, store = run(crash=True)
    assert world.steps() == want_steps  # each round once, in order, nothing lost
    assert world.tokens_contributed() == want_tokens
    for n, t in reference.syncer.params.items():
        assert torch.equal(lp.syncer.params[n], t)
    assert lp.ledger.covered(0, 0) == lp.ledger.covered(1, 0) == 300
    assert not contribs(store)
    head, _ = keys.parse_head(store.get(keys.head_key(world.job)))
    assert head == {0: 3}


def arm(lp: SyncerLoop, store: FaultyStore, point: tuple[str, str]) -> None:
    op, part = point
    if op in ("put", "delete"):
        store.fail = lambda o, k: o == op and part in k
        return
    real = lp.host.commit

    def commit(c):
        if op == "commit":
            raise Crash("before the commit transaction")
        real(c)
        raise Crash("after the commit transaction")

    lp.host.commit = commit


def reset(world) -> None:
    """Forget the reference run: a fresh job for the crashed one."""
    if isinstance(world, MemoryWorld):
        world.__init__()
        return
    from apps.coordinator.models import SyncerLease
    from apps.jobs.models import Event, Job, OuterStep

    OuterStep.objects.filter(job_id=world.job).delete()
    Event.objects.filter(job_id=world.job).delete()
    Job.objects.filter(pk=world.job).update(tokens_contributed=0, tokens_computed=0, outer_steps=0,
                                            bytes_sent=0)
    SyncerLease.objects.filter(job_id=world.job).update(epoch=1, commits=0, state_key="", head={})
