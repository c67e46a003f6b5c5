"""End to end with real processes: daphne, pool workers, coordinator, beat, Redis, PostgreSQL."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from apps.coordinator.models import SyncerLease
from apps.jobs import state as st
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner, MetricPoint, OuterStep
from apps.jobs.services import submit_job
from trainer.transport import open_store

from .conftest import TINY, needs_services

pytestmark = [needs_services, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def applied_ranges(job):
    """(learner, fragment) -> list of token ranges applied, from the OuterStep rows."""
    out = {}
    for step in OuterStep.objects.filter(job=job):
        for c in step.contributors:
            for r in c.get("ranges", []):
                out.setdefault((c["learner"], step.fragment), []).append(tuple(r))
    return out


def duplicates(job) -> int:
    n = 0
    for ranges in applied_ranges(job).values():
        ranges.sort()
        for (_, e1), (s2, _) in zip(ranges, ranges[1:], strict=False):
            n += s2 < e1
    return n


def window_losses(job, state=None):
    """Per validation window, on the windows the syncer evaluates (trainer.data.evaluate): the
    loss of the job's model (as built when `state` is None, else with `state` loaded) and the
    loss of a model that knows only the training split's token frequencies (add-one smoothed),
    which is what a model reaches without using any context."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from apps.coordinator.common import corpus, train_config
    from trainer.data import val_windows
    from trainer.models import build_model

    cfg = train_config(job)
    data = corpus(cfg.dataset, cfg.cache_dir)
    seq = cfg.seq_len
    starts = val_windows(data, seq, cfg.eval_batches * (cfg.eval_batch_size or cfg.batch_size))
    rows = torch.from_numpy(np.stack([np.asarray(data.val[s:s + seq + 1], dtype=np.int64) for s in starts]))
    model = build_model(cfg.model, seq_len=seq, seed=cfg.seed, vocab_size=data.vocab_size)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not [k for k in missing if k in dict(model.named_parameters())]
    model.eval()
    with torch.no_grad():
        logits = model(rows[:, :-1]).float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="none")
    counts = np.bincount(np.asarray(data.train), minlength=data.vocab_size).astype(np.float64) + 1
    unigram = -np.log(counts / counts.sum())[rows[:, 1:].numpy()]
    return nll.view(len(starts), seq).mean(1).double().numpy(), unigram.mean(1)


def clears(gain, what: str) -> str:
    """The mean of per-window `gain`, asserted above three standard errors of the windows."""
    se = float(gain.std(ddof=1)) / len(gain) ** 0.5
    assert gain.mean() > 3 * se, f"{what}: {gain.mean():.4f} <= 3 x {se:.4f} (windows' standard error)"
    return f"{gain.mean():.3f} +- {se:.3f}"


def test_job_completes_and_loss_falls(stack, owner):
    # global weights come down as int8 updates (the other e2e jobs use whole fp32 fragments)
    spec = dict(TINY, global_compression="int8")
    job, _ = submit_job(owner, spec)
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=120, what="job end")
    job.refresh_from_db()
    learners = list(Learner.objects.filter(job=job).order_by("index"))

    # completed: every learner ran its budget out, the final export exists
    assert job.status == st.COMPLETED, job.status_reason
    assert {lr.state for lr in learners} == {Learner.State.DONE}
    assert job.outer_steps >= 4 and job.outer_steps == OuterStep.objects.filter(job=job).count()
    final = Checkpoint.objects.get(job=job, kind=Checkpoint.Kind.FINAL)
    assert final.size_bytes > 0 and len(final.sha256) == 64

    # loss falls, measured on the same windows at both ends: the untrained model (as the job
    # built it) against the final export, each reproducing the figure the job recorded, and the
    # gain over the windows larger than three of their standard errors; the export also beats
    # a model of token frequencies alone by that margin, so the job learned from context
    from safetensors.torch import load

    before, unigram = window_losses(job)
    after, _ = window_losses(job, load(open_store(stack.blob_store_url).get(final.blob_uri)))
    assert abs(before.mean() - job.initial_val_loss) < 1e-3, (before.mean(), job.initial_val_loss)
    assert abs(after.mean() - job.final_val_loss) < 1e-3, (after.mean(), job.final_val_loss)
    fell = clears(before - after, "val loss fell")
    beat = clears(unigram - after, "below token frequencies")
    series = list(MetricPoint.objects.filter(job=job, name="val_loss", learner=None).order_by("time", "id")
                  .values_list("value", flat=True))
    assert len(series) >= 2 and series[0] == job.initial_val_loss and series[-1] == job.final_val_loss
    print(f"\n{job.outer_steps} outer steps, val loss {job.initial_val_loss:.3f} -> {job.final_val_loss:.3f} "
          f"(fell {fell}, {beat} below token frequencies {unigram.mean():.3f}; {len(after)} windows)")

    # tokens counted: each learner's applied token ranges tile [0, its budget) exactly once
    # (no duplicate application, nothing lost) and the counters add up to the same figures
    per_learner = spec["steps"] * spec["batch_size"] * spec["seq_len"]
    ranges = applied_ranges(job)
    assert duplicates(job) == 0
    for lr in learners:
        mine = sorted(ranges.get((lr.index, 0), []))
        assert mine and mine[0][0] == 0 and mine[-1][1] == per_learner, (lr.index, mine)
        assert all(e1 == s2 for (_, e1), (s2, _) in zip(mine, mine[1:], strict=False)), (lr.index, mine)
        assert lr.tokens_contributed == per_learner, lr.index
    assert job.tokens_contributed == sum(lr.tokens_contributed for lr in learners) == 2 * per_learner
    assert job.tokens_contributed <= job.tokens_computed and job.tokens_lost == 0
    steps = list(OuterStep.objects.filter(job=job).values_list("contributors", flat=True))
    assert sum(c["tokens"] for cs in steps for c in cs) == job.tokens_contributed

    # what the job page shows beside it
    assert job.energy_j > 0  # the pools' TDP over the learners' busy time
    assert all(isinstance(c["norm"], float) and c["norm"] > 0 for cs in steps for c in cs)
    assert all(c["cosine"] is None or -1 <= c["cosine"] <= 1 for cs in steps for c in cs)
    goodput = list(MetricPoint.objects.filter(job=job, name="goodput").values_list("value", flat=True))
    assert goodput and all(0 < v <= 1 for v in goodput)
    assert MetricPoint.objects.filter(job=job, name="bytes_sent").exists()
    ends = [e.payload for e in Event.objects.filter(job=job, payload__has_key="updates_received")]
    assert ends and sum(d["updates_received"] for d in ends) > 0
    assert all(d["bytes_received"] > 0 for d in ends)


def test_platform_overhead_bench(stack, owner):
    """The figures of docs/runtime.md "Benchmarks", printed; the assertions are only that each
    figure was measured from a finished job, never on its value (the machine is shared)."""
    bench(stack, owner)


def bench(stack, owner):
    """Printed, their values never asserted: a learner inside the platform against the bare engine
    loop, and the syncer's wall time per outer step against raw blob-store transfers of the same
    bytes (asserted: the bench job completed and reported each figure)."""
    import torch

    from apps.coordinator.common import corpus, default_cache_dir
    from trainer.config import TrainConfig
    from trainer.learner import Learner as EngineLearner
    from trainer.spec import JobSpec
    from trainer.transport import open_store

    spec = {**TINY, "learners": 1, "quorum": 1, "steps": 200, "name": "bench", "pools": ["alpha"]}
    job, _ = submit_job(owner, spec)
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=120, what="bench job")
    assert Job.objects.get(pk=job.pk).status == st.COMPLETED
    ev = Event.objects.filter(job=job, payload__outcome="done").first()
    sync = Event.objects.filter(job=job, payload__has_key="sync_seconds").first()
    assert ev is not None and sync is not None, "the learner's and the syncer's final reports"
    platform_tps = ev.payload["tokens_per_s"]
    assert platform_tps > 0 and ev.payload["train_seconds"] > 0 and ev.payload["active_seconds"] > 0
    assert all(sync.payload[k] > 0 for k in ("commits_this_epoch", "bytes_in", "accepted"))

    # the bare engine loop, same config, in this process (the stack is idle now)
    torch.set_num_threads(1)
    cfg = TrainConfig.from_spec(JobSpec.model_validate(spec), cache_dir=default_cache_dir())
    eng = EngineLearner(cfg, 0, corpus=corpus(cfg.dataset, cfg.cache_dir), job="bare", standalone=True)
    eng.step()  # warm
    t0 = time.perf_counter()
    n = 0
    while n < 100:
        eng.step()
        n += 1
    bare_tps = n * cfg.batch_size * cfg.seq_len / (time.perf_counter() - t0)

    # raw blob-store transfer of one outer step's bytes (one contribution in, one fragment out)
    store = open_store(stack.blob_store_url)
    commits = max(1, sync.payload["commits_this_epoch"])
    # one outer step moves one contribution in and one global fragment out (1 learner, P=1)
    per_step_bytes = sync.payload["bytes_in"] // max(1, sync.payload["accepted"])
    blob = b"x" * per_step_bytes
    t0 = time.perf_counter()
    for i in range(20):
        store.put(f"bench/raw-{i}", blob)
        store.get(f"bench/raw-{i}")
        store.put(f"bench/raw-out-{i}", blob)
    raw = (time.perf_counter() - t0) / 20
    sync_per_step = sync.payload["sync_seconds"] / commits
    in_steps = ev.payload["train_seconds"] / max(1e-9, ev.payload["active_seconds"])
    print(f"\nBENCH platform learner {platform_tps:.0f} tok/s vs bare engine loop {bare_tps:.0f} tok/s "
          f"({100 * platform_tps / bare_tps:.1f}%, sharing 2 cores with its syncer, web, beat); the learner "
          f"spent {100 * in_steps:.1f}% of its wall time inside engine steps (glue overhead "
          f"{100 * (1 - in_steps):.1f}%)")
    parts = ", ".join(f"{k.removesuffix('_s')} {1000 * sync.payload[k] / commits:.1f}"
                      for k in ("merge_s", "blob_s", "snapshot_s", "db_s"))
    print(f"BENCH sync wall time per outer step {1000 * sync_per_step:.1f} ms ({parts} ms) vs raw "
          f"blob transfer of the same {per_step_bytes} bytes (1 get + 2 puts) {1000 * raw:.1f} ms")


def test_platform_restart_pause_resume_cancel(stack, owner):
    from apps.jobs.services import cancel_job, pause_job, resume_job

    job, _ = submit_job(owner, {**TINY, "steps": 800, "name": "pause me"})
    stack.wait_for(lambda: Learner.objects.filter(job=job, state=Learner.State.RUNNING).count() == 2,
                   timeout=60, what="two running learners")
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 2, timeout=60, what="outer steps")

    # whole-platform restart: every process SIGKILLed (broker state wiped), then started again;
    # the running job carries on from its checkpoints and last commit
    incs = dict(Learner.objects.filter(job=job).values_list("index", "incarnation"))
    for name in list(stack.procs):
        stack.kill(name)
    commits = Job.objects.get(pk=job.pk).outer_steps
    stack.start()
    stack.wait_for(lambda: all(lr.incarnation > incs[lr.index] and lr.state == Learner.State.RUNNING
                               for lr in Learner.objects.filter(job=job)), timeout=90,
                   what="learners running again after the restart")
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps > commits, timeout=60,
                   what="outer steps after the restart")
    assert Job.objects.get(pk=job.pk).status == st.RUNNING

    # pause: learners checkpoint and stop; resume continues from the checkpoints
    pause_job(Job.objects.get(pk=job.pk))
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status == st.PAUSED, timeout=20, what="paused")
    tokens_at_pause = {lr.index: lr.tokens for lr in Learner.objects.filter(job=job)}
    states = set(Learner.objects.filter(job=job).values_list("state", flat=True))
    # stopped (checkpointed); on a fast day one may have finished its budget already
    assert Learner.State.STOPPED in states and states <= {Learner.State.STOPPED, Learner.State.DONE}
    resume_job(Job.objects.get(pk=job.pk))
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=120, what="job end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    assert duplicates(job) == 0
    for lr in Learner.objects.filter(job=job):
        assert lr.incarnation >= 2 and lr.tokens >= tokens_at_pause[lr.index]
        assert lr.runtime.resume_point["tokens"] > 0  # resumed from its checkpoint, not from scratch

    # cancel: every learner stops within seconds
    job2, _ = submit_job(owner, {**TINY, "steps": 5000, "name": "to cancel"})
    stack.wait_for(lambda: Learner.objects.filter(job=job2, state=Learner.State.RUNNING).count() == 2,
                   timeout=60, what="two running learners")
    t0 = time.time()
    cancel_job(Job.objects.get(pk=job2.pk))
    stack.wait_for(lambda: not Learner.objects.filter(job=job2, state__in=("running", "starting")).exists(),
                   timeout=20, what="learners stopped")
    print(f"\ncancel: all learners stopped {time.time() - t0:.2f}s after the request")
    assert time.time() - t0 < 10
    assert set(Learner.objects.filter(job=job2).values_list("state", flat=True)) == {Learner.State.STOPPED}


def test_synchronous_diloco_and_elastic_growth_on_real_processes(stack, owner):
    """strategy=diloco merges every learner's contribution in each outer step; a job with
    max_learners grows onto free slots mid-run, and the joiner's work reaches the model."""
    job, _ = submit_job(owner, {**TINY, "name": "sync diloco", "strategy": "diloco", "quorum": 1,
                                "steps": 160})
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=120, what="diloco end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    steps = list(OuterStep.objects.filter(job=job).order_by("id"))
    sizes = [len({c["learner"] for c in s.contributors}) for s in steps]
    print(f"\ndiloco: learners per outer step {sizes}")
    assert len(steps) >= 8 and sizes[:3] == [2, 2, 2]
    # every merge waits for both learners until one has finished its budget; only then does the
    # other merge alone (its last progress)
    first_done = min(e.time for e in Event.objects.filter(job=job, payload__outcome="done"))
    singles = [s for s, n in zip(steps, sizes, strict=True) if n == 1]
    assert all(s.created_at >= first_done - timedelta(seconds=1) for s in singles), (sizes, first_done)
    assert job.final_val_loss < job.initial_val_loss - 0.1

    grow, _ = submit_job(owner, {**TINY, "name": "elastic", "steps": 400, "max_learners": 3})
    joins = Event.objects.filter(job=grow, kind=Event.Kind.JOINED)
    stack.wait_for(joins.exists, timeout=90, what="a learner joining")  # the event follows the row
    assert [e.payload["learner"] for e in joins] == [2] and Learner.objects.filter(job=grow).count() == 3
    stack.wait_for(lambda: Job.objects.get(pk=grow.pk).status in st.TERMINAL, timeout=180, what="elastic end")
    grow.refresh_from_db()
    assert grow.status == st.COMPLETED, grow.status_reason
    newcomer = Learner.objects.get(job=grow, index=2)
    assert newcomer.state == Learner.State.DONE and newcomer.tokens_contributed > 0
    assert any(c["learner"] == 2 for s in OuterStep.objects.filter(job=grow) for c in s.contributors)
    assert duplicates(grow) == 0
    assert grow.final_val_loss < grow.initial_val_loss - 0.1


def test_syncer_sharded_by_fragment_survives_a_coordinator_kill(stack, owner):
    """syncer_shards=2: two syncer tasks each merge half of the fragments and commit their own
    head; learners read both; a killed coordinator restarts both shards from their own commits;
    the leader's evaluations and checkpoints hold every fragment's newest weights."""
    job, _ = submit_job(owner, {**TINY, "name": "sharded", "fragments": 2, "syncer_shards": 2,
                                "steps": 240})
    stack.wait_for(lambda: SyncerLease.objects.filter(job=job, commits__gte=2).count() == 2, timeout=90,
                   what="both shards committing")
    for name in ("syncer", "coordinator"):  # the coordinator host: the syncers' worker and housekeeping
        stack.kill(name)
        stack.restart(name)
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=180, what="job end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    leases = {lease.shard: lease for lease in SyncerLease.objects.filter(job=job)}
    print(f"\nsharded: commits {[(k, v.commits, v.restarts) for k, v in sorted(leases.items())]} "
          f"(shard, commits, restarts), {job.outer_steps} outer steps, "
          f"val loss {job.initial_val_loss:.3f} -> {job.final_val_loss:.3f}")
    assert set(leases) == {0, 1} and all(lease.finished for lease in leases.values())
    assert all(lease.restarts >= 1 for lease in leases.values())  # both came back after the kill
    incidents = Incident.objects.filter(job=job, kind="syncer_lost")
    assert {i.details["shard"] for i in incidents} == {0, 1}
    assert all(i.healed_at is not None for i in incidents)
    assert leases[0].commits + leases[1].commits == job.outer_steps
    for p in (0, 1):
        versions = sorted(OuterStep.objects.filter(job=job, fragment=p).values_list("version", flat=True))
        assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 3
    assert [set(leases[k].head) - {"epochs"} for k in (0, 1)] == [{"0"}, {"1"}]  # a head per shard
    assert duplicates(job) == 0
    assert job.final_val_loss < job.initial_val_loss - 0.1
    # the leader's final export holds the newest version of both shards' fragments
    final = Checkpoint.objects.get(job=job, kind=Checkpoint.Kind.FINAL)
    blobs = open_store(stack.blob_store_url)
    meta = json.loads(blobs.get(final.blob_uri.removesuffix(".safetensors") + ".json"))
    assert meta["versions"] == {str(p): leases[p].head[str(p)] for p in (0, 1)}
    assert meta["outer_steps"] == job.outer_steps
