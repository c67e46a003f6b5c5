"""`python -m trainer.bench.island`: what an island costs on this machine (printed, not asserted).

One learner as 1 process, then as an island of W processes (`--parallelism ddp` or `fsdp`, over
gloo on CPU): the island's start (followers' interpreter + torch import + model, rendezvous, DDP's
first broadcast), the wall time of an inner step of the same batch, and what rank 0 sends its
followers when it adopts a global fragment (its weights and base) or resumes (the whole learner
state). With fsdp also what "rank 0 gathers" costs against "each rank sends its shard": the
gather of a fragment to rank 0, and encoding the contribution of the whole fragment against a
1/W shard of it (what each rank would encode in parallel instead).
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


def _ddp_costs(island, per: float) -> list[str]:
    from trainer.protocol import GlobalFragment

    params = sum(t.numel() for t in island.params.values())
    weights = {n: island.params[n].detach().float().clone() for n in island.fragments[0]}
    island.adopt(GlobalFragment("bench", 0, 1, weights))
    t1 = time.perf_counter()
    island.step()
    adopt = time.perf_counter() - t1 - per
    state = len(island._state_bytes())
    island._full = True
    t1 = time.perf_counter()
    island.step()
    full = time.perf_counter() - t1 - per
    return [f"adopting fragment 0 ({4 * params / 1e6:.1f} MB x 2 broadcast): +{adopt * 1e3:.1f} ms "
            "on the next step",
            f"whole state ({state / 1e6:.1f} MB, once per incarnation): +{full * 1e3:.1f} ms"]


def _timed(fn, n: int = 5) -> tuple[float, object]:
    out = fn()  # warm
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn()
    return (time.perf_counter() - t0) / n, out


def _fsdp_costs(island, per: float) -> list[str]:
    from trainer.island_fsdp import shard_rows
    from trainer.protocol import Contribution, GlobalFragment

    names = island.fragments[0]
    nbytes = 4 * sum(island.params[n].numel() for n in names)
    gather, whole = _timed(lambda: island._gather_fragment(0))

    def contribution(tensors: dict) -> Contribution:
        return Contribution("bench", 0, 0, 0, 0, 1, 1, tensors)

    def shard(t):
        first, rows = shard_rows(t.shape[0], island.world)[0]
        return t.narrow(0, first, rows).contiguous()

    enc_whole, _ = _timed(lambda: contribution(whole).to_bytes("none"))
    enc_shard, _ = _timed(lambda: contribution({n: shard(t) for n, t in whole.items()}).to_bytes("none"))
    version = iter(range(1, 1000))
    adopt, _ = _timed(lambda: island.adopt(GlobalFragment("bench", 0, next(version), whole)))
    save, state = _timed(island.state_dict, 2)
    load, _ = _timed(lambda: island.load_state_dict(state), 2)
    return [f"gather fragment 0 to rank 0 ({nbytes / 1e6:.1f} MB): {gather * 1e3:.1f} ms "
            f"({gather / per:.2f} of a step)",
            f"encode its contribution (none): whole {enc_whole * 1e3:.1f} ms, one 1/{island.world} shard "
            f"{enc_shard * 1e3:.1f} ms (each rank sending its shard would save rank 0 "
            f"{1e3 * (enc_whole - enc_shard):.1f} ms per contribution)",
            f"adopt fragment 0 (gather, mix, broadcast weights and base): {adopt * 1e3:.1f} ms",
            f"checkpoint (gather weights and moments): {save * 1e3:.1f} ms; resume (broadcast the state): "
            f"{load * 1e3:.1f} ms"]


def main(argv: list[str] | None = None) -> int:
    from trainer.island import teardown
    from trainer.island_kind import make_island
    from trainer.runtime.island_rank import IslandSpec, start

    p = argparse.ArgumentParser(prog="python -m trainer.bench.island", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parallelism", choices=("ddp", "fsdp"), default="ddp")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    config = TrainConfig(model=a.model, learners=1, quorum=1, batch_size=a.batch_size, seq_len=a.seq_len,
                         steps=10_000, warmup_steps=1)
    corpus = load_corpus(config)
    one = _steps(Learner(config, 0, corpus=corpus), a.steps)
    t0 = time.perf_counter()
    followers = start(IslandSpec(config=config.to_dict(), islands=[(0, list(range(a.devices)))],
                                 parallelism=a.parallelism))
    t_join = time.perf_counter() - t0
    try:
        island = make_island(config, 0, ranks=list(range(a.devices)), corpus=corpus,
                             parallelism=a.parallelism)
        t_start = time.perf_counter() - t0
        island.step()  # the first step carries the whole state (ddp)
        per = _steps(island, a.steps)
        costs = (_fsdp_costs if a.parallelism == "fsdp" else _ddp_costs)(island, per)
        island.stop_followers()
    finally:
        teardown()
        followers.close()
    params = sum(t.numel() for t in island.params.values())
    print(f"model {a.model} ({params / 1e6:.2f} M params), batch {a.batch_size}x{a.seq_len}, "
          f"{a.devices} processes ({a.parallelism}), gloo on CPU, 1 thread each")
    print(f"island start: {t_join:.1f} s to the rendezvous, {t_start:.1f} s to the first step")
    print(f"inner step: 1 process {one * 1e3:.1f} ms, island of {a.devices} {per * 1e3:.1f} ms "
          f"({one / per:.2f}x)")
    for line in costs:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
