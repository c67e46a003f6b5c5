"""`python -m trainer train ...`: run a strategy in this process and report.

Prints one progress line per outer step (per evaluation round for single/ddp) and a
summary; `--json PATH` writes the report (`--json -` prints it to stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainer.compare import PRESETS
from trainer.config import (
    COMPRESSIONS,
    FRAGMENT_MODES,
    INNER_OPTIMIZERS,
    INNER_STATES,
    STRATEGIES,
    ConfigError,
    TrainConfig,
    default_quorum,
)


def _speeds(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError("speeds: comma-separated numbers, e.g. 1,1,0.5") from exc
    return values


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError("comma-separated integers, e.g. 0,1,2") from exc


def _strategies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown strategy {bad[0]!r}: use {', '.join(STRATEGIES)}")
    return names


def build_parser(preset: dict | None = None) -> argparse.ArgumentParser:
    """`preset` (TrainConfig fields) becomes the defaults of `compare`, so flags override it."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train in this process (M learners + syncer, or a baseline)")
    t.add_argument("--strategy", choices=STRATEGIES, default="decoupled")
    _add_config_options(t)
    t.add_argument("--speeds", type=_speeds, default=None, help="relative learner speeds, e.g. 1,1,1,0.5")
    t.add_argument("--seed", type=int, default=TrainConfig().seed)
    t.add_argument("--json", default=None, help="write the report here ('-' for stdout)")
    t.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    t.add_argument("--devices-per-learner", type=int, default=1,
                   help="processes (devices) per learner: an island, data-parallel inside (trainer.island)")
    t.add_argument("--inner-parallelism", choices=("ddp", "fsdp"), default="ddp",
                   help="how an island's ranks share the inner steps: ddp replicas or fsdp (FSDP2) shards")

    c = sub.add_parser(
        "compare",
        help="strategies side by side at equal tokens over several seeds (gap to the first)",
    )
    c.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="start from these settings (acceptance: issue 3's quality run); flags override")
    c.add_argument("--strategies", type=_strategies, default=["ddp", "decoupled"],
                   help="comma-separated; the first is the baseline (default ddp,decoupled)")
    c.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="comma-separated (default 0,1,2)")
    _add_config_options(c)
    c.add_argument("--baseline-inner-lr", type=float, default=None,
                   help="the baseline's own inner lr (default: --inner-lr, the same as the others)")
    c.add_argument("--baseline-inner-optimizer", choices=INNER_OPTIMIZERS, default=None,
                   help="the baseline's own inner optimizer (default: --inner-optimizer)")
    c.add_argument("--target-gap", type=float, default=0.02,
                   help="print whether each strategy stays within this fraction of the baseline")
    c.add_argument("--json", default=None, help="write the comparison here ('-' for stdout)")
    c.add_argument("--plot", default=None, help="write a PNG of the validation curves here")
    c.add_argument("--markdown", default=None, help="write the table as markdown here")
    c.add_argument("--quiet", "-q", action="store_true", help="no line per run")
    if preset:
        c.set_defaults(**preset)
    return parser


def _add_config_options(t: argparse.ArgumentParser) -> None:
    """The TrainConfig options that `train` and `compare` share."""
    d = TrainConfig()
    t.add_argument("--model", default=d.model, help="tiny|small|base|package.module:factory")
    t.add_argument(
        "--data", default=d.dataset, help="stdlib, a file, a directory or a glob (comma-separated)"
    )
    t.add_argument("--learners", "-M", type=int, default=d.learners)
    t.add_argument("--inner-steps", "-H", type=int, default=d.inner_steps)
    t.add_argument("--fragments", "-P", type=int, default=None, help="default: min(4, H)")
    t.add_argument("--quorum", "-K", type=int, default=None, help="default: max(1, M // 2)")
    t.add_argument("--outer-lr", type=float, default=d.outer_lr)
    t.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    t.add_argument("--outer-momentum-warmup", type=int, default=d.outer_momentum_warmup,
                   help="outer steps over which the outer momentum ramps up from 0")
    t.add_argument("--outer-momentum-decay", type=int, default=None,
                   help="last outer steps over which the outer momentum falls to 0 (0: off; default: "
                   "a sixth of the outer steps, steps // H, rounded down)")
    t.add_argument("--inner-lr", type=float, default=None,
                   help="default: by model and batch (tiny 5e-3; small 7e-4, 2e-3 above 8,192 tokens "
                        "per learner step; others half of small's)")
    t.add_argument("--inner-optimizer", choices=INNER_OPTIMIZERS, default=d.inner_optimizer,
                   help="muon: Muon for the hidden matrices, AdamW for the rest (MuLoCo)")
    t.add_argument("--muon-momentum", type=float, default=d.muon_momentum)
    t.add_argument("--inner-state", choices=INNER_STATES, default=d.inner_state,
                   help="keep or reset the inner optimizer's state of a fragment on adopting a global")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--inner-prox", type=float, default=None,
                   help="pull towards the adopted global per unit of inner lr (0: off; default 0.125 / "
                   "inner lr, e.g. 25 at 5e-3; 0.05 / inner lr above 8,192 tokens per learner step)")
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    t.add_argument("--grad-clip", type=float, default=d.grad_clip)
    t.add_argument("--batch-size", type=int, default=d.batch_size)
    t.add_argument("--seq-len", type=int, default=d.seq_len)
    t.add_argument("--steps", type=int, default=d.steps, help="inner steps per learner")
    t.add_argument("--max-tokens", type=int, default=None)
    t.add_argument("--compression", choices=COMPRESSIONS, default=d.compression)
    t.add_argument(
        "--global-compression",
        choices=COMPRESSIONS,
        default=d.global_compression,
        help="global updates sent down (none: whole fp32 fragments)",
    )
    t.add_argument("--compression-density", type=float, default=d.compression_density,
                   help="share of each chunk the topk2 / topk4 compressions send (0, 0.5]")
    t.add_argument("--max-staleness", type=int, default=d.max_staleness)
    t.add_argument("--grace-cap", type=float, default=d.grace_cap_s, help="seconds")
    t.add_argument("--fragment-mode", choices=FRAGMENT_MODES, default=d.fragment_mode)
    t.add_argument("--final-average", action=argparse.BooleanOptionalAction, default=d.final_average,
                   help="merges after the budget average the learners' models plainly (outer lr 1, no "
                        "momentum, no RDA)")
    t.add_argument("--rda", action=argparse.BooleanOptionalAction, default=d.rda,
                   help="radial-directional averaging of the merged pseudo-gradients (default on)")
    t.add_argument("--mix-alpha", type=float, default=d.mix_alpha)
    t.add_argument("--eval-every", type=int, default=d.eval_every, help="outer steps between evaluations")
    t.add_argument("--eval-batches", type=int, default=d.eval_batches)
    t.add_argument("--device", default=d.device, help="auto|cpu|cuda|xpu|mps|xla")
    t.add_argument("--bf16", action="store_true", help="bf16 autocast")
    t.add_argument("--flush-denormal", action=argparse.BooleanOptionalAction, default=d.flush_denormal,
                   help="flush subnormal floats to zero on the CPU (default on)")
    t.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    t.add_argument("--cache-dir", default=None, help="token cache (default $DILOCO_CACHE_DIR or var/cache)")
    t.add_argument("--tokenizer", default=None, help="local tokenizer.json (needs the tokenizers package)")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    quorum = a.quorum if a.quorum is not None else default_quorum(a.learners)
    return TrainConfig(
        model=a.model,
        dataset=a.data,
        learners=a.learners,
        inner_steps=a.inner_steps,
        fragments=a.fragments,
        quorum=quorum,
        outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum,
        outer_momentum_warmup=a.outer_momentum_warmup,
        outer_momentum_decay=a.outer_momentum_decay,
        inner_lr=a.inner_lr,
        inner_optimizer=a.inner_optimizer,
        muon_momentum=a.muon_momentum,
        inner_state=a.inner_state,
        weight_decay=a.weight_decay,
        inner_prox=a.inner_prox,
        warmup_steps=a.warmup_steps,
        grad_clip=a.grad_clip,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        steps=a.steps,
        max_tokens=a.max_tokens,
        compression=a.compression,
        global_compression=a.global_compression,
        compression_density=a.compression_density,
        max_staleness=a.max_staleness,
        grace_cap_s=a.grace_cap,
        fragment_mode=a.fragment_mode,
        rda=a.rda,
        final_average=a.final_average,
        mix_alpha=a.mix_alpha,
        eval_every=a.eval_every,
        eval_batches=a.eval_batches,
        device=a.device,
        bf16=a.bf16,
        threads=a.threads or None,
        flush_denormal=a.flush_denormal,
        seed=getattr(a, "seed", 0),
        cache_dir=a.cache_dir,
        tokenizer=a.tokenizer,
    )


def _progress_printer(out):
    def show(e: dict) -> None:
        val = e.get("val_loss")
        val_s = f"{val:.4f}" if isinstance(val, float) else "-"
        if "outer_step" in e:
            line = (
                f"[{e['strategy']}] outer {e['outer_step']:>4} frag {e['fragment']} v{e['version']} "
                f"k={e['contributors']} tokens {e['tokens']:>10,} loss {e['loss']:.4f} val {val_s} "
                f"sent {e['bytes_sent'] / 1e6:.1f} MB"
            )
        else:
            line = (
                f"[{e['strategy']}] round {e['round']:>4} tokens {e['tokens']:>10,} loss {e['loss']:.4f} "
                f"val {val_s}"
            )
        print(line, file=out, flush=True)

    return show


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse twice when `compare --preset` is given, so the preset fills only what flags leave."""
    first, _ = build_parser().parse_known_args(argv)
    preset = PRESETS[first.preset] if getattr(first, "preset", None) else None
    return build_parser(preset).parse_args(argv)


def _unwritable(args: argparse.Namespace) -> list[str]:
    """Output paths whose folder is missing or read-only, checked before the (long) runs."""
    errors = []
    for flag in ("json", "plot", "markdown"):
        path = getattr(args, flag, None)
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            errors.append(f"--{flag}: folder {folder} does not exist")
        elif not os.access(folder, os.W_OK):
            errors.append(f"--{flag}: folder {folder} is not writable")
    return errors


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bad_paths = _unwritable(args)
    for msg in bad_paths:
        print(f"error: {msg}", file=sys.stderr)
    if bad_paths:
        return 2
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        for field, msg in exc.errors.items():
            print(f"error: {field}: {msg}", file=sys.stderr)
        return 2
    if args.command == "compare":
        return _compare(args, config)
    return _train(args, config)


def _train(args: argparse.Namespace, config: TrainConfig) -> int:
    from trainer.train import run_local  # noqa: PLC0415 - keep --help fast

    progress_out = sys.stderr if args.json == "-" else sys.stdout
    progress = None if args.quiet else _progress_printer(progress_out)
    try:
        if args.devices_per_learner != 1 or args.inner_parallelism != "ddp":
            report = _train_islands(args, config, progress)
        else:
            report = run_local(config, args.strategy, progress=progress, speeds=args.speeds)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = (
        f"{report['strategy']}: val loss {report['initial_val_loss']:.4f} -> {report['final_val_loss']:.4f} "
        f"nats/token, {report['tokens']:,} tokens, {report['outer_steps']} outer steps, "
        f"{report['bytes_sent'] / 1e6:.1f} MB sent, {report['wall_s']:.1f} s"
    )
    if report.get("step_time_s_mean"):
        flush = "on" if config.flush_denormal else "off"
        summary += (f", inner step by mean {report['step_time_s_mean'] * 1e3:.1f} ms wall, "
                    f"{report['step_cpu_s_mean'] * 1e3:.1f} ms CPU (flush denormal {flush})")
    print(summary, file=progress_out, flush=True)
    _write_json(report, args.json)
    return 0


def _train_islands(args: argparse.Namespace, config: TrainConfig, progress) -> dict:
    """Every learner an island of --devices-per-learner processes (trainer.island)."""
    from trainer.island_run import run_islands  # noqa: PLC0415 - keep --help fast

    if args.devices_per_learner < 1:
        raise ValueError("--devices-per-learner: must be >= 1")
    return run_islands(config, args.strategy, devices=args.devices_per_learner, progress=progress,
                       speeds=args.speeds, parallelism=args.inner_parallelism)


def _compare(args: argparse.Namespace, config: TrainConfig) -> int:
    from trainer import compare  # noqa: PLC0415
    from trainer.learner import load_corpus  # noqa: PLC0415
    from trainer.train import run_local  # noqa: PLC0415

    out = sys.stderr if args.json == "-" else sys.stdout
    try:
        corpus = load_corpus(config)  # once for all runs
        doc = compare.compare(
            config,
            args.strategies,
            args.seeds,
            run=lambda cfg, strategy: run_local(cfg, strategy, corpus=corpus),
            progress=None if args.quiet else (lambda line: print(line, file=out, flush=True)),
            baseline_inner_lr=args.baseline_inner_lr,
            baseline_inner_optimizer=args.baseline_inner_optimizer,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verdict = compare.verdict(doc, args.target_gap)
    if args.baseline_inner_lr is not None:
        verdict = (f"{args.strategies[0]} at its own inner lr {args.baseline_inner_lr:g}, the others at "
                   f"{config.inner_lr:g}\n{verdict}")
    if args.baseline_inner_optimizer is not None:
        verdict = (f"{args.strategies[0]} with {args.baseline_inner_optimizer}, the others with "
                   f"{config.inner_optimizer}\n{verdict}")
    print(compare.table(doc), file=out)
    print(verdict, file=out, flush=True)
    if args.plot:
        compare.plot(doc, args.plot)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(compare.table(doc, markdown=True) + "\n\n" + verdict + "\n")
    _write_json(doc, args.json)
    return 0


def _write_json(doc: dict, path: str | None) -> None:
    if path == "-":
        json.dump(doc, sys.stdout, indent=2)
        print()
    elif path:
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=2)
