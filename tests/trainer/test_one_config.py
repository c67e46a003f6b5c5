"""One configuration: the spec, the engine config and the CLI share their defaults and rules.

The quorum default, the inner-lr and inner-prox defaults and the token budget are functions of
trainer.config; the engine config of a spec comes from TrainConfig.from_spec alone.
"""
from __future__ import annotations

import dataclasses

import pytest

from trainer.cli import build_parser, config_from_args
from trainer.config import (
    TrainConfig,
    default_fragments,
    default_inner_lr,
    default_outer_momentum_decay,
    default_quorum,
    token_budget,
)
from trainer.spec import JobSpec, stored_spec

# Spec fields the engine config does not carry (the platform reads them from the spec): placement,
# elasticity, syncer sharding, checkpoint cadence; `eval_interval` becomes `eval_every`, `strategy`
# the quorum of synchronous DiLoCo; a learner island's shape is read by its runner.
PLATFORM_FIELDS = {"name", "strategy", "objective", "pools", "min_learners", "max_learners", "syncer_shards",
                   "checkpoint_interval", "eval_interval", "devices_per_learner", "nodes_per_learner",
                   "inner_parallelism"}


def test_every_spec_field_reaches_the_engine_or_is_a_platform_field():
    engine = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(JobSpec.model_fields) - engine <= PLATFORM_FIELDS
    spec = JobSpec(learners=6, inner_steps=30, fragments=3, outer_lr=0.5, max_tokens=12345, eval_interval=3)
    cfg = TrainConfig.from_spec(spec)
    for name in set(JobSpec.model_fields) & engine:
        assert getattr(cfg, name) == getattr(spec, name), name
    assert cfg.eval_every == 3


@pytest.mark.parametrize("learners", [1, 2, 5, 9])
def test_the_quorum_default_is_the_same_everywhere(learners):
    spec = JobSpec(learners=learners)
    cli = config_from_args(build_parser().parse_args(["train", "--learners", str(learners)]))
    assert spec.quorum == TrainConfig.from_spec(spec).quorum == cli.quorum == default_quorum(learners)


@pytest.mark.parametrize("inner_steps", [1, 2, 3, 4, 20, 96])
def test_the_fragments_default_is_four_at_most_h_everywhere(inner_steps):
    spec = JobSpec(inner_steps=inner_steps)
    cli = config_from_args(build_parser().parse_args(["train", "-H", str(inner_steps)]))
    engine = TrainConfig(inner_steps=inner_steps)
    expected = min(4, inner_steps)
    assert default_fragments(inner_steps) == expected
    got = (spec.fragments, TrainConfig.from_spec(spec).fragments, cli.fragments, engine.fragments)
    assert got == (expected,) * 4
    assert spec.fragment_mode == cli.fragment_mode == engine.fragment_mode == "balanced"


@pytest.mark.parametrize(
    ("model", "batch", "seq", "expected"),
    [("tiny", 16, 64, 5e-3), ("small", 16, 64, 7e-4), ("small", 64, 256, 2e-3), ("base", 16, 64, 5e-4)],
)
def test_the_inner_lr_default_follows_model_and_batch_everywhere(model, batch, seq, expected):
    spec = JobSpec(model=model, batch_size=batch, seq_len=seq)
    argv = ["train", "--model", model, "--batch-size", str(batch), "--seq-len", str(seq)]
    cli = config_from_args(build_parser().parse_args(argv))
    engine = TrainConfig(model=model, batch_size=batch, seq_len=seq)
    assert default_inner_lr(model, batch * seq) == expected
    got = (spec.inner_lr, TrainConfig.from_spec(spec).inner_lr, cli.inner_lr, engine.inner_lr)
    assert got == (expected,) * 4
    assert JobSpec(model=model, batch_size=batch, seq_len=seq, inner_lr=3e-3).inner_lr == 3e-3


@pytest.mark.parametrize(("model", "lr"), [("tiny", None), ("small", None), ("small", 1e-3), ("tiny", 2e-5)])
def test_the_inner_prox_default_pulls_the_same_share_per_step_at_any_inner_lr(model, lr):
    """Unnamed, inner_prox is 0.125 / inner_lr (a step pulls 1/8 of the way back to the global),
    in the spec, the engine config and the CLI alike; a named one is kept."""
    extra = {} if lr is None else {"inner_lr": lr}
    spec = JobSpec(model=model, **extra)
    argv = ["train", "--model", model] + ([] if lr is None else ["--inner-lr", str(lr)])
    cli = config_from_args(build_parser().parse_args(argv))
    engine = TrainConfig(model=model, **extra)
    inner_lr = spec.inner_lr
    expected = min(0.125 / inner_lr, 10_000.0)
    got = (spec.inner_prox, TrainConfig.from_spec(spec).inner_prox, cli.inner_prox, engine.inner_prox)
    assert got == (pytest.approx(expected),) * 4
    assert inner_lr * spec.inner_prox <= 0.125 + 1e-12
    if (model, lr) == ("tiny", None):
        assert spec.inner_prox == 25.0  # tiny's measured default, unchanged
    assert JobSpec(model=model, inner_prox=0, **extra).inner_prox == 0
    assert TrainConfig(model=model, inner_prox=10.0, **extra).inner_prox == 10.0


def test_large_batches_get_the_lighter_pull_their_gpu_runs_were_measured_with():
    """Above 8,192 tokens per learner step the default pull is 0.05 per step: small at 64 x 256
    gets inner lr 2e-3 and prox 25, the settings of the GPU runs in docs/engine.md."""
    spec = JobSpec(model="small", batch_size=64, seq_len=256)
    argv = ["train", "--model", "small", "--batch-size", "64", "--seq-len", "256"]
    cli = config_from_args(build_parser().parse_args(argv))
    engine = TrainConfig(model="small", batch_size=64, seq_len=256)
    for got in (spec, TrainConfig.from_spec(spec), cli, engine):
        assert got.inner_lr == 2e-3 and got.inner_prox == pytest.approx(25.0)
    assert JobSpec(model="small", batch_size=64, seq_len=256, inner_lr=1e-3).inner_prox == pytest.approx(50.0)


@pytest.mark.parametrize(("steps", "inner_steps", "expected"),
                         [(400, 20, 3), (600, 20, 5), (120, 20, 1), (100, 20, 0), (100_000, 1, 16_666)])
def test_the_outer_momentum_decays_over_the_last_sixth_of_the_outer_steps_everywhere(
        steps, inner_steps, expected):
    """Unnamed, the outer momentum falls to 0 over a sixth of the run's outer steps (rounded down):
    tiny's 20 outer steps get 3, small's 30 get 5 (docs/engine.md, "Defaults"); a named one is kept."""
    spec = JobSpec(steps=steps, inner_steps=inner_steps, fragments=1)
    argv = ["train", "--steps", str(steps), "-H", str(inner_steps), "-P", "1"]
    cli = config_from_args(build_parser().parse_args(argv))
    engine = TrainConfig(steps=steps, inner_steps=inner_steps, fragments=1)
    assert default_outer_momentum_decay(steps, inner_steps) == expected
    got = (spec.outer_momentum_decay, TrainConfig.from_spec(spec).outer_momentum_decay,
           cli.outer_momentum_decay, engine.outer_momentum_decay)
    assert got == (expected,) * 4
    shape = {"steps": steps, "inner_steps": inner_steps, "fragments": 1}
    assert JobSpec(**shape, outer_momentum_decay=0).outer_momentum_decay == 0
    assert TrainConfig(**shape, outer_momentum_decay=3).outer_momentum_decay == 3


def test_a_named_fragment_count_is_kept_and_checked():
    assert JobSpec(inner_steps=20, fragments=1).fragments == 1
    with pytest.raises(ValueError, match="fragments"):
        JobSpec(inner_steps=2, fragments=3)
    with pytest.raises(ValueError, match="fragment_mode"):
        JobSpec(fragment_mode="by-layer")


def test_synchronous_diloco_merges_with_every_learner():
    assert TrainConfig.from_spec(JobSpec(strategy="diloco", learners=3, quorum=1)).quorum == 3
    assert TrainConfig.from_spec(JobSpec(strategy="decoupled", learners=3, quorum=1)).quorum == 1


@pytest.mark.parametrize("max_tokens", [None, 1000, 10**9])
def test_one_token_budget(max_tokens):
    spec = JobSpec(learners=3, steps=50, batch_size=4, seq_len=16, max_tokens=max_tokens)
    expected = min(3 * 50 * 4 * 16, max_tokens or 10**18)
    assert spec.total_tokens == TrainConfig.from_spec(spec).total_tokens == expected
    assert token_budget(3, 50, 4, 16, max_tokens) == expected
    assert stored_spec(spec.model_dump(mode="json")).total_tokens == expected


def test_a_stored_spec_that_no_longer_validates_reads_as_none():
    assert stored_spec({"learners": 0}) is None and stored_spec("not a spec") is None
    assert stored_spec({}) == JobSpec()


def test_a_default_spec_runs_the_engine_defaults():
    """The spec's defaults are the engine's, but for two on purpose: the quorum (M // 2 for a job,
    1 for a bare engine config) and the evaluation cadence (every 5 outer steps on the platform,
    where the syncer pays for it; every round in the CLI and the simulator)."""
    spec, engine = TrainConfig.from_spec(JobSpec()), TrainConfig()
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    differ = {n for n in names if getattr(spec, n) != getattr(engine, n)}
    assert differ == {"quorum", "eval_every"} and spec.quorum == default_quorum(engine.learners)


def test_final_average_is_one_option_in_the_spec_the_cli_and_the_engine():
    parse = build_parser().parse_args
    assert config_from_args(parse(["train", "--final-average"])).final_average is True
    assert config_from_args(parse(["train", "--no-final-average"])).final_average is False
    default = TrainConfig().final_average
    assert config_from_args(parse(["train"])).final_average == JobSpec().final_average == default
    assert TrainConfig.from_spec(JobSpec(final_average=not default)).final_average is (not default)
