from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from trainer.models import (
    autocast,
    build_model,
    model_flops_per_token,
    model_memory_gib,
    param_count,
    pick_device,
    preset_param_count,
)


def test_preset_sizes():
    assert 0.7e6 < param_count(build_model("tiny", seq_len=64)) < 1.3e6
    small = build_model("small", seq_len=64)
    assert 8e6 < param_count(small) < 13e6
    assert param_count(small) == preset_param_count("small", 64)
    assert 85e6 < preset_param_count("base", 64) < 115e6
    assert model_memory_gib("base") > model_memory_gib("small") > model_memory_gib("tiny") > 0
    assert model_flops_per_token("tiny") == 6 * preset_param_count("tiny", 64)


def test_forward_loss_and_determinism():
    a, b = build_model("tiny", seq_len=16, seed=3), build_model("tiny", seq_len=16, seed=3)
    c = build_model("tiny", seq_len=16, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.wte.weight, c.wte.weight)
    x = torch.randint(0, 256, (2, 16))
    assert a(x).shape == (2, 16, 256)
    loss = a.loss(x, torch.randint(0, 256, (2, 16)))
    assert abs(float(loss.detach()) - torch.log(torch.tensor(256.0)).item()) < 0.3  # ~ln 256 at init
    with pytest.raises(ValueError, match="exceeds"):
        a(torch.randint(0, 256, (1, 17)))


def test_build_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    build_model("tiny", seq_len=8, seed=99)
    assert torch.equal(torch.rand(1), expected)


def test_factory_hook_module_and_pair():
    mod = types.ModuleType("diloco_test_factories")

    class Bigram(nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, vocab_size)

        def forward(self, x):
            return self.emb(x)

        def loss(self, x, y):
            return nn.functional.cross_entropy(self(x).view(-1, 256), y.view(-1))

    def with_loss(vocab_size=256):
        return Bigram(vocab_size)

    def pair(seq_len):
        m = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
        return m, lambda logits, y: nn.functional.cross_entropy(logits.view(-1, 256), y.view(-1))

    mod.with_loss, mod.pair, mod.broken = with_loss, pair, lambda: 42
    sys.modules[mod.__name__] = mod
    try:
        m = build_model("diloco_test_factories:with_loss", seq_len=8)
        x = torch.randint(0, 256, (2, 8))
        assert m.loss(x, x).ndim == 0
        p = build_model("diloco_test_factories:pair", seq_len=8)
        assert p.loss(x, x).ndim == 0 and param_count(p) > 0
        with pytest.raises(ValueError, match="must return"):
            build_model("diloco_test_factories:broken")
        with pytest.raises(ValueError, match="no callable"):
            build_model("diloco_test_factories:missing")
        with pytest.raises(ValueError, match="cannot import"):
            build_model("no_such_pkg_xyz.mod:f")
        with pytest.raises(ValueError, match="unknown model"):
            build_model("huge")
    finally:
        del sys.modules[mod.__name__]


def test_pick_device():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type in ("cuda", "xpu", "mps", "xla", "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("tpu9000")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            pick_device("cuda")


def test_bf16_autocast_on_cpu():
    m = build_model("tiny", seq_len=8)
    x = torch.randint(0, 256, (2, 8))
    with autocast(torch.device("cpu"), True):
        loss = m.loss(x, x)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert m.wte.weight.grad is not None
