"""Models for the GPU check that are bigger than the presets (named as `bench.gpu_models:mid`)."""
from __future__ import annotations

from trainer.models import GPT, GPTConfig


def mid(seq_len: int = 256, vocab_size: int = 256) -> GPT:
    """12 layers x 512, about 38M parameters: the 35M point of the published DiLoCo scaling table."""
    return GPT(GPTConfig(n_layer=12, n_head=8, n_embd=512, vocab_size=vocab_size, seq_len=seq_len))
