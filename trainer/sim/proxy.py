"""Proxy models the simulator trains for real (small enough for thousands of steps on a CPU).

Use them through the engine's factory hook: `TrainConfig(model="trainer.sim.proxy:micro")`.
"""

from __future__ import annotations

from trainer.models import GPT, GPTConfig


def micro(seq_len: int = 32, vocab_size: int = 256) -> GPT:
    """A 2-layer byte-level GPT (~0.12M parameters): the default proxy of the benchmarks."""
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=vocab_size, seq_len=seq_len))
