from __future__ import annotations

import pytest
import torch

from trainer.learner import Learner, inner_lr
from trainer.protocol import GlobalFragment
from trainer.runtime.codec import pack, unpack


@pytest.fixture
def learner(small_config, stdlib_corpus):
    def make(index=0, incarnation=0, **kw):
        return Learner(small_config(**kw), index, incarnation=incarnation, corpus=stdlib_corpus)

    return make


def test_inner_lr_warmup_then_cosine(small_config):
    cfg = small_config(inner_lr=1e-3, warmup_steps=4, steps=104, min_lr_ratio=0.1)
    lrs = [inner_lr(cfg, s) for s in range(104)]
    assert lrs[0] == pytest.approx(2.5e-4) and lrs[3] == pytest.approx(1e-3)
    assert lrs[54] == pytest.approx(0.55e-3, rel=1e-2)
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-2)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))


def test_contributions_follow_the_staggered_schedule(learner):
    lrn = learner(fragments=2, inner_steps=4, steps=8)
    due_at = {}
    for _ in range(4):
        res = lrn.step()
        for c in lrn.due_contributions():
            due_at[c.fragment] = (res.step, c)
    assert sorted(due_at) == [0, 1]
    (s0, c0), (s1, c1) = due_at[0], due_at[1]
    assert (s0, s1) == (2, 4)
    assert (c0.inner_steps, c0.tokens) == (2, 2 * 2 * 16)
    assert (c1.inner_steps, c1.tokens) == (4, 4 * 2 * 16)
    assert c0.base_version == 0 and c0.key == (0, 0, 0, 0)
    assert set(c0.tensors) == set(lrn.fragments[0])
    # pseudo-gradient = base - local
    for n in lrn.fragments[1]:
        torch.testing.assert_close(c1.tensors[n], lrn.base[1][n] - lrn.params[n].detach())
    assert lrn.tokens == 4 * 2 * 16 and lrn.inner_steps == 4


def test_never_blocks_and_does_not_resend_while_outstanding(learner):
    lrn = learner(inner_steps=2, steps=10)
    lrn.step()
    lrn.step()
    first = lrn.due_contributions()
    assert len(first) == 1 and lrn.outstanding(0)
    for _ in range(4):  # no answer from the syncer: keep training
        lrn.step()
    assert lrn.due_contributions() == [] and lrn.skipped_sends == 2
    assert lrn.inner_steps == 6
    # the syncer answers with version 1: progress since the send is kept (mix_alpha), next send goes out
    g = GlobalFragment("local", 0, 1, {n: t - first[0].tensors[n] for n, t in lrn.base[0].items()})
    assert lrn.adopt(g)
    assert not lrn.outstanding(0) and lrn.adopted_versions[0] == 1
    lrn.step()
    lrn.step()
    (c,) = lrn.due_contributions()
    assert c.base_version == 1 and c.inner_steps == 6  # 4 since the send + 2 more


def test_adopt_mixes_progress_made_meanwhile(learner):
    lrn = learner(inner_steps=1, steps=10, mix_alpha=0.25)
    lrn.step()
    lrn.due_contributions()
    sent = {n: p.detach().clone() for n, p in lrn.params.items()}
    lrn.step()  # progress made while the merge is in flight
    now = {n: p.detach().clone() for n, p in lrn.params.items()}
    g = GlobalFragment("local", 0, 1, {n: torch.full_like(t, 0.01) for n, t in sent.items()})
    lrn.adopt(g)
    for n in sent:
        torch.testing.assert_close(lrn.params[n].detach(), 0.01 + 0.25 * (now[n] - sent[n]))
        assert torch.equal(lrn.base[0][n], g.tensors[n])
    assert not lrn.adopt(GlobalFragment("local", 0, 1, g.tensors))  # not newer: ignored
    with pytest.raises(ValueError, match="tensors"):
        lrn.adopt(GlobalFragment("local", 0, 2, {"x": torch.zeros(1)}))


def test_lockstep_adoption_is_plain_replacement(learner):
    lrn = learner(inner_steps=1, steps=10, mix_alpha=0.5)
    lrn.step()
    lrn.due_contributions()
    g = GlobalFragment("local", 0, 1, {n: torch.randn_like(p) for n, p in lrn.params.items()})
    lrn.adopt(g)
    for n in g.tensors:
        torch.testing.assert_close(lrn.params[n].detach(), g.tensors[n])


def test_set_work_size_applies_from_next_cycle(learner):
    lrn = learner(inner_steps=4, steps=20)
    lrn.step()
    lrn.set_work_size(2)
    assert lrn.work_size == 4
    steps_with_sends = []
    for _ in range(9):
        r = lrn.step()
        if lrn.due_contributions():
            steps_with_sends.append(r.step)
        if lrn.outstanding(0):
            lrn.adopt(GlobalFragment("local", 0, lrn.adopted_versions[0] + 1, dict(lrn.base[0])))
    assert steps_with_sends == [4, 6, 8, 10]
    with pytest.raises(ValueError):
        lrn.set_work_size(0)


def test_done_by_steps(learner):
    lrn = learner(steps=3)
    while not lrn.done:
        lrn.step()
    assert lrn.inner_steps == 3


def test_state_dict_restore_continues_identically(learner):
    a = learner(fragments=2, inner_steps=4, steps=12)
    for _ in range(5):
        a.step()
    pending = a.due_contributions()
    assert pending  # fragment 0 is outstanding at checkpoint time
    blob = pack(a.state_dict())
    b = learner(fragments=2, inner_steps=4, steps=12, seed=0)
    b.load_state_dict(unpack(blob))
    for _ in range(3):
        ra, rb = a.step(), b.step()
        assert ra.loss == rb.loss
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n])
    assert [c.key for c in a.due_contributions()] == [c.key for c in b.due_contributions()]
    assert b.outstanding(0)


def test_restore_as_new_incarnation_resends_progress(learner):
    a = learner(inner_steps=2, steps=12)
    a.step()
    a.step()
    assert a.due_contributions() and a.outstanding(0)
    b = learner(incarnation=1, inner_steps=2, steps=12)
    b.load_state_dict(a.state_dict())
    assert b.incarnation == 1 and not b.outstanding(0)
    b.step()
    b.step()
    (c,) = b.due_contributions()
    assert c.key == (0, 1, 0, 0) and c.inner_steps == 4
    with pytest.raises(ValueError, match="learner 0 loaded into learner 1"):
        learner(index=1).load_state_dict(a.state_dict())


def test_bf16_autocast_step(learner):
    lrn = learner(bf16=True, steps=2)
    r = lrn.step()
    assert r.loss == r.loss and 4.0 < r.loss < 7.0
    assert all(p.dtype == torch.float32 for p in lrn.params.values())   # master weights stay fp32


def test_refused_contribution_goes_out_again_with_the_next_one(learner):
    lrn = learner(inner_steps=2, steps=12)
    lrn.step()
    lrn.step()
    (first,) = lrn.due_contributions()
    lrn.refused(0)                                    # e.g. the syncer found it stale
    assert not lrn.outstanding(0)
    lrn.step()
    lrn.step()
    (again,) = lrn.due_contributions()
    assert again.base_version == first.base_version and again.inner_steps == 4
    for n in again.tensors:
        torch.testing.assert_close(again.tensors[n], lrn.base[0][n] - lrn.params[n].detach())


def test_global_update_applies_only_to_the_version_it_was_made_from(learner):
    lrn = learner(fragments=1, inner_steps=2, steps=4)
    names = lrn.fragments[0]
    zero = {n: torch.zeros_like(lrn.base[0][n].cpu()) for n in names}
    with pytest.raises(ValueError, match="fetch the full fragment"):
        lrn.adopt(GlobalFragment("local", 0, 3, zero, base_version=1))
    bump = {n: torch.full_like(t, 0.5) for n, t in zero.items()}
    before = {n: lrn.base[0][n].clone() for n in names}
    assert lrn.adopt(GlobalFragment("local", 0, 1, bump, base_version=0))
    for n in names:
        assert torch.equal(lrn.base[0][n], before[n] + 0.5)
    assert lrn.adopted_versions[0] == 1


def test_state_dict_is_a_snapshot_and_restores_do_not_share_it(learner):
    """A state held in memory (the simulator's checkpoints) must not move with training:
    torch's Optimizer.state_dict() returns the live moments and load_state_dict keeps the
    given tensors, so without copies two learners restored from one state train on one
    shared AdamW state and the state itself drifts."""
    a = learner(inner_steps=4, steps=12)
    a.step()
    state = a.state_dict()
    moments = [t.clone() for s in state["optimizer"]["state"].values() for t in s.values()]
    a.step()
    b, c = learner(inner_steps=4, steps=12), learner(inner_steps=4, steps=12)
    b.load_state_dict(state)
    c.load_state_dict(state)
    b.step()
    after = [t for s in state["optimizer"]["state"].values() for t in s.values()]
    assert all(torch.equal(x, y) for x, y in zip(moments, after, strict=True))
    for pb, pc in zip(b.model.parameters(), c.model.parameters(), strict=True):
        sb, sc = b.optimizer.state[pb], c.optimizer.state[pc]
        assert sb["exp_avg"].data_ptr() != sc["exp_avg"].data_ptr()
    assert c.step().loss == b.last_loss  # c trains from the checkpoint, not from b's moved state
    for n in b.params:
        assert torch.equal(b.params[n], c.params[n])


def test_a_chain_of_updates_gives_the_published_bits(learner):
    """A learner three versions behind adds the syncer's compressed updates in order and holds
    its published weights exactly; a chain that does not start at its version is refused."""
    from trainer.clock import ManualClock
    from trainer.syncer import Syncer

    lrn = learner(fragments=1, inner_steps=2, steps=40, global_compression="int4", max_staleness=8)
    other = learner(index=1, fragments=1, inner_steps=2, steps=40, global_compression="int4", max_staleness=8)
    syncer = Syncer(other.config, other.model, ManualClock())
    for _round in range(3):
        for _ in range(2):
            other.step()
        for c in other.due_contributions():
            assert syncer.submit(c).accepted
        syncer.merge(0, force=True)
        other.adopt(syncer.global_fragment(0))
    chain = [GlobalFragment.from_bytes(b) for b in syncer.global_updates(0, 0)]
    with pytest.raises(ValueError, match="chain"):
        lrn.adopt_updates(chain[1:])
    assert lrn.adopt_updates(chain)
    assert lrn.adopted_versions[0] == 3
    for n in lrn.fragments[0]:
        assert torch.equal(lrn.base[0][n].cpu(), syncer.published[n])


def test_inner_prox_pulls_each_step_towards_the_adopted_global(learner):
    """inner_prox: after the AdamW step, x <- x + lr * inner_prox * (base - x); nothing else
    changes (same batches, same AdamW state), and a standalone learner has no global to pull to."""
    plain = learner(inner_steps=8, steps=40, inner_prox=0.0)
    prox = learner(inner_steps=8, steps=40, inner_prox=50.0)
    for step in range(3):
        plain.step()
        prox.step()
        rate = inner_lr(prox.config, step) * 50.0
        for n, x in prox.params.items():
            expected = plain.params[n].detach().lerp(prox.base[0][n], rate)
            torch.testing.assert_close(x.detach(), expected, rtol=0, atol=1e-7)
            plain.params[n].data.copy_(x.detach())  # continue from the same weights
    alone = Learner(prox.config, 0, corpus=prox.corpus, standalone=True)
    ref = Learner(plain.config, 0, corpus=plain.corpus, standalone=True)
    alone.step()
    ref.step()
    for n, x in alone.params.items():
        assert torch.equal(x, ref.params[n])


def test_a_contribution_still_held_keeps_its_values_while_later_ones_go_out(learner):
    """The payload buffer of a fragment is reused only once the contribution that carried it is
    gone; one still held (queued for the writer, pending in a syncer) is never overwritten."""
    lrn = learner(inner_steps=1, steps=10)
    lrn.step()
    (held,) = lrn.due_contributions()
    kept = {n: t.clone() for n, t in held.tensors.items()}
    for version in (1, 2):
        lrn.adopt(GlobalFragment("local", 0, version, {n: t.clone() for n, t in lrn.base[0].items()}))
        lrn.step()
        (c,) = lrn.due_contributions()
        assert not any(c.tensors[n].data_ptr() == held.tensors[n].data_ptr() for n in kept)
        del c
    assert all(torch.equal(held.tensors[n], kept[n]) for n in kept)
    # once nothing holds the contribution, the next one reuses its buffer: no allocation per send
    lrn.adopt(GlobalFragment("local", 0, 3, {n: t.clone() for n, t in lrn.base[0].items()}))
    lrn.step()
    (a,) = lrn.due_contributions()
    ptrs = {n: t.data_ptr() for n, t in a.tensors.items()}
    a.wait()
    del a
    lrn.adopt(GlobalFragment("local", 0, 4, {n: t.clone() for n, t in lrn.base[0].items()}))
    lrn.step()
    (b,) = lrn.due_contributions()
    assert {n: t.data_ptr() for n, t in b.tensors.items()} == ptrs
    for n in lrn.fragments[0]:
        torch.testing.assert_close(b.tensors[n], lrn.base[0][n] - lrn.params[n].detach(), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy path needs CUDA")
def test_cuda_contribution_is_copied_on_a_side_stream_and_waited_for(learner):
    """On CUDA the delta goes to pinned host memory on a side stream; the contribution carries
    the copy's event, and `wait()` (called by to_bytes and Syncer.submit) gives the exact delta."""
    lrn = learner(inner_steps=1, steps=10, device="cuda")
    lrn.step()
    (c,) = lrn.due_contributions()
    assert c.ready is not None and all(t.is_pinned() for t in c.tensors.values())
    want = {n: (lrn.base[0][n] - lrn._sent[0][n]).cpu() for n in lrn.fragments[0]}
    lrn.step()  # training goes on while the copy may be in flight
    c.wait()
    assert c.ready is None and c.checksum
    assert all(torch.equal(c.tensors[n], want[n]) for n in want)
    from trainer.protocol import Contribution

    back = Contribution.from_bytes(c.to_bytes())
    assert back.checksum == c.checksum
