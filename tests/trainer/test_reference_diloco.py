"""`diloco` with every extra off is DiLoCo, bit for bit.

The reference below is DiLoCo as torchft's `local_sgd.DiLoCo` writes it: M replicas of the
model, each with its own inner optimizer and data, H inner steps, then the pseudo-gradient
`global - local` averaged over the replicas is the gradient of a stock
`torch.optim.SGD(nesterov=True)` step on the global weights, which every replica then copies.
It shares the engine's model, data stream, inner optimizer and lr schedule (the inner loop is
not what is compared), and nothing of the exchange: no Learner, Syncer, fragments or wire.
"""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.data import TokenStream
from trainer.learner import inner_lr
from trainer.models import build_model
from trainer.optimizers import make_optimizer
from trainer.train import LocalRun

CPU = torch.device("cpu")


def reference_diloco(cfg, corpus, outer_steps: int):
    """(global model, replicas) after `outer_steps` outer steps of plain DiLoCo."""
    M, H = cfg.learners, cfg.inner_steps
    global_model = build_model(cfg.model, cfg.seq_len, cfg.seed, vocab_size=corpus.vocab_size)
    replicas = [copy.deepcopy(global_model).train() for _ in range(M)]
    inner = [make_optimizer(r, cfg, CPU) for r in replicas]
    streams = [TokenStream(corpus, m, M, cfg.batch_size, cfg.seq_len, cfg.seed) for m in range(M)]
    outer = torch.optim.SGD(global_model.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=cfg.outer_momentum > 0)
    step = 0
    for _ in range(outer_steps):
        for _ in range(H):
            for replica, opt, stream in zip(replicas, inner, streams, strict=True):
                for group in opt.param_groups:
                    group["lr"] = inner_lr(cfg, step)
                x, y = stream.next_batch()
                replica.loss(x, y).backward()
                torch.nn.utils.clip_grad_norm_(replica.parameters(), cfg.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            step += 1
        with torch.no_grad():
            for name, g in global_model.named_parameters():
                locals_ = [dict(r.named_parameters())[name] for r in replicas]
                g.grad = torch.stack([g - local for local in locals_]).sum(0) / M
        outer.step()
        outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for replica in replicas:
                for local, g in zip(replica.parameters(), global_model.parameters(), strict=True):
                    local.copy_(g)
    return global_model, replicas


@pytest.mark.parametrize(("outer_lr", "outer_momentum"), [(0.7, 0.9), (1.0, 0.0)])
def test_diloco_with_the_extras_off_is_reference_diloco_bit_for_bit(small_config, stdlib_corpus,
                                                                     outer_lr, outer_momentum):
    outer_steps = 4
    cfg = small_config(
        learners=2, quorum=2, inner_steps=5, fragments=1, steps=40, warmup_steps=3,
        outer_lr=outer_lr, outer_momentum=outer_momentum, outer_momentum_warmup=0,
        outer_momentum_decay=0, rda=False, inner_prox=0.0, final_average=False,
    )
    run = LocalRun(cfg, "diloco", corpus=stdlib_corpus)
    run.run(until_steps=outer_steps * cfg.inner_steps)
    assert run.merges == outer_steps
    for learner in run.learners:
        run._deliver(learner)  # what every learner does before its next inner step
    want_global, want_replicas = reference_diloco(cfg, stdlib_corpus, outer_steps)

    for name, want in want_global.named_parameters():
        assert torch.equal(run.syncer.params[name], want), name
    for learner, replica in zip(run.learners, want_replicas, strict=True):
        assert learner.adopted_versions == {0: outer_steps}
        for name, want in replica.named_parameters():
            assert torch.equal(learner.params[name], want), (learner.index, name)


def test_a_lock_step_learner_adopts_the_global_bits(small_config, stdlib_corpus):
    """With nothing done between send and adoption, the learner holds exactly what the syncer
    published (the mixing arithmetic equals it only up to fp32 rounding)."""
    cfg = small_config(learners=2, quorum=2, inner_steps=3, fragments=1, steps=12, mix_alpha=0.5)
    run = LocalRun(cfg, "diloco", corpus=stdlib_corpus)
    run.run(until_steps=6)
    for learner in run.learners:
        run._deliver(learner)
        for name, param in learner.params.items():
            assert torch.equal(param, run.syncer.published[name]), name
