"""`python -m trainer compare`: strategies side by side at equal tokens over seeds."""

import json
import subprocess
import sys

import pytest

from trainer.cli import config_from_args, parse_args
from trainer.compare import PRESETS, compare, summarise, table, verdict
from trainer.config import TrainConfig


def _run(strategy, seed, loss, tokens=1000):
    return {"strategy": strategy, "seed": seed, "final_val_loss": loss, "tokens": tokens,
            "val_curve": [[0, 5.0], [tokens, loss]]}


def test_each_seed_is_scored_against_its_own_baseline():
    runs = [
        _run("ddp", 0, 2.0), _run("decoupled", 0, 2.06),
        _run("ddp", 1, 2.2), _run("decoupled", 1, 2.2, tokens=900),
    ]
    doc = summarise(runs, ["ddp", "decoupled"], [0, 1], TrainConfig())
    gaps = {(r["seed"], r["strategy"]): r["gap"] for r in doc["rows"]}
    assert gaps[(0, "ddp")] == 0.0 and gaps[(1, "ddp")] == 0.0
    assert gaps[(0, "decoupled")] == pytest.approx(0.03)
    assert gaps[(1, "decoupled")] == pytest.approx(0.0)
    s = doc["summary"]["decoupled"]
    assert s["mean_gap"] == pytest.approx(0.015) and s["max_gap"] == pytest.approx(0.03)
    assert s["mean_val_loss"] == pytest.approx(2.13)
    text = table(doc)
    assert "+3.0%" in text and "(tokens differ)" in text and "max +3.0%" in text
    assert verdict(doc, 0.02).endswith("no (worst +3.0%)")
    assert verdict(doc, 0.05).endswith("yes (worst +3.0%)")
    md = table(doc, markdown=True).splitlines()
    assert md[0] == "| seed | ddp | decoupled | decoupled gap |" and len(md) == 5


def test_preset_fills_what_the_flags_leave():
    args = parse_args(["compare", "--preset", "acceptance", "--inner-lr", "1e-3", "--seeds", "3,4"])
    cfg = config_from_args(args)
    assert cfg.inner_lr == 1e-3  # the flag wins
    assert cfg.inner_prox == PRESETS["acceptance"]["inner_prox"] and cfg.rda
    assert (cfg.learners, cfg.inner_steps, cfg.steps, cfg.quorum) == (4, 20, 400, 2)
    assert args.seeds == [3, 4] and args.strategies == ["ddp", "decoupled"]
    plain = config_from_args(parse_args(["compare"]))
    assert plain.inner_prox == TrainConfig().inner_prox and plain.rda == TrainConfig().rda


def test_acceptance_preset_is_the_issue_run():
    cfg = TrainConfig(**PRESETS["acceptance"])
    issue = ("tiny", "stdlib", 4, 20, 400)
    assert (cfg.model, cfg.dataset, cfg.learners, cfg.inner_steps, cfg.steps) == issue


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "trainer", "compare", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "ddp,sgd"], "unknown strategy 'sgd'"),
        (["--strategies", "ddp"], "at least two strategies"),
        (["--seeds", "0,x"], "comma-separated integers"),
        (["--seeds", ","], "at least one seed"),
        (["--learners", "0"], "learners"),
        (["--plot", "/nonexistent/c.png"], "--plot: folder /nonexistent does not exist"),
        (["--json", "/nonexistent/c.json"], "--json: folder /nonexistent does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(args, message, cache_dir):
    proc = _cli(*args, "--steps", "2", "--cache-dir", str(cache_dir))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_cli_compare_runs_every_strategy_per_seed_and_writes_its_reports(tmp_path, cache_dir):
    out, png, md = tmp_path / "c.json", tmp_path / "c.png", tmp_path / "c.md"
    proc = _cli(
        "--strategies", "ddp,decoupled", "--seeds", "0,1",
        "--learners", "2", "--inner-steps", "2", "--quorum", "1", "--steps", "4",
        "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--cache-dir", str(cache_dir),
        "--json", str(out), "--plot", str(png), "--markdown", str(md),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [(r["seed"], r["strategy"]) for r in doc["runs"]] == [
        (0, "ddp"), (0, "decoupled"), (1, "ddp"), (1, "decoupled")
    ]
    by = {(r["seed"], r["strategy"]): r for r in doc["runs"]}
    assert by[(0, "ddp")]["final_val_loss"] != by[(1, "ddp")]["final_val_loss"]  # seeds differ
    for row in doc["rows"]:
        run, base = by[(row["seed"], row["strategy"])], by[(row["seed"], "ddp")]
        assert row["gap"] == pytest.approx(run["final_val_loss"] / base["final_val_loss"] - 1)
        assert row["equal_tokens"] and run["tokens"] == 2 * 4 * 2 * 16
    assert "seed 1 decoupled: val loss" in proc.stdout
    assert "decoupled within 2.0% of ddp on every seed:" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.read_text().startswith("| seed | ddp | decoupled | decoupled gap |")


def test_baseline_can_run_at_its_own_inner_lr():
    seen = []

    def fake(cfg, strategy):
        seen.append((strategy, cfg.seed, cfg.inner_lr))
        return _run(strategy, cfg.seed, 2.0)

    doc = compare(TrainConfig(inner_lr=5e-3), ["ddp", "decoupled"], [0, 1], fake, baseline_inner_lr=3e-3)
    assert seen == [("ddp", 0, 3e-3), ("decoupled", 0, 5e-3), ("ddp", 1, 3e-3), ("decoupled", 1, 5e-3)]
    assert doc["baseline_inner_lr"] == 3e-3
    assert compare(TrainConfig(inner_lr=5e-3), ["ddp", "decoupled"], [0], fake)["baseline_inner_lr"] == 5e-3


def test_baseline_can_run_with_its_own_inner_optimizer():
    seen = []

    def fake(cfg, strategy):
        seen.append((strategy, cfg.inner_optimizer, cfg.inner_lr))
        return _run(strategy, cfg.seed, 2.0)

    doc = compare(TrainConfig(inner_lr=5e-3, inner_optimizer="muon"), ["ddp", "decoupled"], [0], fake,
                  baseline_inner_lr=4e-3, baseline_inner_optimizer="adamw")
    assert seen == [("ddp", "adamw", 4e-3), ("decoupled", "muon", 5e-3)]
    assert doc["baseline_inner_optimizer"] == "adamw"
