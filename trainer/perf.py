"""`python -m trainer.perf`: engine overheads, printed (never asserted).

1. Learner step overhead: `Learner.step()` (with its schedule, counters and contributions)
   against a bare loop over the same model, optimizer and data (`model.loss`, backward,
   clipping, AdamW).
2. Syncer throughput: `Syncer.merge` (token-weighted merge + Nesterov outer step) over K
   fp32 pseudo-gradients of a whole model, in GB/s of pseudo-gradient read, against a plain
   `torch.add_` of the same tensors into an accumulator (the memory-bandwidth limit), plus
   `Syncer.submit` (validation: shapes, finiteness, checksum) and the wire encode/decode.

The learner part runs on any device (`--device cuda --bf16` on a GPU machine: tokens/s of the
learner against the bare loop, both under the same bf16 autocast); the syncer part on the CPU,
where the coordinator runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from trainer.clock import WallClock
from trainer.compression import decode, encode
from trainer.config import TrainConfig
from trainer.data import TokenStream
from trainer.learner import Learner, load_corpus
from trainer.models import autocast, build_model, pick_device
from trainer.optimizers import make_optimizer
from trainer.protocol import Contribution
from trainer.syncer import Syncer


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_learner(
    model: str,
    batch_size: int,
    seq_len: int,
    steps: int,
    inner_steps: int,
    fragments: int,
    cache_dir: str | None,
    device: str = "cpu",
    bf16: bool = False,
) -> dict:
    cfg = TrainConfig(
        model=model,
        learners=1,
        quorum=1,
        inner_steps=inner_steps,
        fragments=fragments,
        batch_size=batch_size,
        seq_len=seq_len,
        steps=10**6,
        warmup_steps=1,
        cache_dir=cache_dir,
        device=device,
        bf16=bf16,
        threads=None,
    )
    dev = pick_device(device)
    corpus = load_corpus(cfg)
    net = build_model(model, seq_len, 0, corpus.vocab_size).to(dev)
    net.train()
    opt = make_optimizer(net, cfg, dev)
    stream = TokenStream(corpus, 0, 1, batch_size, seq_len, 0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def bare_step() -> None:
        x, y = stream.next_batch()
        x, y = x.to(dev), y.to(dev)
        with autocast(dev, bf16):
            loss = net.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    learner = Learner(cfg, 0, corpus=corpus, num_learners=1)

    def learner_step() -> None:
        learner.step()  # reads the loss back (.item()), so the device is in step afterwards
        learner.due_contributions()
        sync()

    for _ in range(3):
        bare_step()
        learner_step()
    # whole H-cycles, so the steps that send a contribution count as often as they happen
    steps = max(1, -(-steps // inner_steps)) * inner_steps
    bare, ours = [], []
    for _ in range(steps):  # interleaved, so both see the same machine load
        bare.append(_median_time(bare_step, 1))
        ours.append(_median_time(learner_step, 1))
    b, o = statistics.median(bare), statistics.median(ours)
    mean_b, mean_o = statistics.fmean(bare), statistics.fmean(ours)
    tokens = batch_size * seq_len
    return {
        "model": model,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type,
        "bf16": bf16,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "inner_steps": inner_steps,
        "fragments": fragments,
        "steps": steps,
        "bare_ms_median": b * 1e3,
        "learner_ms_median": o * 1e3,
        "bare_ms_mean": mean_b * 1e3,
        "learner_ms_mean": mean_o * 1e3,
        "overhead_pct_median": (o - b) / b * 100,
        "overhead_pct_mean": (mean_o - mean_b) / mean_b * 100,
        # throughput from the mean over whole cycles (a median hides the periodic sends)
        "bare_tokens_per_s": tokens / mean_b,
        "learner_tokens_per_s": tokens / mean_o,
        "learner_vs_bare_pct": mean_b / mean_o * 100,
        "bare_tokens_per_s_median": tokens / b,
        "learner_tokens_per_s_median": tokens / o,
    }


def bench_syncer(model: str, contributions: int, repeats: int) -> dict:
    net = build_model(model, 64, 0)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    numel = sum(t.numel() for t in params.values())
    cfg = TrainConfig(learners=contributions, quorum=contributions, inner_steps=1, fragments=1)
    gen = torch.Generator().manual_seed(0)
    deltas = [
        {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in params.items()}
        for _ in range(contributions)
    ]
    contribs = [Contribution("bench", m, 0, 0, 0, 1000 + m, 10, deltas[m]) for m in range(contributions)]
    syncer = Syncer(cfg, params, clock=WallClock(), job="bench")
    round_no = [0]

    def submit_all() -> None:
        for m, c in enumerate(contribs):
            c.base_version = syncer.versions[0]
            c.learner = m
            r = syncer.submit(c)
            if not r.accepted:
                raise RuntimeError(r.reason)

    def merge() -> None:
        syncer.merge(0)

    submit_t, merge_t = [], []
    for _ in range(repeats + 1):
        submit_t.append(_median_time(submit_all, 1))
        merge_t.append(_median_time(merge, 1))
        round_no[0] += 1
    submit_s, merge_s = statistics.median(submit_t[1:]), statistics.median(merge_t[1:])
    names = list(params)
    acc = [torch.zeros_like(params[n]) for n in names]
    lists = [[d[n] for n in names] for d in deltas]

    def plain_add() -> None:
        for lst in lists:
            for a, t in zip(acc, lst, strict=True):
                a.add_(t)

    def foreach_add() -> None:
        for lst in lists:
            torch._foreach_add_(acc, lst)

    plain_add()
    plain_s = _median_time(plain_add, repeats)
    foreach_s = _median_time(foreach_add, repeats)
    blobs = {m: encode(deltas[0], m) for m in ("none", "int4")}  # also the warm-up
    for m in blobs:
        decode(blobs[m])
    enc_s = {m: _median_time(lambda m=m: encode(deltas[0], m), repeats) for m in ("none", "int4")}
    dec_s = {m: _median_time(lambda m=m: decode(blobs[m]), repeats) for m in ("none", "int4")}
    gbytes = contributions * numel * 4 / 1e9
    one = numel * 4 / 1e9
    return {
        "model": model,
        "params": numel,
        "contributions": contributions,
        "pseudo_gradient_gb": gbytes,
        "merge_s": merge_s,
        "merge_gbps": gbytes / merge_s,
        "submit_s": submit_s,
        "submit_gbps": gbytes / submit_s,
        "torch_add_s": plain_s,
        "torch_add_gbps": gbytes / plain_s,
        "torch_foreach_add_gbps": gbytes / foreach_s,
        "merge_vs_add": plain_s / merge_s,
        "encode_none_gbps": one / enc_s["none"],
        "encode_int4_gbps": one / enc_s["int4"],
        "decode_none_gbps": one / dec_s["none"],
        "decode_int4_gbps": one / dec_s["int4"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer.perf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny,small", help="model(s) of the learner bench, comma-separated")
    p.add_argument("--syncer-model", default="small", help="model whose parameters the syncer merges")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed steps per loop")
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--contributions", type=int, default=4, help="K pseudo-gradients per merge")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--device", default="cpu", help="device of the learner bench: cpu, cuda, auto, ...")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in both learner loops")
    p.add_argument("--no-syncer", action="store_true", help="only the learner bench")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    learners = [
        bench_learner(
            model, a.batch_size, a.seq_len, a.steps, a.inner_steps, a.fragments, a.cache_dir,
            device=a.device, bf16=a.bf16,
        )
        for model in a.model.split(",")
    ]
    rows = [row for learner in learners for row in _learner_rows(learner, a)]
    syncer = None
    if not a.no_syncer:
        torch.set_num_threads(a.threads or torch.get_num_threads())
        syncer = bench_syncer(a.syncer_model, a.contributions, a.repeats)
        rows += _syncer_rows(syncer, a)
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>16}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    if a.json:
        with open(a.json, "w") as fh:
            figures = {"learner": learners[0], "learners": learners, "syncer": syncer, "threads": a.threads}
            json.dump(figures, fh, indent=2)
    return 0


def _learner_rows(learner: dict, a: argparse.Namespace) -> list[tuple[str, str, str]]:
    where = f"{learner['device_name']}{', bf16 autocast' if a.bf16 else ''}"
    model = learner["model"]
    return [
        (
            f"learner step, bare loop ({model})",
            f"{learner['bare_ms_mean']:.2f} ms",
            f"mean of {learner['steps']} steps (median {learner['bare_ms_median']:.2f}); "
            f"b={a.batch_size} T={a.seq_len} on {where}",
        ),
        (
            f"learner step, Learner.step ({model})",
            f"{learner['learner_ms_mean']:.2f} ms",
            f"mean (median {learner['learner_ms_median']:.2f}); H={a.inner_steps} P={a.fragments}, "
            "contributions included",
        ),
        (
            f"learner overhead ({model})",
            f"{learner['overhead_pct_mean']:+.1f} %",
            f"mean over whole H-cycles; median {learner['overhead_pct_median']:+.1f} %",
        ),
        (
            f"tokens/s bare / Learner ({model})",
            f"{learner['bare_tokens_per_s']:,.0f} / {learner['learner_tokens_per_s']:,.0f}",
            f"by mean: Learner at {learner['learner_vs_bare_pct']:.1f} % of the bare loop (target >= 97 %)",
        ),
    ]


def _syncer_rows(syncer: dict, a: argparse.Namespace) -> list[tuple[str, str, str]]:
    return [
        (
            "syncer merge + outer step",
            f"{syncer['merge_gbps']:.2f} GB/s",
            f"K={a.contributions} x {syncer['params'] / 1e6:.1f}M fp32 ({a.syncer_model})",
        ),
        ("plain torch add_", f"{syncer['torch_add_gbps']:.2f} GB/s", "same tensors, the bandwidth limit"),
        ("torch _foreach_add_", f"{syncer['torch_foreach_add_gbps']:.2f} GB/s", ""),
        ("merge vs add_", f"{syncer['merge_vs_add']:.2f} x", "1.0 = as fast as a bare add (target >= 0.5)"),
        ("syncer submit (validate)", f"{syncer['submit_gbps']:.2f} GB/s",
         "shape, finite, checksum (target >= 2)"),
        (
            "encode none / int4",
            f"{syncer['encode_none_gbps']:.2f} / {syncer['encode_int4_gbps']:.2f} GB/s",
            "GB/s of fp32 tensors (target >= 1)",
        ),
        (
            "decode none / int4",
            f"{syncer['decode_none_gbps']:.2f} / {syncer['decode_int4_gbps']:.2f} GB/s",
            "with validation; GB/s of fp32 tensors (target >= 1)",
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
