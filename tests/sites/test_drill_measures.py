"""The sites drill's and the WAN benchmark's arithmetic on rows made by hand (no namespaces)."""
from __future__ import annotations

from harness.drill import duplicates, fenced_applied, gaps
from harness.wan import markdown, speedups


def step(t, learner, incarnation, start, end, fragment=0):
    return (t, fragment, [{"learner": learner, "incarnation": incarnation, "ranges": [[start, end]]}])


def test_duplicates_are_overlapping_ranges_of_one_learner_and_fragment():
    steps = [step(1, 0, 1, 0, 100), step(2, 0, 2, 100, 200), step(3, 1, 1, 0, 100), step(4, 0, 2, 150, 250)]
    found = duplicates(steps)
    assert len(found) == 1 and found[0]["learner"] == 0
    assert duplicates(steps[:3]) == []
    assert duplicates([step(1, 0, 1, 0, 100), step(2, 0, 1, 0, 100, fragment=1)]) == []


def test_fencing_counts_late_predecessor_work_and_violations_apart():
    incident = {"learner": 0, "incarnation": 1, "detected_at": 10.0}
    # incarnation 1's [100, 200) lands after the loss was detected; the successor resumed at 200
    ok = [step(5, 0, 1, 0, 100), step(11, 0, 1, 100, 200), step(12, 0, 2, 200, 300)]
    assert fenced_applied(ok, [incident]) == {"late": 1, "violations": 0}
    # ... or the successor computed [100, 200) again: the late one is a violation
    bad = [step(5, 0, 1, 0, 100), step(11, 0, 1, 100, 200), step(12, 0, 2, 100, 200)]
    assert fenced_applied(bad, [incident]) == {"late": 1, "violations": 1}


def test_gaps_are_the_longest_stretch_between_outer_steps():
    assert gaps([step(t, 0, 1, t, t + 1) for t in (0.0, 1.0, 4.5, 5.0)])["max_outer_step_gap_s"] == 3.5
    assert gaps([])["max_outer_step_gap_s"] is None


def test_speedups_compare_each_strategy_with_data_parallel_at_its_bandwidth():
    runs = [{"strategy": "data-parallel", "bandwidth_mbit": 20, "time_to_target_s": 400.0,
             "bytes_per_token": 900.0, "final_loss": 3.0, "wall_s": 400, "uplink_bytes": 9e8,
             "status": "completed"},
            {"strategy": "decoupled", "bandwidth_mbit": 20, "time_to_target_s": 20.0, "bytes_per_token": 3.0,
             "final_loss": 2.9, "wall_s": 30, "uplink_bytes": 3e6, "status": "completed"},
            {"strategy": "diloco", "bandwidth_mbit": 20, "time_to_target_s": None, "bytes_per_token": 3.0,
             "final_loss": None, "wall_s": None, "uplink_bytes": 0, "status": "failed"}]
    ratios = speedups(runs)
    assert [(r["strategy"], r["sooner_x"], r["fewer_bytes_per_token_x"]) for r in ratios] == [
        ("decoupled", 20.0, 300.0), ("diloco", None, 300.0)]
    table = markdown(runs, ratios)
    assert "| decoupled | 20 | 20.0 |" in table and "| diloco | 20 | - | - | - | - | - | failed |" in table
