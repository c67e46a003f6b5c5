"""The loss model of the declared models: it reproduces the published DiLoCo table and inverts."""
from __future__ import annotations

import pytest

from trainer.bench import loss_model as lm


@pytest.mark.parametrize("n", lm.SIZES)
@pytest.mark.parametrize("j", range(len(lm.LEARNERS)))
def test_published_points_are_reproduced(n, j):
    assert lm.penalty(n, lm.LEARNERS[j]) == pytest.approx(lm.PUBLISHED[n][j], abs=1e-12)
    assert not lm.penalty_is_extrapolated(n, lm.LEARNERS[j])


def test_interpolation_lies_between_its_neighbours_and_extrapolation_is_labelled():
    mid = lm.penalty(60e6, 4)  # between 35M (+2.0 %) and 90M (+1.5 %)
    assert 0.015 < mid < 0.020
    m3 = lm.penalty(35e6, 3)  # between M=2 (+0.7 %) and M=4 (+2.0 %)
    assert 0.007 < m3 < 0.020
    assert lm.penalty(12e9, 4) == lm.PUBLISHED[2.4e9][2]  # held at the largest published size
    assert lm.penalty(10e6, 4) > lm.PUBLISHED[35e6][2]  # and growing below the smallest
    assert lm.penalty_is_extrapolated(12e9, 4) and lm.penalty_is_extrapolated(35e6, 16)
    assert lm.penalty(1e9, 0) == 0.0  # data-parallel


def test_tokens_to_reach_inverts_the_loss():
    for n, m in ((9e9, 8), (12e9, 4), (35e6, 4)):
        d = 20 * n
        target = lm.loss(n, d, m)
        assert lm.tokens_to_reach(n, target, m) == pytest.approx(d, rel=1e-9)
    # DiLoCo needs more tokens than data-parallel for data-parallel's loss at 12B, M=4
    target = lm.loss(12e9, 240e9)
    assert lm.tokens_to_reach(12e9, target, 4) > 240e9
    assert lm.tokens_to_reach(12e9, 1.0) is None  # below the irreducible loss


def test_time_to_target_rule():
    target = lm.loss(9e9, 180e9)
    t_dp = lm.time_to_target(9e9, target, 0, tokens_per_s=1e6)
    assert t_dp == pytest.approx(180e9 / 1e6)
    # three times the rate reaches it sooner, despite the penalty; a cap turns it into None
    t_dec = lm.time_to_target(9e9, target, 8, tokens_per_s=3e6)
    assert t_dec is not None and t_dec < t_dp
    assert lm.time_to_target(9e9, target, 8, tokens_per_s=3e6, cap_tokens=180e9) is None
    assert lm.time_to_target(9e9, target, 8, tokens_per_s=0) is None


def test_bench_estimate_rows_are_labelled_and_follow_the_rule():
    from trainer.bench.report import estimate, estimate_text
    from trainer.bench.scenarios import SCENARIOS

    scn = SCENARIOS["chaos"](True, 0)
    tokens = 1e11
    results = {r.label: {"tokens": tokens, "time_s": 100.0} for r in scn.rows}
    results["ddp"]["time_s"] = 300.0  # data-parallel sustained a third of the rate
    est = estimate(scn, results)
    rows = {x["strategy"]: x for x in est["rows"]}
    assert rows["ddp"]["learners"] == 0 and rows["elastic-ddp"]["learners"] == 0
    assert rows["decoupled"]["learners"] == scn.rows[0].spec.learners and rows["decoupled"]["penalty"] > 0
    target = lm.loss(scn.rows[0].spec.model.params, tokens) * 1.01
    assert est["target_loss"] == pytest.approx(target)
    assert rows["ddp"]["time_to_target_s"] == pytest.approx(lm.tokens_to_reach(
        scn.rows[0].spec.model.params, target) / (tokens / 300.0))
    assert rows["decoupled"]["vs_reference"] > 1  # three times the rate outweighs a ~1 % penalty
    results["decoupled"]["time_s"] = 1e9  # a strategy that barely moves is slower, not hidden
    slow = {x["strategy"]: x for x in estimate(scn, results)["rows"]}["decoupled"]
    assert slow["time_to_target_s"] > rows["ddp"]["time_to_target_s"] and slow["vs_reference"] < 1
    text = estimate_text({"estimate": est})
    assert "ESTIMATE" in text and "not measured" in text
