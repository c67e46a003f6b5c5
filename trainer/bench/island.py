"""`python -m trainer.bench.island`: what an island costs on this machine (printed, not asserted).

One learner as 1 process, then as an island of W processes (DDP over gloo on CPU): the island's
start (followers' interpreter + torch import + model, rendezvous, DDP's first broadcast), the
wall time of an inner step of the same batch, and what rank 0 sends its followers when it
adopts a global fragment (its weights and base) or resumes (the whole learner state).
"""
from __future__ import annotations

import argparse
import time

import torch

from trainer.config import TrainConfig
from trainer.learner import Learner, load_corpus


def _steps(learner, n: int) -> float:
    learner.step()  # warm
    t0 = time.perf_counter()
    for _ in range(n):
        learner.step()
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    from trainer.island import IslandLearner, teardown
    from trainer.protocol import GlobalFragment
    from trainer.runtime.island_rank import IslandSpec, start

    p = argparse.ArgumentParser(prog="python -m trainer.bench.island", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    config = TrainConfig(model=a.model, learners=1, quorum=1, batch_size=a.batch_size, seq_len=a.seq_len,
                         steps=10_000, warmup_steps=1)
    corpus = load_corpus(config)
    one = _steps(Learner(config, 0, corpus=corpus), a.steps)
    t0 = time.perf_counter()
    followers = start(IslandSpec(config=config.to_dict(), islands=[(0, list(range(a.devices)))]))
    t_join = time.perf_counter() - t0
    try:
        island = IslandLearner(config, 0, ranks=list(range(a.devices)), corpus=corpus)
        t_start = time.perf_counter() - t0
        island.step()  # the first step carries the whole state
        per = _steps(island, a.steps)
        g = GlobalFragment("bench", 0, 1, {n: island.params[n].detach().float().clone()
                                           for n in island.fragments[0]})
        island.adopt(g)
        t1 = time.perf_counter()
        island.step()
        adopt = time.perf_counter() - t1 - per
        state = len(island._state_bytes())
        island._full = True
        t1 = time.perf_counter()
        island.step()
        full = time.perf_counter() - t1 - per
        island.stop_followers()
    finally:
        teardown()
        followers.close()
    params = sum(t.numel() for t in island.params.values())
    print(f"model {a.model} ({params / 1e6:.2f} M params), batch {a.batch_size}x{a.seq_len}, "
          f"{a.devices} processes, gloo on CPU, 1 thread each")
    print(f"island start: {t_join:.1f} s to the rendezvous, {t_start:.1f} s to the first step")
    print(f"inner step: 1 process {one * 1e3:.1f} ms, island of {a.devices} {per * 1e3:.1f} ms "
          f"({one / per:.2f}x)")
    print(f"adopting fragment 0 ({4 * params / 1e6:.1f} MB x 2 broadcast): +{adopt * 1e3:.1f} ms "
          "on the next step")
    print(f"whole state ({state / 1e6:.1f} MB, once per incarnation): +{full * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
