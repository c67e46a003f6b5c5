"""The syncer's merge rule, one behaviour per test."""

from __future__ import annotations

import pytest
import torch

from trainer.clock import ManualClock
from trainer.config import TrainConfig
from trainer.protocol import Contribution
from trainer.runtime.codec import pack, unpack
from trainer.syncer import Syncer

SHAPES = {"a.weight": (4, 3), "b.bias": (5,)}


def _initial(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _config(**kw):
    base = {
        "learners": 4,
        "quorum": 2,
        "inner_steps": 4,
        "fragments": 1,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "outer_momentum_warmup": 0,  # plain Nesterov unless a test ramps it
        "max_staleness": 2,
        "grace_cap_s": 5.0,
    }
    base.update(kw)
    return TrainConfig(**base)


def _delta(seed, scale=1.0):
    g = torch.Generator().manual_seed(1000 + seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _contrib(
    learner, base_version=0, tokens=100, steps=4, incarnation=0, tensors=None, seed=None, job="local"
):
    return Contribution(
        job=job,
        learner=learner,
        incarnation=incarnation,
        fragment=0,
        base_version=base_version,
        tokens=tokens,
        inner_steps=steps,
        tensors=tensors if tensors is not None else _delta(learner if seed is None else seed),
    )


def test_outer_step_equals_torch_sgd_nesterov():
    cfg = _config(learners=1, quorum=1, outer_lr=0.7, outer_momentum=0.9)
    init = _initial()
    syncer = Syncer(cfg, init, ManualClock())
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
    for step in range(5):
        delta = _delta(step)
        assert syncer.submit(_contrib(0, base_version=step, tensors=delta)).accepted
        syncer.merge(0)
        for n, p in ref.items():
            p.grad = delta[n].clone()
        opt.step()
        for n in SHAPES:
            torch.testing.assert_close(syncer.params[n], ref[n].detach(), rtol=0, atol=1e-6)


def test_outer_momentum_warmup_ramps_the_nesterov_momentum():
    """outer_momentum_warmup W: the k-th outer step is Nesterov SGD with momentum
    mu_k = mu * min(1, k / W), the buffer kept from the first step:
    b_k = mu_k b_(k-1) + g_k, then x -= lr (g_k + mu_k b_k)."""
    cfg = _config(learners=1, quorum=1, outer_lr=0.7, outer_momentum=0.8, outer_momentum_warmup=4)
    init = _initial()
    syncer = Syncer(cfg, init, ManualClock())
    assert [syncer.momentum_at(k) for k in (0, 2, 4, 9)] == [0.0, 0.4, 0.8, 0.8]
    ref = {n: t.clone() for n, t in init.items()}
    buf: dict[str, torch.Tensor] = {}
    for step in range(7):
        mu = 0.8 * min(1.0, step / 4)
        delta = _delta(step)
        assert syncer.submit(_contrib(0, base_version=step, tensors=delta)).accepted
        syncer.merge(0)
        for n in SHAPES:
            buf[n] = delta[n].clone() if n not in buf else mu * buf[n] + delta[n]
            ref[n] -= 0.7 * (delta[n] + mu * buf[n])
            torch.testing.assert_close(syncer.params[n], ref[n], rtol=1e-6, atol=1e-5)  # op order differs


def test_outer_step_without_momentum_is_plain_averaging_step():
    cfg = _config(learners=2, quorum=2, outer_lr=1.0, outer_momentum=0.0, rda=False)  # plain averaging
    init = _initial()
    syncer = Syncer(cfg, init, ManualClock())
    d0, d1 = _delta(0), _delta(1)
    syncer.submit(_contrib(0, tensors=d0))
    syncer.submit(_contrib(1, tensors=d1))
    syncer.merge(0)
    for n in SHAPES:
        torch.testing.assert_close(syncer.params[n], init[n] - (d0[n] + d1[n]) / 2)


@pytest.mark.parametrize("final_average", [False, True])
def test_final_average_makes_the_merges_after_the_budget_a_plain_mean(final_average):
    """steps // inner_steps = 2 outer steps of budget: merges 0 and 1 are outer steps (Nesterov,
    RDA); with `final_average` every merge after them is the plain token-weighted mean (outer lr 1,
    no momentum, no RDA), and without it one more outer step."""
    cfg = _config(learners=2, quorum=2, steps=8, inner_steps=4, outer_lr=0.7, outer_momentum=0.9,
                  outer_momentum_decay=0, rda=True, final_average=final_average)
    syncer = Syncer(cfg, _initial(), ManualClock())
    assert [syncer.final(k) for k in range(4)] == [False, False, final_average, final_average]
    outer = Syncer(cfg.replace(final_average=False), _initial(), ManualClock())  # the rule without it
    for version in range(3):
        d0, d1 = _delta(2 * version, scale=1 + version), _delta(2 * version + 1)
        before = {n: t.clone() for n, t in syncer.params.items()}
        for s_ in (syncer, outer):
            s_.submit(_contrib(0, base_version=version, tokens=300, steps=3, tensors=d0))
            s_.submit(_contrib(1, base_version=version, tokens=100, steps=4, tensors=d1))
            s_.merge(0)
        for n in SHAPES:
            if final_average and version == 2:  # weights 300 * 100 : 100 * 25 = 12 : 1
                torch.testing.assert_close(syncer.params[n], before[n] - (12 * d0[n] + d1[n]) / 13)
            else:
                torch.testing.assert_close(syncer.params[n], outer.params[n], rtol=0, atol=0)


def test_token_weighting():
    """w = tokens * tokens / steps: 300 tokens over 3 steps outweighs 100 over 4 by 9 * 4 = 36."""
    cfg = _config(learners=2, quorum=2, outer_lr=1.0, outer_momentum=0.0, rda=False)  # plain averaging
    init = _initial()
    syncer = Syncer(cfg, init, ManualClock())
    d0, d1 = _delta(0), _delta(1)
    syncer.submit(_contrib(0, tokens=100, steps=4, tensors=d0))
    syncer.submit(_contrib(1, tokens=300, steps=3, tensors=d1))
    result = syncer.merge(0)
    w0, w1 = 100 * 100 / 4, 300 * 300 / 3
    assert [c["weight"] for c in result.contributors] == pytest.approx([w0 / (w0 + w1), w1 / (w0 + w1)])
    for n in SHAPES:
        torch.testing.assert_close(syncer.params[n], init[n] - (w0 * d0[n] + w1 * d1[n]) / (w0 + w1))


def test_quorum_is_needed_before_merge():
    clock = ManualClock()
    syncer = Syncer(_config(learners=4, quorum=3), _initial(), clock)
    syncer.submit(_contrib(0))
    syncer.submit(_contrib(1))
    clock.advance(100.0)
    assert syncer.due() == []
    assert syncer.deadline(0) is None
    with pytest.raises(ValueError, match="quorum"):
        syncer.merge(0)
    syncer.submit(_contrib(2))
    assert syncer.deadline(0) is not None
    clock.advance(100.0)
    assert syncer.due() == [0]
    assert len(syncer.merge(0).contributors) == 3


def test_everyone_arrived_merges_without_waiting_for_grace():
    clock = ManualClock()
    syncer = Syncer(_config(learners=2, quorum=1, grace_cap_s=50.0), _initial(), clock)
    syncer.observe(step_time=10.0)
    syncer.submit(_contrib(0))
    assert syncer.deadline(0) > clock.now()
    assert syncer.due() == []
    syncer.submit(_contrib(1))
    assert syncer.due() == [0]


def test_grace_window_formula_and_bound():
    """g = clamp(gamma * (tau * xi_step - xi_quorum - xi_sync), 0, cap)."""
    cfg = _config(learners=4, quorum=1, inner_steps=8, grace_cap_s=3.0, grace_gamma=0.5, ema_beta=0.0)
    assert cfg.tau == 8  # default tau = H // P
    cfg = cfg.replace(overlap_steps=4)
    clock = ManualClock()
    syncer = Syncer(cfg, _initial(), clock)
    assert syncer.grace_window() == 0.0  # nothing measured yet: no waiting
    syncer.observe(step_time=1.0, transfer_time=0.5)
    assert syncer.grace_window() == pytest.approx(0.5 * (4 * 1.0 - 0.0 - 0.5))
    syncer.observe(step_time=100.0)
    assert syncer.grace_window() == 3.0  # capped
    syncer.observe(step_time=0.01, transfer_time=10.0)
    assert syncer.grace_window() == 0.0  # no slack: no waiting
    # the deadline set at quorum uses the window of that moment, and `due` honours it
    syncer.observe(step_time=0.5, transfer_time=0.0)
    syncer.submit(_contrib(0))
    assert syncer.deadline(0) == pytest.approx(clock.now() + 0.5 * 4 * 0.5)
    clock.advance(0.99)
    assert syncer.due() == []
    clock.advance(0.02)
    assert syncer.due() == [0]


def test_grace_window_learns_step_time_from_arrivals():
    cfg = _config(learners=2, quorum=1, inner_steps=4, grace_cap_s=100.0, ema_beta=0.0)
    clock = ManualClock()
    syncer = Syncer(cfg, _initial(), clock)
    syncer.submit(_contrib(0, steps=4))
    syncer.merge(0)
    clock.advance(8.0)  # 4 steps in 8 s: 2 s per step
    syncer.submit(_contrib(0, base_version=1, steps=4))
    assert syncer.xi_step.get() == pytest.approx(2.0)


def test_staleness_rule_discounts_then_drops():
    cfg = _config(
        learners=4, quorum=1, outer_lr=1.0, outer_momentum=0.0, max_staleness=2, staleness_discount=1.0
    )
    syncer = Syncer(cfg, _initial(), ManualClock())
    for v in range(3):  # advance fragment 0 to version 3
        syncer.submit(_contrib(3, base_version=v, seed=50 + v))
        syncer.merge(0)
    assert syncer.versions[0] == 3
    refused = syncer.submit(_contrib(0, base_version=0))
    assert not refused.accepted and refused.reason.startswith("stale")
    assert syncer.submit(_contrib(1, base_version=1, tokens=100, steps=4)).accepted  # staleness 2
    assert syncer.submit(_contrib(2, base_version=3, tokens=100, steps=4)).accepted  # fresh
    result = syncer.merge(0)
    by_learner = {c["learner"]: c for c in result.contributors}
    assert by_learner[1]["staleness"] == 2
    # same tokens and steps: weight ratio is the discount 1 / (1 + 2)
    assert by_learner[1]["weight"] / by_learner[2]["weight"] == pytest.approx(1 / 3)
    assert syncer.rejections["stale"] == 1


def test_pending_contribution_that_became_too_stale_is_dropped_at_merge():
    cfg = _config(learners=4, quorum=1, max_staleness=0)
    syncer = Syncer(cfg, _initial(), ManualClock())
    syncer.submit(_contrib(0, base_version=0))
    syncer._rounds[
        0
    ].pending.clear()  # simulate: learner 1 arrives, a merge happens, learner 0's late copy waits
    syncer.submit(_contrib(1, base_version=0))
    syncer.merge(0)
    syncer.submit(_contrib(2, base_version=1))
    assert syncer.merge(0).contributors[0]["learner"] == 2


def test_duplicate_is_rejected_pending_and_applied():
    syncer = Syncer(_config(quorum=1), _initial(), ManualClock())
    c = _contrib(0)
    assert syncer.submit(c).accepted
    again = syncer.submit(_contrib(0))
    assert not again.accepted and again.reason.startswith("duplicate")
    syncer.merge(0)
    before = {n: t.clone() for n, t in syncer.params.items()}
    late = syncer.submit(_contrib(0))
    assert not late.accepted and late.reason.startswith("duplicate")
    for n in SHAPES:
        assert torch.equal(before[n], syncer.params[n])


def test_nan_and_inf_are_rejected_state_untouched():
    syncer = Syncer(_config(quorum=1), _initial(), ManualClock())
    before = {n: t.clone() for n, t in syncer.params.items()}
    for bad in (float("nan"), float("inf")):
        d = _delta(0)
        d["a.weight"][1, 2] = bad
        r = syncer.submit(_contrib(0, tensors=d))
        assert not r.accepted and r.reason.startswith("nonfinite")
    assert syncer.pending_count(0) == 0
    assert syncer.rejections["nonfinite"] == 2
    for n in SHAPES:
        assert torch.equal(before[n], syncer.params[n])
    assert syncer.submit(_contrib(0)).accepted  # the learner can still contribute afterwards


def test_bad_shape_dtype_names_checksum_and_job_are_rejected():
    syncer = Syncer(_config(quorum=1), _initial(), ManualClock())
    d = _delta(0)
    d["a.weight"] = torch.zeros(3, 4)
    assert syncer.submit(_contrib(0, tensors=d)).reason.startswith("invalid")
    d = _delta(0)
    d["b.bias"] = d["b.bias"].double()
    assert syncer.submit(_contrib(0, tensors=d)).reason.startswith("invalid")
    d = _delta(0)
    del d["b.bias"]
    assert syncer.submit(_contrib(0, tensors=d)).reason.startswith("invalid")
    c = _contrib(0)
    c.tensors["b.bias"] += 1.0  # tampered after the checksum was taken
    assert syncer.submit(c).reason.startswith("checksum")
    assert syncer.submit(_contrib(0, job="other")).reason.startswith("wrong_job")
    assert syncer.submit(_contrib(0, base_version=7)).reason.startswith("future")
    assert syncer.pending_count(0) == 0


def test_the_engine_does_not_fence_and_withdraw_takes_work_back_out():
    """Fencing is the caller's (SyncerLoop: token ranges against the successor's resume point;
    its cases are in tests/runtime/test_syncer_protocol.py): a newer incarnation does not push
    its predecessor's pending contribution out, an older one is still accepted, and withdraw()
    takes one back out; a state round trip keeps the predecessor's."""
    syncer = Syncer(_config(quorum=3), _initial(), ManualClock())
    assert syncer.submit(_contrib(0, incarnation=0)).accepted
    assert syncer.submit(_contrib(0, incarnation=1, seed=5)).accepted
    assert syncer.submit(_contrib(1, incarnation=2)).accepted
    assert syncer.submit(_contrib(1, incarnation=1, seed=6)).accepted  # arrived late, still taken
    assert syncer.pending_count(0) == 4
    restored = Syncer(_config(quorum=3), _initial(), ManualClock())
    restored.load_state_dict(syncer.state_dict())
    assert restored.pending_count(0) == 4
    assert syncer.withdraw((1, 1, 0, 0)) and not syncer.withdraw((1, 1, 0, 0))
    assert syncer.pending_count(0) == 3
    result = syncer.merge(0, force=True)
    assert {(c["learner"], c["incarnation"]) for c in result.contributors} == {(0, 0), (0, 1), (1, 2)}


def test_idempotent_across_state_dict_restore():
    cfg = _config(quorum=1, outer_lr=0.7, outer_momentum=0.9)
    syncer = Syncer(cfg, _initial(), ManualClock())
    syncer.submit(_contrib(0))
    syncer.merge(0)
    syncer.submit(_contrib(1, base_version=0))  # pending at checkpoint time
    blob = pack(syncer.state_dict())
    restored = Syncer(cfg, _initial(seed=5), ManualClock())
    restored.load_state_dict(unpack(blob))
    assert restored.versions == {0: 1}
    assert restored.pending_count(0) == 1
    r = restored.submit(_contrib(0))  # redelivered after the restart
    assert not r.accepted and r.reason.startswith("duplicate")
    syncer.merge(0)
    restored.merge(0)
    for n in SHAPES:
        assert torch.equal(syncer.params[n], restored.params[n])
        assert torch.equal(syncer.momentum[n], restored.momentum[n])


def test_rda_averages_direction_and_magnitude_apart():
    shapes = {"wte.weight": (3, 2), "h.weight": (2, 2)}
    init = {n: torch.zeros(s) for n, s in shapes.items()}
    cfg = _config(learners=2, quorum=2, outer_lr=1.0, outer_momentum=0.0, rda=True)
    syncer = Syncer(cfg, init, ManualClock())
    a = {"wte.weight": torch.ones(3, 2), "h.weight": torch.tensor([[3.0, 0.0], [0.0, 0.0]])}
    b = {"wte.weight": -torch.ones(3, 2), "h.weight": torch.tensor([[0.0, 1.0], [0.0, 0.0]])}
    for i, d in enumerate((a, b)):
        syncer.submit(Contribution("local", i, 0, 0, 0, 100, 4, d))
    syncer.merge(0)
    # embedding: plain weighted mean -> 0; other tensors: mean direction (1,1)/sqrt2 scaled to mean norm 2
    torch.testing.assert_close(syncer.params["wte.weight"], torch.zeros(3, 2))
    expected = -torch.tensor([[1.0, 1.0], [0.0, 0.0]]) / 2**0.5 * 2.0
    torch.testing.assert_close(syncer.params["h.weight"], expected)


def test_compressed_global_updates_rebuild_the_published_weights_bit_exactly():
    """With global_compression, a learner that adds each update holds the syncer's published
    weights exactly, and the rounding residual params - published stays bounded (error feedback)."""
    from trainer.protocol import GlobalFragment

    cfg = _config(learners=1, quorum=1, outer_momentum=0.5, global_compression="int4")
    init = _initial()
    syncer = Syncer(cfg, init, ManualClock())
    held = {n: t.clone() for n, t in init.items()}
    residuals = []
    for v in range(8):
        small = {n: t * 0.01 for n, t in _delta(v).items()}
        syncer.submit(_contrib(0, base_version=v, tensors=small))
        syncer.merge(0)
        blob = syncer.global_update(0)
        update = GlobalFragment.from_bytes(blob, expected=SHAPES)
        assert update.is_update and (update.base_version, update.version) == (v, v + 1)
        held = {n: held[n] + update.tensors[n] for n in held}
        for n in held:
            assert torch.equal(held[n], syncer.published[n])
            assert torch.equal(syncer.global_fragment(0).tensors[n], syncer.published[n])
        residuals.append(max(float((syncer.params[n] - syncer.published[n]).abs().max()) for n in held))
    step = max(float(t.abs().max()) for t in _delta(0).values()) * 0.01 * 0.7 * 3
    assert max(residuals) < step  # never accumulates beyond one update's rounding
    restored = Syncer(cfg, init, ManualClock())
    restored.load_state_dict(unpack(pack(syncer.state_dict())))
    assert restored.global_update(0) == syncer.global_update(0)
    for n in held:
        assert torch.equal(restored.published[n], syncer.published[n])


def test_uncompressed_publication_is_the_global_itself():
    syncer = Syncer(_config(learners=1, quorum=1), _initial(), ManualClock())
    syncer.submit(_contrib(0))
    syncer.merge(0)
    assert syncer.global_update(0) is None
    for n, t in syncer.global_fragment(0).tensors.items():
        assert torch.equal(t, syncer.params[n])


def test_update_history_chains_a_learner_several_versions_behind():
    """global_updates(p, held) hands out the chain held+1 .. current while every link is kept
    (the newest UPDATE_HISTORY), survives a state round trip, and loads the older one-update state."""
    from trainer.protocol import GlobalFragment
    from trainer.syncer import UPDATE_HISTORY

    cfg = _config(learners=1, quorum=1, global_compression="int4", max_staleness=20)
    init = _initial()
    syncer = Syncer(cfg, init, ManualClock())
    held = {n: t.clone() for n, t in init.items()}
    for v in range(UPDATE_HISTORY + 2):
        syncer.submit(_contrib(0, base_version=v, tensors={n: t * 0.01 for n, t in _delta(v).items()}))
        syncer.merge(0)
        if v == 2:
            chain = syncer.global_updates(0, 0)
            assert [GlobalFragment.from_bytes(b).base_version for b in chain] == [0, 1, 2]
            for b in chain:  # added in order, as the syncer added them: the same bits
                held = {n: held[n] + GlobalFragment.from_bytes(b).tensors[n] for n in held}
            assert all(torch.equal(held[n], syncer.published[n]) for n in held)
    current = UPDATE_HISTORY + 2
    assert syncer.global_updates(0, current) is None  # nothing to fetch
    assert len(syncer.global_updates(0, current - UPDATE_HISTORY)) == UPDATE_HISTORY
    assert syncer.global_updates(0, current - UPDATE_HISTORY - 1) is None  # the oldest link is gone
    assert syncer.global_update(0) == syncer.global_updates(0, current - 1)[0]

    restored = Syncer(cfg, init, ManualClock())
    restored.load_state_dict(unpack(pack(syncer.state_dict())))
    assert restored.global_updates(0, current - 3) == syncer.global_updates(0, current - 3)
    old = syncer.state_dict()
    old["updates"] = {0: old["updates"][0][current]}  # the format before the history
    restored.load_state_dict(old)
    assert restored.global_update(0) == syncer.global_update(0)
    assert restored.global_updates(0, current - 2) is None


def test_huge_finite_contribution_is_accepted_and_a_nan_deep_inside_is_not():
    cfg = _config(quorum=1)
    syncer = Syncer(cfg, _initial(), ManualClock())
    huge = {n: torch.full(s, 3.0e38) for n, s in SHAPES.items()}  # its norm overflows fp32
    assert syncer.submit(_contrib(0, tensors=huge)).accepted
    bad = _delta(1)
    bad["a.weight"][3, 2] = float("nan")
    r = syncer.submit(_contrib(1, tensors=bad))
    assert not r.accepted and r.reason == "nonfinite: a.weight holds NaN or Inf"


def test_merge_result_keeps_the_version_it_names_after_later_merges():
    """The result's global fragment is copied when read, or by the syncer before the fragment
    changes again: read after two more merges it still holds the version it names."""
    cfg = _config(quorum=1)
    syncer = Syncer(cfg, _initial(), ManualClock())
    syncer.submit(_contrib(0))
    first = syncer.merge(0)
    at_v1 = {n: t.clone() for n, t in syncer.params.items()}
    for v in (1, 2):
        syncer.submit(_contrib(0, base_version=v))
        syncer.merge(0)
    g = first.global_fragment
    assert first.version == g.version == 1 and syncer.versions[0] == 3
    assert all(torch.equal(g.tensors[n], at_v1[n]) for n in SHAPES)
    assert not any(torch.equal(g.tensors[n], syncer.params[n]) for n in SHAPES)
    assert first.global_fragment is g  # taken once


def test_merge_health_matches_the_plain_computation():
    cfg = _config(learners=3, quorum=3, rda=True)
    syncer = Syncer(cfg, _initial(), ManualClock())
    deltas = [_delta(i) for i in range(3)]
    for i, d in enumerate(deltas):
        assert syncer.submit(_contrib(i, tokens=100 * (i + 1), tensors=d)).accepted
    before = {n: t.clone() for n, t in syncer.params.items()}
    res = syncer.merge(0)
    # the outer step at momentum's first use is x -= lr * (g + mu g): recover the merged g
    merged = {n: (before[n] - syncer.params[n]) / (0.7 * 1.9) for n in SHAPES}
    flat_m = torch.cat([merged[n].reshape(-1) for n in SHAPES])
    assert res.merged_norm == pytest.approx(float(flat_m.norm()), rel=1e-4)
    for c, d in zip(res.contributors, deltas, strict=True):
        flat_d = torch.cat([d[n].reshape(-1) for n in SHAPES])
        assert c["norm"] == pytest.approx(float(flat_d.norm()), rel=1e-6)
        want = float(torch.nn.functional.cosine_similarity(flat_d, flat_m, dim=0))
        assert c["cosine"] == pytest.approx(want, abs=1e-4)
