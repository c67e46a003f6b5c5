"""Fragments (Streaming DiLoCo): the model's parameters split into P groups synced in turn.

`strided`: parameters are grouped into units (one unit per repeated block such as
`blocks.3`, else per top-level module such as `wte`); unit j goes to fragment j mod P, so
each fragment holds layers spread over the depth. When P exceeds the number of units,
tensors are dealt out one by one instead.
`balanced`: tensors are packed into P fragments of near-equal size (largest first into the
currently smallest fragment), for the smoothest bandwidth. Tensors are never cut.

Schedule: fragment p of P syncs after inner steps where step mod H == floor(H (p+1) / P) mod H
(torchft's offsets), so with P = H one fragment syncs after every inner step and with P = 1
the whole model syncs every H steps, as in classic DiLoCo.
"""

from __future__ import annotations

import re

import torch
from torch import nn

_UNIT_RE = re.compile(r"^(.*?\.\d+)\.")


def named_tensors(model: nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(model, nn.Module):
        return dict(model.named_parameters())
    return dict(model)


def _unit(name: str) -> str:
    m = _UNIT_RE.match(name)
    return m.group(1) if m else name.split(".", 1)[0]


def make_fragments(
    model: nn.Module | dict[str, torch.Tensor], P: int, mode: str = "strided"
) -> list[list[str]]:
    """Parameter names per fragment, each list in model order. Deterministic."""
    tensors = named_tensors(model)
    names = list(tensors)
    if P < 1:
        raise ValueError("fragments must be >= 1")
    if len(names) < P:
        raise ValueError(f"{P} fragments but the model has only {len(names)} parameter tensors")
    order = {n: i for i, n in enumerate(names)}
    if mode == "strided":
        units: dict[str, list[str]] = {}
        for n in names:
            units.setdefault(_unit(n), []).append(n)
        groups = list(units.values())
        out: list[list[str]] = [[] for _ in range(P)]
        if len(groups) >= P:
            for j, g in enumerate(groups):
                out[j % P].extend(g)
        else:
            for j, n in enumerate(names):
                out[j % P].append(n)
    elif mode == "balanced":
        out = [[] for _ in range(P)]
        sizes = [0] * P
        for n in sorted(names, key=lambda n: (-tensors[n].numel(), order[n])):
            i = min(range(P), key=lambda k: (sizes[k], k))
            out[i].append(n)
            sizes[i] += tensors[n].numel()
    else:
        raise ValueError(f"unknown fragment mode {mode!r}: use strided or balanced")
    return [sorted(f, key=order.__getitem__) for f in out]


def fragment_offset(p: int, H: int, P: int) -> int:
    """Inner step (1..H) within a cycle after which fragment p syncs."""
    return (H * (p + 1)) // P


def sync_schedule(step: int, H: int, P: int) -> list[int]:
    """Fragments due after inner step `step` (1-based count of steps taken in the cycle or run)."""
    if step < 1:
        return []
    return [p for p in range(P) if step % H == fragment_offset(p, H, P) % H]


def fragment_numel(model: nn.Module | dict[str, torch.Tensor], fragments: list[list[str]]) -> list[int]:
    tensors = named_tensors(model)
    return [sum(tensors[n].numel() for n in f) for f in fragments]
