"""Sparse pseudo-gradients (issue 38): chunked top-k with 2- / 4-bit values and error feedback.

What is sent plus what the learner keeps is its input (exactly where nothing was sent, up to one
fp32 rounding where a value was); each chunk sends ceil(density x chunk) values; a resume from a
checkpoint continues bit for bit, the error buffer included; malformed sparse payloads are
refused, each kind with its own message; the spec bounds the density.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load

from trainer.compression import (
    DEFAULT_DENSITY,
    MAX_DENSITY,
    SPARSE_BITS,
    SPARSE_CHUNK,
    InvalidPayload,
    _safetensors_bytes,
    decode,
    densify,
    encode,
    entries_checksum,
    payload_bytes,
    read_header,
    sparse_sizes,
    sparsify,
)
from trainer.config import ConfigError, TrainConfig
from trainer.learner import Learner
from trainer.protocol import Contribution
from trainer.runtime.codec import pack, unpack
from trainer.spec import JobSpec, spec_errors
from trainer.train import LocalRun

SPARSE = sorted(SPARSE_BITS)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3 * SPARSE_CHUNK + 100, generator=g),  # three whole chunks and a tail
        "m": torch.randn(64, 48, generator=g) * 1e-3,            # one short chunk
        "one": torch.randn(1, generator=g),
        "zeros": torch.zeros(40),
        "empty": torch.zeros(0, 7),
    }


def _shapes(t: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {n: list(v.shape) for n, v in t.items()}


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize("density", [0.01, DEFAULT_DENSITY, 0.3])
def test_sent_plus_kept_is_the_input(method, density):
    x = _tensors()
    sent = decode(encode(x, method, density=density))
    assert torch.equal(densify(sparsify(x, method, density), _shapes(x), method, density)["w"], sent["w"])
    for n, t in x.items():
        assert sent[n].shape == t.shape and sent[n].dtype == torch.float32
        kept = t - sent[n]
        unsent = sent[n] == 0
        assert torch.equal(kept[unsent], t[unsent]), n  # exactly: nothing of it went out
        # where a value went: one rounding of the subtraction, |error| <= 2**-24 |kept|
        err = (sent[n] + kept - t)[~unsent].abs()
        assert bool((err <= kept[~unsent].abs() * 2.0**-24 + 1e-45).all()), n
    # each sent value is within half a quantization step of the input: |x - sent| <= scale / L
    top = (1 << SPARSE_BITS[method]) - 1
    w, s = x["w"][: 3 * SPARSE_CHUNK].view(3, -1), sent["w"][: 3 * SPARSE_CHUNK].view(3, -1)
    scale = w.abs().amax(dim=1, keepdim=True)
    picked = s != 0
    assert bool(((w - s).abs()[picked] <= (scale / top).expand_as(w)[picked] * (1 + 1e-6)).all())


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize("density", [0.001, DEFAULT_DENSITY, 0.1, MAX_DENSITY])
def test_density_is_respected_per_chunk(method, density):
    x = _tensors(1)
    sent = decode(encode(x, method, density=density))
    w = sent["w"]
    k = math.ceil(density * SPARSE_CHUNK)
    for c in range(3):
        chunk = w[c * SPARSE_CHUNK:(c + 1) * SPARSE_CHUNK]
        assert int((chunk != 0).sum()) == k
        # the largest |values| of the chunk are the ones sent
        top = x["w"][c * SPARSE_CHUNK:(c + 1) * SPARSE_CHUNK].abs().topk(k).indices
        assert bool((chunk[top] != 0).all())
    assert int((w[3 * SPARSE_CHUNK:] != 0).sum()) == math.ceil(density * 100)
    assert int((sent["m"] != 0).sum()) == math.ceil(density * 64 * 48)
    assert int((sent["one"] != 0).sum()) == 1
    assert int((sent["zeros"] != 0).sum()) == 0 and sent["empty"].shape == (0, 7)
    # the wire size: 2 bytes of offset and bits / 8 of value per sent value, 4 per chunk, a header
    blob = encode({"w": x["w"]}, method, density=density)
    body = payload_bytes(x["w"].numel(), method, density)
    assert body < len(blob) < body + 1024
    count, chunks = sparse_sizes(x["w"].numel(), density)
    assert (count, chunks) == (3 * k + math.ceil(density * 100), 4)
    assert len(blob) < 4 * x["w"].numel() * max(0.05, 3 * density)


# -- malformed payloads ------------------------------------------------------------------------
def _forge(blob: bytes, change) -> bytes:
    """The payload with its entries / metadata changed by `change(entries, metadata)` and a valid
    checksum again, so only the sparse checks can refuse it."""
    entries = st_load(blob)
    metadata = dict(read_header(blob)["__metadata__"])
    change(entries, metadata)
    metadata["wire_checksum"] = entries_checksum(entries)
    return _safetensors_bytes(entries, metadata)


def _set(name, index, value):
    def change(entries, _):
        entries[name] = entries[name].clone()
        entries[name][index] = value
    return change


def _replace(name, make):
    def change(entries, _):
        entries[name] = make(entries[name])
    return change


def _meta(key, value):
    def change(_, metadata):
        metadata[key] = value
    return change


def _declared_shape(shape):
    def change(_, metadata):
        spec = json.loads(metadata["tensors"])
        spec["w"]["shape"] = shape
        metadata["tensors"] = json.dumps(spec)
    return change


def _swap_first_two(t):
    t = t.clone()
    t[0], t[1] = t[1].clone(), t[0].clone()
    return t


MALFORMED = [
    ("offset out of its chunk", _set("i/w", 0, SPARSE_CHUNK), "sparse offset out of its chunk"),
    ("offset out of the tail chunk", _set("i/w", -1, 100), "sparse offset out of its chunk"),
    ("duplicate offset", _replace("i/w", lambda t: torch.cat([t[:1], t[:-1]])), "not strictly ascending"),
    ("unsorted offsets", _replace("i/w", _swap_first_two), "not strictly ascending"),
    ("one offset too few", _replace("i/w", lambda t: t[:-1]), "wrong number of values"),
    ("one scale too many", _replace("s/w", lambda t: torch.cat([t, t[:1]])), "wrong number of values"),
    ("codes too short", _replace("q/w", lambda t: t[:-1]), "wrong number of values"),
    ("offsets as uint8", _replace("i/w", lambda t: t.to(torch.int32).to(torch.uint8)), "wrong dtype"),
    ("offsets as float32", _replace("i/w", lambda t: t.to(torch.float32)), "wrong dtype"),
    ("codes as int8", _replace("q/w", lambda t: t.view(torch.int8)), "wrong dtype"),
    ("scales as bf16", _replace("s/w", lambda t: t.to(torch.bfloat16)), "wrong dtype"),
    ("missing offsets", lambda e, _: e.pop("i/w"), "missing"),
    ("negative scale", _set("s/w", 0, -1.0), "negative scale"),
    ("NaN scale", _set("s/w", 1, float("nan")), "non-finite scale"),
    ("Inf scale", _set("s/w", 0, float("inf")), "non-finite scale"),
    ("declared shape larger", _declared_shape([3 * SPARSE_CHUNK + 4196]), "wrong number of values"),
    ("declared shape smaller", _declared_shape([3 * SPARSE_CHUNK]), "wrong number of values"),
    ("density above the bound", _meta("density", "0.75"), "bad density"),
    ("density zero", _meta("density", "0.0"), "bad density"),
    ("density not a number", _meta("density", "lots"), "bad density"),
    ("density missing", lambda _, m: m.pop("density"), "bad density"),
    ("other density", _meta("density", "0.05"), "wrong number of values"),
    ("other chunk", _meta("block", "1024"), "chunk 1024 is not"),
    ("chunk too large", _meta("block", "70000"), "chunk must be in"),
    ("an extra entry", _replace("s/w", lambda t: t), None),
]


@pytest.mark.parametrize("method", SPARSE)
@pytest.mark.parametrize(("case", "change", "message"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_sparse_payloads_are_refused(method, case, change, message):
    x = {"w": torch.randn(3 * SPARSE_CHUNK + 100), "b": torch.randn(10)}
    blob = encode(x, method)
    decode(blob)  # the untouched payload is fine
    if message is None:  # an entry no tensor declares
        def change(entries, _):  # noqa: F811 - this case builds its own
            entries["x/extra"] = torch.zeros(1)
        message = "unexpected entries"
    with pytest.raises(InvalidPayload, match=message):
        decode(_forge(blob, change))


@pytest.mark.parametrize("method", SPARSE)
def test_nonzero_padding_bits_and_flipped_bytes_are_refused(method):
    x = {"w": torch.randn(3 * SPARSE_CHUNK + 101)}  # 3 x 82 + 3 = 249 values: the last byte is padded
    blob = encode(x, method)
    with pytest.raises(InvalidPayload, match="padding bits"):
        decode(_forge(blob, _set("q/w", -1, 0xFF)))
    raw = bytearray(blob)
    raw[-3] ^= 0x10
    with pytest.raises(InvalidPayload, match="checksum"):
        decode(bytes(raw))


def test_a_contribution_sends_the_senders_own_entries():
    """`Contribution.to_bytes` with the learner's method sends its entries as they are: the bytes
    equal an encode of the compensated values the entries were made from."""
    x = _tensors(2)
    entries = sparsify(x, "topk4", 0.05)
    dense = densify(entries, _shapes(x), "topk4", 0.05)
    c = Contribution(job="j", learner=0, incarnation=0, fragment=0, base_version=0, tokens=8,
                     inner_steps=2, tensors=dense, sparse=("topk4", 0.05, entries))
    blob = c.to_bytes("topk4")
    assert blob == encode(x, "topk4", meta=c.header(), density=0.05)
    back = Contribution.from_bytes(blob, expected={n: tuple(t.shape) for n, t in x.items()})
    for n in x:
        assert torch.equal(back.tensors[n], dense[n])
    assert read_header(blob)["__metadata__"]["density"] == "0.05"


# -- error feedback in the learner ---------------------------------------------------------------
@pytest.mark.parametrize("method", SPARSE)
def test_learner_keeps_what_it_did_not_send(small_config, stdlib_corpus, method):
    """After an adoption settles a sparse send: residual = (base - local_at_send + residual_before)
    - sent, bit for bit as the learner computes it, and sent + residual equals that input up to one
    rounding; the next contribution adds the residual to its pseudo-gradient before compressing."""
    cfg = small_config(learners=1, inner_steps=4, fragments=1, steps=8, compression=method,
                       compression_density=0.05)
    run = LocalRun(cfg, "decoupled", corpus=stdlib_corpus)
    learner = run.learners[0]
    run.run(until_steps=4)  # one send, merged (quorum 1)
    names = learner.fragments[0]
    assert learner.outstanding(0) and learner._pending[0] is not None
    snapshot = {n: learner._sent[0][n].clone() for n in names}
    inp = {n: learner.base[0][n] - snapshot[n] for n in names}  # no residual before the first send
    sent = densify(learner._pending[0], {n: list(inp[n].shape) for n in names}, method, 0.05)
    run._deliver(learner)  # adopts the merged global: the send is settled
    assert learner._pending[0] is None and not learner.outstanding(0)
    for n in names:
        kept = learner.residual[0][n]
        assert torch.equal(kept, inp[n] - sent[n]), n
        assert torch.allclose(sent[n] + kept, inp[n], rtol=0, atol=float(inp[n].abs().max()) * 2.0**-23)
        assert torch.equal(kept[sent[n] == 0], inp[n][sent[n] == 0])
    frac = sum(int((sent[n] != 0).sum()) for n in names) / sum(inp[n].numel() for n in names)
    assert 0.05 <= frac < 0.06
    # the next contribution compresses (base - local) + residual
    run.run(until_steps=8)
    c_entries = learner._pending[0]
    local = [learner._sent[0][n] for n in names]
    want = {n: learner.base[0][n] - x + learner.residual[0][n] for n, x in zip(names, local, strict=True)}
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
               for a, b in zip((c_entries[n] for n in names),
                               (sparsify(want, method, 0.05)[n] for n in names), strict=True))


def test_a_refused_sparse_send_leaves_the_residual_as_it_was(small_config, stdlib_corpus):
    cfg = small_config(learners=1, inner_steps=2, fragments=1, steps=6, compression="topk2")
    learner = Learner(cfg, 0, corpus=stdlib_corpus)
    for _ in range(2):
        learner.step()
    learner.due_contributions()
    assert learner._pending[0] is not None
    learner.refused(0)
    assert learner._pending[0] is None and learner.residual == {}
    for _ in range(2):  # the next send carries the whole progress again, nothing kept twice
        learner.step()
    (c,) = learner.due_contributions()
    names = learner.fragments[0]
    delta = {n: learner.base[0][n] - learner._sent[0][n] for n in names}
    want = densify(sparsify(delta, "topk2"), {n: list(t.shape) for n, t in delta.items()}, "topk2")
    assert all(torch.equal(c.tensors[n], want[n]) for n in names)


@pytest.mark.parametrize("global_compression", ["int4", "topk4"])
def test_resume_keeps_the_error_buffer_and_continues_bit_for_bit(small_config, stdlib_corpus,
                                                                 global_compression):
    """A run checkpointed mid-cycle (sends outstanding, residuals held), packed with the runtime's
    codec, dropped and restored, ends with the same bits as the run that never stopped."""
    cfg = small_config(learners=2, quorum=1, inner_steps=4, fragments=2, steps=20, outer_lr=0.7,
                       outer_momentum=0.9, compression="topk4", compression_density=0.05,
                       global_compression=global_compression)
    full = LocalRun(cfg, "decoupled", corpus=stdlib_corpus)
    full.run()
    part = LocalRun(cfg, "decoupled", corpus=stdlib_corpus)
    part.run(until_steps=10)  # a send of fragment 0 outstanding, residuals of both held
    assert any(learner.residual for learner in part.learners)
    assert any(p is not None for learner in part.learners for p in learner._pending.values())
    blob = pack(part.state_dict())
    held = {m: {p: {n: t.clone() for n, t in d.items()} for p, d in learner.residual.items()}
            for m, learner in enumerate(part.learners)}
    del part
    resumed = LocalRun(cfg, "decoupled", corpus=stdlib_corpus)
    resumed.load_state_dict(unpack(blob))
    for m, learner in enumerate(resumed.learners):  # the error buffer came back as it was
        assert set(learner.residual) == set(held[m])
        for p, d in held[m].items():
            assert all(torch.equal(learner.residual[p][n], t) for n, t in d.items())
    resumed.run()
    for n, t in full.syncer.params.items():
        assert torch.equal(t, resumed.syncer.params[n]), n
    for a, b in zip(full.learners, resumed.learners, strict=True):
        for n in a.params:
            assert torch.equal(a.params[n], b.params[n]), n
        assert set(a.residual) == set(b.residual)
        for p in a.residual:
            assert all(torch.equal(a.residual[p][n], b.residual[p][n]) for n in a.residual[p])
    assert full.report()["final_val_loss"] == resumed.report()["final_val_loss"]
    assert full.report()["bytes_up"] == resumed.report()["bytes_up"]


def test_a_new_incarnation_forgets_the_pending_send_but_keeps_the_residual(small_config, stdlib_corpus):
    cfg = small_config(learners=1, quorum=1, inner_steps=2, fragments=1, steps=8, compression="topk4")
    run = LocalRun(cfg, "decoupled", corpus=stdlib_corpus)
    run.run(until_steps=4)  # the send of step 4 is merged, not yet adopted; step 2's is settled
    learner = run.learners[0]
    state = unpack(pack(learner.state_dict()))
    assert learner.residual and learner._pending[0] is not None
    fresh = Learner(cfg, 0, incarnation=1, corpus=stdlib_corpus)
    fresh.load_state_dict(state)
    assert fresh._pending[0] is None and not fresh.outstanding(0)
    assert all(torch.equal(fresh.residual[0][n], t) for n, t in learner.residual[0].items())


# -- spec and config bounds ------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0, -0.1, 0.51, 1.0, "x"])
def test_spec_bounds_the_density(density):
    with pytest.raises(ValidationError) as exc:
        JobSpec(compression="topk2", compression_density=density)
    assert "compression_density" in spec_errors(exc.value)


def test_spec_accepts_the_sparse_methods_and_carries_them_to_the_engine():
    spec = JobSpec(compression="topk2", global_compression="topk4", compression_density=0.01)
    cfg = TrainConfig.from_spec(spec)
    assert (cfg.compression, cfg.global_compression, cfg.compression_density) == ("topk2", "topk4", 0.01)
    assert JobSpec().compression_density == DEFAULT_DENSITY
    with pytest.raises(ValidationError) as exc:
        JobSpec(compression="topk3")
    assert "compression" in spec_errors(exc.value)


@pytest.mark.parametrize("density", [0, 0.6, True])
def test_config_bounds_the_density(density):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(compression_density=density)
    assert "compression_density" in exc.value.errors


def test_encode_refuses_a_density_out_of_bounds():
    with pytest.raises(ValueError, match="density"):
        encode({"w": torch.randn(10)}, "topk2", density=0.9)
