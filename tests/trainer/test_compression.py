"""Wire compression: none is bit-exact, the lossy methods stay inside their documented bounds."""

from __future__ import annotations

import struct

import pytest
import torch

from trainer.compression import (
    METHODS,
    InvalidPayload,
    compression_error,
    decode,
    encode,
    error_bound,
    payload_bytes,
)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.fc.weight": torch.randn(64, 33, generator=g) * 1e-3,
        "ln.bias": torch.randn(7, generator=g),
        "scalar": torch.tensor(0.5),
        "zeros": torch.zeros(40),
    }


def test_none_is_bit_exact():
    t = _tensors()
    t["tiny"] = torch.tensor([1e-38, -0.0, 3.4e38, 1.401298464324817e-45])
    back = decode(encode(t, "none"))
    assert set(back) == set(t)
    for n in t:
        assert back[n].dtype == t[n].dtype
        assert (
            torch.equal(back[n].view(torch.int32), t[n].view(torch.int32))
            if t[n].dim()
            else torch.equal(back[n], t[n])
        )


@pytest.mark.parametrize("method", ["bf16", "int8", "int4"])
def test_lossy_roundtrip_within_documented_bound(method):
    t = _tensors()
    err = compression_error(t, method)
    assert 0 < err <= error_bound(method)
    back = decode(encode(t, method))
    for n in t:
        assert back[n].shape == t[n].shape and back[n].dtype == torch.float32
        e = (back[n] - t[n]).norm() / max(t[n].norm(), 1e-30)
        assert e <= error_bound(method) + 1e-6
    assert torch.equal(back["zeros"], torch.zeros(40))


def test_int4_typical_error_on_gaussian_pseudo_gradients():
    """Documented: about 0.09 relative L2 error for Gaussian-like values (bound 0.40)."""
    g = torch.Generator().manual_seed(3)
    t = {"w": torch.randn(256, 256, generator=g) * 0.01}
    assert 0.07 < compression_error(t, "int4") < 0.12
    assert compression_error(t, "int8") < 0.01


def test_worst_case_int4_block_is_bounded():
    # one large value per block drowns the others: the worst case of blockwise absmax scaling
    x = torch.full((32 * 8,), 0.0714)
    x[::32] = 1.0
    assert compression_error({"w": x}, "int4") <= error_bound("int4")


def test_payload_sizes_shrink():
    t = {"w": torch.randn(4096)}
    sizes = {m: len(encode(t, m)) for m in METHODS}
    assert sizes["none"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]
    for m in METHODS:
        assert payload_bytes(4096, m) <= sizes[m] < payload_bytes(4096, m) + 1024
    assert sizes["none"] / sizes["int4"] > 5.5


@pytest.mark.parametrize("method", METHODS)
def test_nan_payload_is_rejected(method):
    t = {"w": torch.randn(100)}
    t["w"][17] = float("nan")
    with pytest.raises(InvalidPayload, match="NaN|non-finite"):
        decode(encode(t, method))


def test_inf_is_rejected():
    with pytest.raises(InvalidPayload):
        decode(encode({"w": torch.tensor([1.0, float("inf")])}, "none"))


@pytest.mark.parametrize("method", METHODS)
def test_flipped_byte_is_caught(method):
    blob = bytearray(encode({"w": torch.randn(300)}, method))
    blob[-5] ^= 0x40
    with pytest.raises(InvalidPayload, match="checksum"):
        decode(bytes(blob))


def test_malformed_blobs_are_rejected():
    good = encode({"w": torch.randn(10)}, "none")
    with pytest.raises(InvalidPayload, match="too short"):
        decode(b"abc")
    with pytest.raises(InvalidPayload, match="header length"):
        decode(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(InvalidPayload, match="not JSON"):
        decode(struct.pack("<Q", 4) + b"\xff\xfe{}" + b"\x00" * 8)
    with pytest.raises(InvalidPayload):
        decode(good[:-8])  # truncated data
    with pytest.raises(InvalidPayload, match="exceeds"):
        decode(good, max_bytes=len(good) - 1)
    import pickle

    with pytest.raises(InvalidPayload):
        decode(pickle.dumps({"w": torch.randn(3)}))  # noqa: S301 - a pickle must be refused, not loaded
    from safetensors.torch import save

    with pytest.raises(InvalidPayload, match="not a diloco"):
        decode(save({"w": torch.randn(3)}))


def test_unknown_method_refused():
    with pytest.raises(ValueError, match="unknown compression"):
        encode({"w": torch.randn(3)}, "int2")
