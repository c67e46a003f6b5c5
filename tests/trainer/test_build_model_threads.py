"""build_model from several threads at once (the syncer worker runs each job's syncer as a
thread): every model gets exactly its seed's weights."""
from __future__ import annotations

import threading

import torch

from trainer.models import build_model


def test_concurrent_builds_give_each_seed_its_own_weights():
    torch.set_num_threads(1)
    expected = {seed: build_model("tiny", seq_len=32, seed=seed).state_dict() for seed in (1, 2)}
    results: dict[tuple[int, int], dict] = {}

    def build(seed: int, i: int) -> None:
        results[(seed, i)] = build_model("tiny", seq_len=32, seed=seed).state_dict()

    threads = [threading.Thread(target=build, args=(seed, i)) for i in range(4) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (seed, _), state in results.items():
        assert all(torch.equal(state[k], expected[seed][k]) for k in state), f"seed {seed} drew other weights"
