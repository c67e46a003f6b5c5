"""The C merge (trainer.merge_native) against the torch path it replaces: the same bits of
weights, momentum and merged update, and the reported norms and dot products to rounding, for
every combine and step rule."""

from __future__ import annotations

import pytest
import torch

from trainer import merge_native
from trainer.fused import Combine, FragmentLayout, OuterStep, fused_merge

SHAPES = [(64, 33), (7,), (), (300, 5), (1000,)]
KERNEL = merge_native.kernel  # the real one, before any test patches it


def _run(native: bool, monkeypatch, combine: Combine, momentum: str, k: int = 3):
    monkeypatch.setattr(merge_native, "kernel", KERNEL if native else lambda: None)
    calls = []
    monkeypatch.setattr(merge_native, "native_merge",
                        lambda *a, real=merge_native.native_merge: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    layout = FragmentLayout([torch.Size(s) for s in SHAPES], chunk=500)
    params = torch.randn(layout.numel, generator=g)
    mom = None if momentum == "none" else torch.randn(layout.numel, generator=g)
    deltas = [[torch.randn(s, generator=g) * (m + 1) for s in SHAPES] for m in range(k)]
    acc = torch.empty(layout.numel)
    step = OuterStep(0.7, 0.9, mom, fresh=momentum == "fresh")
    norms, dots = fused_merge(layout, deltas, combine, acc, params, step)
    assert bool(calls) == native  # the path asked for is the path taken
    return params, mom, acc, norms, dots


def _combines(k: int = 3):
    n = len(SHAPES)
    yield Combine(alpha=[0.5, 0.3, 0.2][:k])
    yield Combine(alpha=[[0.1 * (m + 1) + 0.01 * i for i in range(n)] for m in range(k)],
                  magnitude=[1.0 + i for i in range(n)], embedding=[i == 0 for i in range(n)])


@pytest.mark.skipif(merge_native.kernel() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("momentum", ["none", "fresh", "kept"])
@pytest.mark.parametrize("which", [0, 1], ids=["weighted-mean", "rda"])
def test_the_c_merge_matches_the_torch_path(monkeypatch, momentum, which):
    combine = list(_combines())[which]
    ours = _run(True, monkeypatch, combine, momentum)
    ref = _run(False, monkeypatch, combine, momentum)
    for a, b in zip(ours[:3], ref[:3], strict=True):
        if b is not None:
            assert torch.equal(a, b)
    assert ours[3] == pytest.approx(ref[3], rel=1e-5)
    assert ours[4] == pytest.approx(ref[4], rel=1e-4)


@pytest.mark.skipif(merge_native.kernel() is None, reason="no C compiler on this machine")
def test_the_c_merge_is_deterministic(monkeypatch):
    combine = list(_combines())[1]
    a, b = (_run(True, monkeypatch, combine, "kept") for _ in range(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[3] == b[3] and a[4] == b[4]


def test_switched_off_or_without_a_compiler_the_torch_path_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("DILOCO_NATIVE_MERGE", "0")
    assert merge_native.kernel() is None
    monkeypatch.delenv("DILOCO_NATIVE_MERGE")
    monkeypatch.setenv("DILOCO_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert merge_native._load() is None  # a failed build is no kernel, not an error
    combine = list(_combines())[0]
    monkeypatch.setattr(merge_native, "kernel", lambda: None)
    params, _, _, norms, _ = _run(False, monkeypatch, combine, "kept")
    assert torch.isfinite(params).all() and len(norms) == len(SHAPES)


def test_a_non_contiguous_contribution_takes_the_torch_path(monkeypatch):
    t = torch.randn(4, 6)[:, ::2]
    assert not merge_native.usable(t) and not merge_native.usable(torch.zeros(3, dtype=torch.bfloat16))
    assert merge_native.usable(torch.zeros(3))
