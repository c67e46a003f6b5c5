"""The simulator's wire: uploads land when the link delivers them, checkpoints behind them (kept
as recipes until read), and a learner sees a new head only when its download has arrived."""

from __future__ import annotations

import pytest

from trainer.clock import ManualClock
from trainer.runtime import keys
from trainer.runtime.writer import InlineWriter
from trainer.sim.wire import LazyStore, LearnerWire, land


def _wire(store, clock, landed):
    """Every upload takes 2 s; landings are collected instead of queued."""
    return LearnerWire(store, "j", clock.now, lambda p, t: t + 2.0,
                       lambda at, k, d: landed.append((at, k, d)))


def test_uploads_land_later_and_a_checkpoint_waits_behind_them():
    store, clock, landed = LazyStore(), ManualClock(), []
    wire = _wire(store, clock, landed)
    ckpt = keys.learner_ckpt_key("j", 0, 0)
    wire.put(ckpt, b"first")  # nothing in flight: written at once
    assert store.get(ckpt) == b"first"
    contrib = keys.contrib_key("j", 0, 0, 0, 0, 0, 10)
    wire.put(contrib, b"c")
    builds = []
    InlineWriter(wire).put(ckpt, lambda: builds.append(1) or b"second")
    assert [(at, k) for at, k, _ in landed] == [(2.0, contrib), (2.0, ckpt)]
    assert not store.exists(contrib) and store.get(ckpt) == b"first"
    clock.set(2.0)
    for _, k, d in landed:
        land(store, k, d)
    assert store.get(contrib) == b"c" and not builds  # the checkpoint is still a recipe
    assert store.list(keys.learner_prefix("j", 0)) == [ckpt] and store.exists(ckpt)
    assert store.get(ckpt) == b"second" and builds == [1]
    store.get(ckpt)
    assert builds == [1]  # built once
    store.delete(ckpt)
    assert not store.exists(ckpt)


def test_a_learner_sees_a_version_only_once_it_arrived():
    store, clock = LazyStore(), ManualClock()
    store.put(keys.head_key("j"), keys.head_blob({0: 5}, {0: 1}))
    wire = _wire(store, clock, [])
    with pytest.raises(KeyError):  # no download has arrived yet
        wire.get(keys.head_key("j"))
    wire.arrived(0, 3, 1)
    wire.arrived(0, 2, 1)  # an older download arriving late changes nothing
    assert keys.parse_head(wire.get(keys.head_key("j"))) == ({0: 3}, {0: 1})


def test_sparse_methods_have_a_wire_rate():
    """The top-k methods of trainer.compression price like their payloads: offsets, codes, scales."""
    import torch

    from trainer.compression import encode
    from trainer.sim.fleet import wire_bytes_per_param

    torch.manual_seed(0)
    tensors = {"w": torch.randn(64 * 4096)}
    for method in ("topk2", "topk4"):
        real = len(encode(tensors, method)) / tensors["w"].numel()
        model = wire_bytes_per_param(method)
        assert abs(model - real) / real < 0.05, (method, model, real)
