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


def test_checksum_is_xxh3_and_payloads_with_the_older_blake2b_checksum_still_decode():
    import json

    from safetensors.torch import load, save

    from trainer.compression import _digest, checksum_matches, tensor_checksum

    t = {"w": torch.randn(50), "v": torch.randn(3, 4)}
    blob = encode(t, "none")
    assert tensor_checksum(t).startswith("xxh3:")
    header = json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])
    md = header["__metadata__"]
    assert md["wire_checksum"].startswith("xxh3:")
    entries = load(blob)
    import hashlib

    md["wire_checksum"] = _digest(entries, hashlib.blake2b(digest_size=16))  # how it was written before
    old = save(entries, metadata=md)
    back = decode(old)
    assert all(torch.equal(back[n], t[n]) for n in t)
    assert checksum_matches(entries, md["wire_checksum"]) and not checksum_matches(entries, "0" * 32)
    md["wire_checksum"] = "0" * 32
    with pytest.raises(InvalidPayload, match="checksum"):
        decode(save(entries, metadata=md))


def test_huge_finite_values_whose_norm_overflows_are_not_called_nonfinite():
    from trainer.compression import nonfinite_index

    huge = torch.full((64,), 3.0e38)
    assert not torch.isfinite(torch.linalg.vector_norm(huge))  # the fused check overflows...
    back = decode(encode({"w": huge}, "none"))  # ...and is confirmed element-wise
    assert torch.equal(back["w"], huge)
    bad = huge.clone()
    bad[5] = float("inf")
    assert nonfinite_index([torch.ones(3), huge, bad, torch.tensor([float("nan")])]) == 2
    assert nonfinite_index([torch.zeros(0), torch.ones(2)]) is None


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantizing_in_chunks_gives_the_same_entries(method, monkeypatch):
    from safetensors.torch import load

    import trainer.compression as compression

    t = {"w": torch.randn(1000) * 3, "v": torch.randn(33), "z": torch.zeros(64)}
    whole = load(encode(t, method))  # (safetensors writes the metadata in no fixed order)
    monkeypatch.setattr(compression, "_QUANT_CHUNK", 3)  # blocks 3 at a time, ragged last chunk
    chunked = load(encode(t, method))
    assert set(chunked) == set(whole) and all(torch.equal(chunked[k], whole[k]) for k in whole)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_entries_are_the_textbook_blockwise_quantization(method):
    """The fast path (a rounding constant instead of round/clamp/cast, small tensors pooled into
    one call) writes exactly clamp(round(x / scale), -qmax, qmax) with scale = max |x| / qmax per
    block, padded with zeros, int4 two per byte (first value in the low nibble, each + 8)."""
    from safetensors.torch import load

    from trainer.compression import _POOL_MAX, BLOCK, QMAX

    g = torch.Generator().manual_seed(3)
    t = {"big": torch.randn(_POOL_MAX + 64, generator=g), "ragged": torch.randn(45, generator=g) * 1e3,
         "norm": torch.randn(128, generator=g) * 1e-6, "bias": torch.randn(96, generator=g),
         "zeros": torch.zeros(32), "half": torch.randn(64, generator=g).to(torch.bfloat16),
         "ties": torch.tensor([7.0, 3.5, -2.5, 0.5, 1.5, -0.5] + [0.0] * 26)}
    entries = load(encode(t, method))
    block, qmax = BLOCK[method], QMAX[method]
    for name, x in t.items():
        flat = x.float().reshape(-1)
        blocks = torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)
        scale = blocks.abs().amax(dim=1) / qmax
        q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-qmax, qmax).reshape(-1)
        if method == "int4":
            q = (q[0::2] + 8) + 16 * (q[1::2] + 8)
        assert torch.equal(entries[f"s/{name}"], scale), name
        assert torch.equal(entries[f"q/{name}"].to(torch.int64), q.to(torch.int64)), name
        q = entries[f"q/{name}"].to(torch.int64)
        x_hat = ((entries[f"q/{name}"].to(torch.int64) if method == "int8" else
                  torch.stack([q % 16, q // 16], 1).reshape(-1) - 8).float().view(-1, block) * scale[:, None])
        decoded = decode(encode(t, method))[name].float().reshape(-1)
        assert torch.equal(decoded, x_hat.reshape(-1)[:flat.numel()]), name


@pytest.mark.parametrize(("method", "name", "entry", "value", "reason"), [
    ("int8", "b", "q", -128, "value out of the quantization range"),
    ("int4", "b", "s", -1.0, "negative scale"),
    ("int4", "a", "s", float("nan"), "non-finite scale"),
    ("int8", "big", "s", float("inf"), "non-finite scale"),
])
def test_a_bad_value_is_named_whether_its_tensor_was_pooled_or_not(method, name, entry, value, reason):
    """Values are checked over all the tensors at once; the error still names the tensor."""
    from safetensors.torch import load

    from trainer.compression import _POOL_MAX, _safetensors_bytes, entries_checksum, read_header

    t = {"a": torch.randn(64), "b": torch.randn(96), "big": torch.randn(_POOL_MAX + 32)}
    blob = encode(t, method)
    entries = load(blob)
    entries[f"{entry}/{name}"][1] = value
    metadata = dict(read_header(blob)["__metadata__"], wire_checksum=entries_checksum(entries))
    with pytest.raises(InvalidPayload, match=f"tensor '{name}': {reason}"):
        decode(_safetensors_bytes(entries, metadata))


@pytest.mark.parametrize("method", METHODS)
def test_our_safetensors_writer_is_read_by_safetensors_and_its_files_by_us(method):
    """encode writes the safetensors layout itself (one copy); the library must agree with it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load, save

    t = _tensors()
    t["half"] = torch.randn(5, 3).to(torch.bfloat16)
    t["empty"] = torch.zeros(0, 4)
    blob = encode(t, method, meta={"kind": "x"})
    (hlen,) = struct.unpack("<Q", blob[:8])
    assert hlen % 8 == 0  # the data starts 8-byte aligned, as safetensors writes it
    entries = load(blob)
    header = json.loads(blob[8:8 + hlen])
    assert sorted(k for k in header if k != "__metadata__") == sorted(entries)
    rewritten = save(entries, metadata=header["__metadata__"])  # the library's own file of the same entries
    for b in (blob, rewritten):
        back = decode(b)
        assert set(back) == set(t)
        assert all(back[n].shape == t[n].shape for n in t)
    assert all(torch.equal(decode(blob)[n], decode(rewritten)[n]) for n in t)
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # the file reader agrees too
        path = os.path.join(d, "p.safetensors")
        with open(path, "wb") as f:
            f.write(blob)
        with safe_open(path, framework="pt") as f:
            assert sorted(f.keys()) == sorted(entries)
            assert f.metadata() == header["__metadata__"]
            assert all(torch.equal(f.get_tensor(k), entries[k]) for k in entries)
