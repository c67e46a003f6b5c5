"""The syncer task's fencing of restarted learners, without processes: a real SyncerRun over a
file blob store and the database, fed contribution blobs by hand."""
from __future__ import annotations

import pytest
import torch

from apps.coordinator.models import LearnerRuntime, SyncerLease
from apps.coordinator.syncer import SyncerRun
from apps.jobs import state as st
from apps.jobs.models import Job, Learner, OuterStep
from trainer.protocol import Contribution
from trainer.runtime import keys

from .conftest import TINY

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(owner, settings, tmp_path):
    settings.BLOB_STORE_URL = f"file://{tmp_path / 'blobs'}"
    job = Job.objects.create(owner=owner, name="fence", status=st.RUNNING,
                             spec={**TINY, "learners": 2, "quorum": 2, "fragments": 1})
    for i in range(2):
        LearnerRuntime.objects.create(
            learner=Learner.objects.create(job=job, index=i, incarnation=1, state=Learner.State.RUNNING))
    SyncerLease.objects.create(job=job, epoch=1)
    r = SyncerRun(job.pk, epoch=1, worker="w")
    r.build()
    r.heartbeat()
    return r


def put(run: SyncerRun, learner: int, incarnation: int, start: int, end: int, scale: float = 1e-3) -> str:
    tensors = {n: torch.full(run.shapes[n], scale) for n in run.syncer.fragments[0]}
    c = Contribution(job=str(run.job_id), learner=learner, incarnation=incarnation, fragment=0,
                     base_version=0, tokens=end - start, inner_steps=4, tensors=tensors)
    key = keys.contrib_key(run.job_id, learner, incarnation, 0, 0, start, end)
    run.store.put(key, c.to_bytes())
    return key


def restart(run: SyncerRun, learner: int, resume_at: int | None) -> None:
    """The watchdog bumped the incarnation; the successor reports where it resumed (or not yet)."""
    Learner.objects.filter(job_id=run.job_id, index=learner).update(incarnation=2)
    point = None if resume_at is None else {"tokens": resume_at, "frag_pos": {"0": resume_at}}
    runtime = LearnerRuntime.objects.filter(learner__job_id=run.job_id, learner__index=learner)
    runtime.update(resume_point=point)
    run.heartbeat()


def test_a_predecessors_send_before_the_resume_point_is_merged_beside_its_successors(run):
    old = put(run, 0, 1, 0, 100)
    assert run.scan() == 1 and run.syncer.pending_count(0) == 1
    restart(run, 0, None)  # where the successor resumes is not known yet: the send waits
    assert run.syncer.pending_count(0) == 0 and old not in run.pending
    assert run.store.get(old)  # kept in the store, scanned again later
    assert run.scan() == 0
    restart(run, 0, 100)  # the successor resumed after that send
    put(run, 0, 2, 100, 160)  # ... and its own first contribution is already there
    put(run, 1, 1, 0, 100)
    assert run.scan() == 3 and run.syncer.pending_count(0) == 3
    assert run.merge_due(force=True) == 1
    step = OuterStep.objects.get(job_id=run.job_id)
    assert sorted((c["learner"], c["incarnation"]) for c in step.contributors) == [(0, 1), (0, 2), (1, 1)]
    assert run.ledger.covered(0, 0) == 160 and run.counters["zombies_refused"] == 0
    assert Job.objects.get(pk=run.job_id).tokens_contributed == 260


def test_a_predecessors_send_after_the_resume_point_is_withdrawn_as_a_zombie(run):
    zombie = put(run, 1, 1, 0, 100)
    assert run.scan() == 1
    restart(run, 1, 40)  # the successor's checkpoint predates that send: it computes 40.. again
    assert run.syncer.pending_count(0) == 0 and not run.pending
    assert run.counters["zombies_refused"] == 1
    with pytest.raises(KeyError):
        run.store.get(zombie)
    put(run, 1, 2, 40, 120)
    put(run, 0, 1, 0, 100)
    assert run.scan() == 2
    assert run.merge_due(force=True) == 1
    assert run.ledger.covered(1, 0) == 80
