"""`python -m trainer compare`: strategies side by side at equal tokens, over several seeds.

A quality claim such as "decoupled ends within 2% of ddp" moves by a point or two from seed to
seed at this scale, so one pair of runs settles nothing. This runs every strategy with the same
settings for each seed, scores each against the first strategy (the baseline) at the same seed,
and prints the figures (table, JSON, a PNG of the validation curves); it asserts nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from trainer.config import TrainConfig

# The settings of issue 3's quality line (tiny, stdlib, M=4, H=20, 400 inner steps per learner),
# as the slow acceptance test runs them: ddp's best inner lr for both strategies, and for
# decoupled the proximal pull, RDA and outer Nesterov 0.7 / 0.7 (docs/engine.md, fifth sweep).
PRESETS: dict[str, dict[str, Any]] = {
    "acceptance": {
        "model": "tiny",
        "learners": 4,
        "inner_steps": 20,
        "fragments": 1,
        "quorum": 2,
        "steps": 400,
        "batch_size": 4,
        "seq_len": 32,
        "eval_every": 5,
        "inner_lr": 2e-3,
        "inner_prox": 50.0,
        "outer_lr": 0.7,
        "outer_momentum": 0.7,
        "outer_momentum_decay": 0,
        "final_average": False,
        "rda": True,
    },
}

Run = Callable[[TrainConfig, str], dict]
KEEP = ("strategy", "seed", "initial_val_loss", "final_val_loss", "tokens", "outer_steps",
        "bytes_sent", "wall_s", "val_curve")


def compare(
    config: TrainConfig,
    strategies: list[str],
    seeds: list[int],
    run: Run,
    progress: Callable[[str], None] | None = None,
    baseline_inner_lr: float | None = None,
    baseline_inner_optimizer: str | None = None,
) -> dict:
    """Run each strategy for each seed (`run(config, strategy)`) and score it against the first.

    `baseline_inner_lr` runs the baseline at its own inner lr: ddp and decoupled learners want
    different step sizes (decoupled's each see 1/M of the batch), and a gap won by running the
    baseline at the other's lr would measure the mistuning, not the method.
    `baseline_inner_optimizer` likewise runs it with its own inner optimizer (say ddp with AdamW
    against decoupled with Muon: the gap then includes the optimizer's share).
    """
    if len(strategies) < 2:
        raise ValueError("compare needs at least two strategies (the first is the baseline)")
    if not seeds:
        raise ValueError("compare needs at least one seed")
    own: dict[str, Any] = {}
    if baseline_inner_lr is not None:
        own["inner_lr"] = baseline_inner_lr
    if baseline_inner_optimizer is not None:
        own["inner_optimizer"] = baseline_inner_optimizer
    runs = []
    for seed in seeds:
        cfg = replace(config, seed=seed)
        for strategy in strategies:
            report = run(replace(cfg, **own) if strategy == strategies[0] else cfg, strategy)
            row = {k: report[k] for k in KEEP if k in report}
            row["seed"] = seed
            runs.append(row)
            if progress:
                progress(
                    f"seed {seed} {strategy}: val loss {row['final_val_loss']:.4f}, "
                    f"{row['tokens']:,} tokens, {row['wall_s']:.0f} s"
                )
    doc = summarise(runs, strategies, seeds, config)
    doc["baseline_inner_lr"] = baseline_inner_lr if baseline_inner_lr is not None else config.inner_lr
    doc["baseline_inner_optimizer"] = baseline_inner_optimizer or config.inner_optimizer
    return doc


def summarise(runs: list[dict], strategies: list[str], seeds: list[int], config: TrainConfig) -> dict:
    """Per seed and strategy: the gap to the baseline, (loss / baseline loss) - 1."""
    by = {(r["seed"], r["strategy"]): r for r in runs}
    base = strategies[0]
    rows = []
    for seed in seeds:
        ref = by[(seed, base)]
        for strategy in strategies:
            r = by[(seed, strategy)]
            rows.append({
                "seed": seed,
                "strategy": strategy,
                "final_val_loss": r["final_val_loss"],
                "gap": r["final_val_loss"] / ref["final_val_loss"] - 1.0,
                "equal_tokens": r["tokens"] == ref["tokens"],
            })
    summary = {}
    for strategy in strategies:
        losses = [by[(s, strategy)]["final_val_loss"] for s in seeds]
        gaps = [row["gap"] for row in rows if row["strategy"] == strategy]
        summary[strategy] = {
            "mean_val_loss": statistics.fmean(losses),
            "mean_gap": statistics.fmean(gaps),
            "max_gap": max(gaps),
            "min_gap": min(gaps),
        }
    return {
        "baseline": base,
        "strategies": strategies,
        "seeds": seeds,
        "config": config.to_dict(),
        "rows": rows,
        "summary": summary,
        "runs": runs,
    }


def table(doc: dict, markdown: bool = False) -> str:
    """One line per seed, a column per strategy (loss, and gap for all but the baseline)."""
    strategies, base = doc["strategies"], doc["baseline"]
    head = ["seed"]
    for s in strategies:
        head += [s] if s == base else [s, f"{s} gap"]
    by = {(r["seed"], r["strategy"]): r for r in doc["rows"]}
    lines = []
    for seed in doc["seeds"]:
        cells = [str(seed)]
        for s in strategies:
            r = by[(seed, s)]
            flag = "" if r["equal_tokens"] else " (tokens differ)"
            cells.append(f"{r['final_val_loss']:.4f}{flag}")
            if s != base:
                cells.append(f"{r['gap']:+.1%}")
        lines.append(cells)
    mean = ["mean"]
    for s in strategies:
        m = doc["summary"][s]
        mean.append(f"{m['mean_val_loss']:.4f}")
        if s != base:
            mean.append(f"{m['mean_gap']:+.1%} (max {m['max_gap']:+.1%})")
    lines.append(mean)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c) + " |" for c in lines]
        return "\n".join(out)
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*row) for row in [head, *lines])


def verdict(doc: dict, target: float) -> str:
    """Whether every strategy stays within `target` of the baseline on every seed."""
    parts = []
    for s in doc["strategies"][1:]:
        worst = doc["summary"][s]["max_gap"]
        ok = "yes" if worst <= target else "no"
        parts.append(f"{s} within {target:.1%} of {doc['baseline']} on every seed: {ok} (worst {worst:+.1%})")
    return "\n".join(parts)


def plot(doc: dict, path: str) -> None:
    """Validation loss against tokens, one line per run, a colour per strategy."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (full, tail) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {s: f"C{i}" for i, s in enumerate(doc["strategies"])}
    for r in doc["runs"]:
        xs = [p[0] for p in r["val_curve"]]
        ys = [p[1] for p in r["val_curve"]]
        label = r["strategy"] if r["seed"] == doc["seeds"][0] else None
        for ax in (full, tail):
            ax.plot(xs, ys, color=colours[r["strategy"]], alpha=0.8, label=label, lw=1.2)
    finals = [r["final_val_loss"] for r in doc["runs"]]
    last = max(r["val_curve"][-1][0] for r in doc["runs"])
    tail.set_xlim(last * 0.5, last * 1.02)
    tail.set_ylim(min(finals) * 0.98, max(finals) * 1.12)
    full.set_title("validation loss")
    tail.set_title("last half (seeds " + ", ".join(str(s) for s in doc["seeds"]) + ")")
    for ax in (full, tail):
        ax.set_xlabel("tokens")
        ax.set_ylabel("nats per token")
        ax.grid(alpha=0.3)
    full.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
