"""The checkpoint codec packs tensors without cloning them first, safely."""

from __future__ import annotations

import torch

from trainer.runtime import codec


def test_pack_handles_views_of_one_buffer_and_repeated_tensors():
    flat = torch.arange(10, dtype=torch.float32)
    own = torch.randn(3)
    state = {"a": flat[:4].view(2, 2), "b": flat[4:], "again": own, "own": own, "empty": torch.zeros(0)}
    out = codec.unpack(codec.pack(state))
    assert torch.equal(out["a"], flat[:4].view(2, 2)) and torch.equal(out["b"], flat[4:])
    assert torch.equal(out["again"], own) and torch.equal(out["own"], own)
    assert out["empty"].shape == (0,)


def test_packed_bytes_are_a_snapshot():
    t = torch.ones(4)
    blob = codec.pack({"t": t})
    t.add_(1)
    assert torch.equal(codec.unpack(blob)["t"], torch.ones(4))


def test_nested_state_round_trips_and_nothing_else_is_accepted():
    """What the former trainer/checkpoint module promised, now of the one codec: nested dicts with
    int keys, tuples, NaN, None; no arbitrary objects in, no foreign bytes out."""
    import math

    import pytest

    state = {"w": torch.ones(2), 3: (1, "x", None), "lr": float("nan"), "deep": {"k": [torch.zeros(1), True]}}
    out = codec.unpack(codec.pack(state))
    assert torch.equal(out["w"], torch.ones(2)) and out[3] == (1, "x", None) and math.isnan(out["lr"])
    assert torch.equal(out["deep"]["k"][0], torch.zeros(1)) and out["deep"]["k"][1] is True
    with pytest.raises(codec.CodecError):
        codec.pack({"f": object()})
    with pytest.raises(codec.CodecError):
        codec.unpack(b"not a state at all")
    from safetensors.torch import save

    with pytest.raises(codec.CodecError):
        codec.unpack(save({"t": torch.ones(1)}))  # safetensors, but not a packed state
