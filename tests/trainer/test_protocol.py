from __future__ import annotations

import pytest
import torch

from trainer.compression import encode
from trainer.protocol import Contribution, GlobalFragment, InvalidPayload


def _c(**kw):
    base = {
        "job": "job-7",
        "learner": 2,
        "incarnation": 1,
        "fragment": 0,
        "base_version": 3,
        "tokens": 512,
        "inner_steps": 4,
        "tensors": {"a": torch.randn(4, 4), "b": torch.randn(3)},
    }
    base.update(kw)
    return Contribution(**base)


def test_contribution_roundtrip_none_keeps_checksum():
    c = _c()
    blob = c.to_bytes("none")
    back = Contribution.from_bytes(blob, expected={"a": (4, 4), "b": (3,)})
    assert back.key == c.key == (2, 1, 0, 3)
    assert (back.job, back.tokens, back.inner_steps) == ("job-7", 512, 4)
    assert back.checksum == c.checksum
    assert back.wire_bytes == len(blob)
    assert all(torch.equal(back.tensors[n], c.tensors[n]) for n in c.tensors)


def test_contribution_int4_recomputes_checksum_of_what_arrived():
    c = _c()
    back = Contribution.from_bytes(c.to_bytes("int4"))
    assert back.checksum != c.checksum
    assert back.tensors["a"].dtype == torch.float32


def test_expected_shapes_enforced():
    blob = _c().to_bytes()
    with pytest.raises(InvalidPayload, match="shape"):
        Contribution.from_bytes(blob, expected={"a": (4, 3), "b": (3,)})
    with pytest.raises(InvalidPayload, match="names"):
        Contribution.from_bytes(blob, expected={"a": (4, 4)})


def test_header_fields_validated():
    tensors = {"a": torch.randn(2)}
    bad = encode(
        tensors,
        "none",
        meta={
            "kind": "contribution",
            "job": "j",
            "learner": -1,
            "incarnation": 0,
            "fragment": 0,
            "base_version": 0,
            "tokens": 5,
            "inner_steps": 1,
        },
    )
    with pytest.raises(InvalidPayload, match="learner"):
        Contribution.from_bytes(bad)
    bad = encode(
        tensors,
        "none",
        meta={
            "kind": "contribution",
            "job": "j",
            "learner": 0,
            "incarnation": 0,
            "fragment": 0,
            "base_version": 0,
            "tokens": "5",
            "inner_steps": 1,
        },
    )
    with pytest.raises(InvalidPayload, match="tokens"):
        Contribution.from_bytes(bad)
    with pytest.raises(InvalidPayload, match="not a contribution"):
        Contribution.from_bytes(encode(tensors, "none"))


def test_global_fragment_roundtrip_and_kind_check():
    g = GlobalFragment(job="j", fragment=1, version=9, tensors={"w": torch.randn(5)})
    back = GlobalFragment.from_bytes(g.to_bytes())
    assert (back.fragment, back.version) == (1, 9)
    assert torch.equal(back.tensors["w"], g.tensors["w"])
    with pytest.raises(InvalidPayload, match="not a global"):
        GlobalFragment.from_bytes(_c().to_bytes())
    with pytest.raises(InvalidPayload, match="not a contribution"):
        Contribution.from_bytes(g.to_bytes())


def test_global_update_header_round_trip_and_bounds():
    t = {"w": torch.linspace(-1, 1, 64).reshape(8, 8)}
    upd = GlobalFragment("job", 0, 5, t, base_version=4)
    back = GlobalFragment.from_bytes(upd.to_bytes("int8"), expected={"w": (8, 8)})
    assert back.is_update and back.base_version == 4 and back.version == 5
    whole = GlobalFragment.from_bytes(GlobalFragment("job", 0, 5, t).to_bytes("none"))
    assert not whole.is_update and torch.equal(whole.tensors["w"], t["w"])
    with pytest.raises(InvalidPayload, match="base_version"):
        GlobalFragment.from_bytes(GlobalFragment("job", 0, 5, t, base_version=5).to_bytes("none"))
