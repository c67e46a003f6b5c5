"""Django-free glue: blob keys, the no-pickle state codec, the ordered writer, the ledger."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from apps.coordinator.syncer import Ledger
from trainer.runtime import codec, keys
from trainer.runtime.writer import OrderedWriter


def test_contrib_key_roundtrip():
    k = keys.contrib_key(7, 3, 2, 1, 12, 1000, 2048)
    ref = keys.parse_contrib_key(k)
    assert (ref.learner, ref.incarnation, ref.fragment, ref.base_version, ref.start, ref.end) == \
        (3, 2, 1, 12, 1000, 2048)
    assert keys.parse_contrib_key("jobs/7/contrib/garbage") is None
    # an inverted range is not a contribution
    assert keys.parse_contrib_key(keys.contrib_key(7, 3, 2, 1, 12, 5, 4)) is None
    # sorting keys of one learner sorts by incarnation, then fragment, then base version
    ks = [keys.contrib_key(1, 0, i, 0, v, 0, 1) for i in (2, 10) for v in (3, 1)]
    assert sorted(ks) == [ks[1], ks[0], ks[3], ks[2]]


def test_codec_roundtrip_without_pickle():
    state = {"w": torch.randn(3, 4), "step": 5, "versions": {0: 3, 1: 4}, "betas": (0.9, 0.95),
             "seen": {(1, 2), (3, 4)}, "cursor": np.arange(5, dtype=np.int64), "name": "x", "none": None,
             "nested": [{"m": torch.zeros(2, dtype=torch.bfloat16)}], "raw": b"\x00\x01", "f": 1.5}
    out = codec.unpack(codec.pack(state))
    assert torch.equal(out["w"], state["w"])
    assert out["versions"] == {0: 3, 1: 4}
    assert out["betas"] == (0.9, 0.95)
    assert out["seen"] == {(1, 2), (3, 4)}
    assert np.array_equal(out["cursor"], state["cursor"])
    assert out["nested"][0]["m"].dtype == torch.bfloat16
    assert out["raw"] == b"\x00\x01" and out["none"] is None and out["f"] == 1.5


def test_codec_refuses_garbage_and_unknown_types():
    with pytest.raises(codec.CodecError):
        codec.unpack(b"\x05")
    with pytest.raises(codec.CodecError):
        codec.unpack(b"\xff" * 8 + b"{}")
    with pytest.raises(codec.CodecError):
        codec.pack({"f": object()})


class SlowStore:
    def __init__(self):
        self.data, self.order = {}, []
        self.lock = threading.Lock()

    def put(self, key, data):
        time.sleep(0.01)
        with self.lock:
            self.data[key] = data
            self.order.append(key)


def test_ordered_writer_keeps_order_and_flushes():
    s = SlowStore()
    w = OrderedWriter(s, maxsize=4)
    for i in range(10):
        w.put(f"k{i}", (lambda i=i: str(i).encode()) if i % 2 else str(i).encode())
    assert w.flush(timeout=5)
    assert s.order == [f"k{i}" for i in range(10)]
    assert w.bytes_written == 10 and not w.errors
    w.close()


def test_ledger_detects_overlaps_and_merges_ranges():
    led = Ledger()
    led.add(0, 0, 0, 100)
    led.add(0, 0, 100, 250)
    assert led.ranges[(0, 0)] == [[0, 250]]
    assert led.overlaps(0, 0, 200, 300)
    assert not led.overlaps(0, 0, 250, 300)
    assert not led.overlaps(1, 0, 0, 100)
    assert led.covered(0, 0) == 250
    again = Ledger(led.to_dict())
    assert again.ranges == led.ranges


def test_head_and_global_keys_carry_the_committing_epoch():
    blob = keys.head_blob({0: 5, 1: 3}, {0: 1, 1: 2})
    versions, epochs = keys.parse_head(blob)
    assert versions == {0: 5, 1: 3} and epochs == {0: 1, 1: 2}
    # a fenced syncer (epoch 1) can never overwrite what epoch 2 committed for the same version
    assert keys.global_key(7, 1, 3, 2) != keys.global_key(7, 1, 3, 1)
    assert keys.syncer_state_key(7, 9, 2) != keys.syncer_state_key(7, 9, 1)
    # heads written without epochs still parse
    assert keys.parse_head(b'{"0": 4}') == ({0: 4}, {})
    # syncer shards: shard 0 keeps the plain names, the others get their own head and snapshots
    assert keys.head_keys(7, 3) == ["jobs/7/head", "jobs/7/head-s01", "jobs/7/head-s02"]
    assert keys.head_key(7) == keys.head_key(7, 0) == "jobs/7/head"
    assert keys.syncer_state_key(7, 9, 2, shard=1) != keys.syncer_state_key(7, 9, 2)
