"""The inner-optimizer options (issue 17): Muon for the hidden matrices, the state handling on
adoption, and the outer-momentum decay. Their defaults are off (adamw, keep, 0)."""
from __future__ import annotations

import pytest
import torch

from trainer.cli import build_parser, config_from_args
from trainer.clock import ManualClock
from trainer.config import ConfigError, TrainConfig
from trainer.learner import Learner
from trainer.models import build_model
from trainer.optimizers import CombinedOptimizer, make_optimizer, muon_params
from trainer.protocol import GlobalFragment
from trainer.runtime import codec
from trainer.spec import JobSpec
from trainer.syncer import Syncer


def test_muon_takes_the_linear_weights_and_adamw_the_rest():
    model = build_model("tiny", 32, 0, vocab_size=64)
    hidden = muon_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    taken = sorted(names[id(p)] for p in hidden)
    assert taken and all(n.endswith(("qkv.weight", "proj.weight", "fc.weight")) for n in taken)
    assert all(p.dim() == 2 for p in hidden)
    assert "wte.weight" not in taken and "wpe.weight" not in taken
    opt = make_optimizer(model, TrainConfig(inner_optimizer="muon"), torch.device("cpu"))
    assert isinstance(opt, CombinedOptimizer)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    owned = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # each exactly once


def test_adamw_is_the_default_and_alone():
    model = build_model("tiny", 32, 0, vocab_size=64)
    assert isinstance(make_optimizer(model, TrainConfig(), torch.device("cpu")), torch.optim.AdamW)


def test_a_muon_learner_trains_and_resumes_bit_for_bit(small_config, stdlib_corpus):
    cfg = small_config(inner_optimizer="muon", inner_steps=2, steps=8)
    a = Learner(cfg, 0, corpus=stdlib_corpus)
    first = a.step().loss
    for _ in range(3):
        a.step()
    assert a.last_loss < first
    state = codec.unpack(codec.pack(a.state_dict()))
    b = Learner(cfg, 0, corpus=stdlib_corpus)
    b.load_state_dict(state)
    for _ in range(2):
        assert a.step().loss == b.step().loss
    for n, p in a.params.items():
        torch.testing.assert_close(p, b.params[n], rtol=0, atol=0)


def test_a_muon_state_does_not_load_into_an_adamw_learner(small_config, stdlib_corpus):
    muon = Learner(small_config(inner_optimizer="muon"), 0, corpus=stdlib_corpus)
    muon.step()
    adamw = Learner(small_config(), 0, corpus=stdlib_corpus)
    with pytest.raises((ValueError, KeyError)):
        adamw.load_state_dict(muon.state_dict())


@pytest.mark.parametrize(("inner_state", "kept"), [("keep", True), ("reset", False)])
def test_inner_state_on_adoption(small_config, stdlib_corpus, inner_state, kept):
    lrn = Learner(small_config(inner_state=inner_state, inner_steps=2, steps=10), 0, corpus=stdlib_corpus)
    lrn.step()
    lrn.step()
    sent = lrn.due_contributions()[0]
    params = [lrn.params[n] for n in lrn.fragments[0]]
    assert all(p in lrn.optimizer.state for p in params)
    g = GlobalFragment("local", 0, 1, {n: t - sent.tensors[n] for n, t in lrn.base[0].items()})
    assert lrn.adopt(g)
    assert all((p in lrn.optimizer.state and len(lrn.optimizer.state[p]) > 0) is kept for p in params)
    lrn.step()  # a reset state starts afresh
    assert all(p in lrn.optimizer.state for p in params)


def test_outer_momentum_decays_to_zero_over_the_last_outer_steps():
    cfg = TrainConfig(learners=1, quorum=1, inner_steps=10, fragments=1, steps=100, outer_momentum=0.8,
                      outer_momentum_warmup=2, outer_momentum_decay=4)
    syncer = Syncer(cfg, {"w": torch.zeros(3)}, ManualClock())
    got = [syncer.momentum_at(k) for k in (0, 1, 2, 5, 6, 7, 8, 9, 10)]
    assert got == pytest.approx([0.0, 0.4, 0.8, 0.8, 0.8, 0.6, 0.4, 0.2, 0.0])
    assert Syncer(cfg.replace(outer_momentum_decay=0), {"w": torch.zeros(3)},
                  ManualClock()).momentum_at(9) == pytest.approx(0.8)


def test_the_options_reach_the_engine_from_the_spec_and_the_cli():
    spec = JobSpec(inner_optimizer="muon", muon_momentum=0.9, inner_state="reset", outer_momentum_decay=5)
    cfg = TrainConfig.from_spec(spec)
    assert (cfg.inner_optimizer, cfg.muon_momentum, cfg.inner_state, cfg.outer_momentum_decay) == (
        "muon", 0.9, "reset", 5)
    args = build_parser().parse_args(["train", "--inner-optimizer", "muon", "--muon-momentum", "0.9",
                                      "--inner-state", "reset", "--outer-momentum-decay", "5"])
    cli = config_from_args(args)
    assert (cli.inner_optimizer, cli.muon_momentum, cli.inner_state, cli.outer_momentum_decay) == (
        "muon", 0.9, "reset", 5)


@pytest.mark.parametrize("bad", [{"inner_optimizer": "sgd"}, {"inner_state": "drop"},
                                 {"muon_momentum": 1.0}, {"outer_momentum_decay": -1}])
def test_bad_options_are_refused(bad):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**bad)
    assert set(err.value.errors) == set(bad)
