from __future__ import annotations

import pytest

from trainer.fragments import fragment_numel, make_fragments, sync_schedule
from trainer.models import build_model


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seq_len=16)


@pytest.mark.parametrize("mode", ["strided", "balanced"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 7, 24])
def test_fragments_partition_the_parameters(model, mode, P):
    frags = make_fragments(model, P, mode)
    names = [n for n, _ in model.named_parameters()]
    flat = [n for f in frags for n in f]
    assert len(frags) == P and all(frags)
    assert sorted(flat) == sorted(names) and len(set(flat)) == len(flat)
    assert make_fragments(model, P, mode) == frags  # deterministic


def test_strided_spreads_blocks_over_fragments(model):
    frags = make_fragments(model, 2, "strided")
    blocks = [{n.split(".")[1] for n in f if n.startswith("blocks.")} for f in frags]
    assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]
    assert all(len({n.split(".")[1] for n in f if n.startswith("blocks.")}) >= 1 for f in frags)


def test_balanced_is_balanced(model):
    sizes = fragment_numel(model, make_fragments(model, 4, "balanced"))
    assert max(sizes) / min(sizes) < 1.15


def test_too_many_fragments_refused(model):
    with pytest.raises(ValueError, match="only"):
        make_fragments(model, 1000)
    with pytest.raises(ValueError, match="mode"):
        make_fragments(model, 2, "random")


@pytest.mark.parametrize(("H", "P"), [(1, 1), (20, 1), (20, 4), (24, 24), (10, 3), (5, 5)])
def test_schedule_each_fragment_once_per_cycle_staggered(H, P):
    due = {p: [] for p in range(P)}
    for step in range(1, 3 * H + 1):
        for p in sync_schedule(step, H, P):
            due[p].append(step)
    for p in range(P):
        assert len(due[p]) == 3
        assert due[p][1] - due[p][0] == H
    if P == 1:
        assert due[0] == [H, 2 * H, 3 * H]
    firsts = sorted(d[0] for d in due.values())
    assert len(set(firsts)) == P  # staggered: no two at once
    assert sync_schedule(0, H, P) == []
