"""An island over two "nodes" on CPU with gloo (both on 127.0.0.1 here): rank 0 hosts the rendezvous and
announces its port, the other node's ranks start from it (`start_node`, what a node's task runs),
train in step and stop when told; a leader that falls silent (a partition) makes them exit on their
own after the collective timeout instead of lingering."""

from __future__ import annotations

import time

from trainer.island import teardown
from trainer.island_kind import make_island
from trainer.runtime.island_rank import IslandSpec, start, start_node

TIMEOUT_S = 8.0


def _island(small_config, stdlib_corpus):
    """Rank 0 here, rank 1 on "node 1" started through the announced port."""
    config = small_config(learners=1, quorum=1, steps=10_000, batch_size=4, seq_len=32)
    spec = IslandSpec(config=config.to_dict(), islands=[(0, [0, 1])], timeout_s=TIMEOUT_S, nodes=2)
    assert spec.node_ranks(0) == [0] and spec.node_ranks(1) == [1]
    remote = []
    local = start(spec, lambda port: remote.append(start_node(spec, 1, "127.0.0.1", port)))
    assert local.procs == [] and len(remote) == 1  # rank 0's node runs no follower, node 1 runs rank 1
    learner = make_island(config, 0, ranks=[0, 1], corpus=stdlib_corpus, timeout_s=TIMEOUT_S)
    return learner, local, remote[0]


def test_the_other_nodes_ranks_follow_and_stop_when_told(small_config, stdlib_corpus):
    """Rank 1 on the other node steps with rank 0: the island's losses and weights are a one-process
    learner's on the same batches (up to the order of float sums); then it stops and exits 0."""
    import pytest
    import torch

    from trainer.learner import Learner

    learner, local, remote = _island(small_config, stdlib_corpus)
    plain = Learner(learner.config, 0, corpus=stdlib_corpus)
    try:
        for _ in range(3):
            ours, theirs = learner.step(), plain.step()
            assert ours.loss == pytest.approx(theirs.loss, rel=1e-4) and ours.tokens == theirs.tokens
        assert learner.tokens == 3 * 4 * 32  # the island's batch, counted once
        for n, t in plain.params.items():
            torch.testing.assert_close(learner.params[n].detach(), t.detach(), rtol=1e-3, atol=2e-5, msg=n)
        learner.stop_followers()
    finally:
        teardown()
        local.close()
    remote.close(grace=30)
    assert [p.returncode for p in remote.procs] == [0]


def test_the_other_nodes_ranks_exit_on_their_own_when_the_leader_falls_silent(small_config, stdlib_corpus):
    """No packet from rank 0 any more (what a partition looks like): rank 1's next collective times
    out after ISLAND_TIMEOUT_S and it exits with an error; it never waits for a leader that is gone."""
    learner, local, remote = _island(small_config, stdlib_corpus)
    try:
        learner.step()
        deadline = time.monotonic() + TIMEOUT_S + 60  # the timeout, plus a loaded machine's slack
        while remote.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not remote.running(), "rank 1 still waits for a silent leader"
        assert remote.failed() == remote.pids
    finally:
        teardown()
        local.kill()
        remote.kill()
